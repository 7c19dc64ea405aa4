// Torch binding of the LoCo kernels (loco_kernels.cu), one call per hop per bucket: the CUDA implementations of the
// torch.library ops deepspeed_loco::quantize_bucket_, requantize_bucket_ and final_mean_bucket (registered in
// deepspeed_loco/ops/library.py; called through deepspeed_loco/ops/loco_cuda.py), and the live rho's sample gather
// (gather_sample). Every argument is a tensor, a list of tensors or a scalar (the ops' schemas): no Python object is
// read here. The binding boundary is where everything
// is validated (TORCH_CHECK with the argument's name): the hop's scalars against the limits of loco_limits.h (the
// one source of the limits; Python reads the same file), the wire widths, devices, dtypes, shapes and strides. It
// then writes the bucket's parameter table (loco::BucketItem) to the device with one asynchronous copy and launches
// one kernel on the current CUDA stream.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <cstring>
#include <string>
#include <vector>

#include "loco_kernels.cuh"
#include "loco_limits.h"

namespace py = pybind11;

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <size_t N>
bool one_of(int64_t value, const int (&set)[N]) {
    for (const int v : set)
        if (v == value) return true;
    return false;
}

template <size_t N>
std::vector<int64_t> as_vector(const int (&set)[N]) {
    return std::vector<int64_t>(set, set + N);
}

// "2, 3, 4 or 8" for the set {2, 3, 4, 8}.
template <size_t N>
std::string listed(const int (&set)[N]) {
    std::string out;
    for (size_t i = 0; i < N; ++i) out += (i == 0 ? "" : i + 1 == N ? " or " : ", ") + std::to_string(set[i]);
    return out;
}

bool valid_bits(int64_t bits) { return one_of(bits, loco::limits::kWireBits); }

// The hop's scalars (the ops' schema arguments; deepspeed_loco.layout.HopArgs in Python) as the C struct
// loco::HopArgs, checked against loco_limits.h. `needs_input`: hop 2 (in_bits, in_blocks are used).
loco::HopArgs hop_args(int64_t world, int64_t local, int64_t bits, int64_t group, double beta, bool hadamard,
                       const std::string& grid, int64_t in_bits, int64_t in_blocks, bool needs_input) {
    loco::HopArgs h{};
    TORCH_CHECK(world >= 1 && local >= 1 && world % local == 0, "LoCo kernels: world_size = ", world,
                " must be a positive multiple of local_size = ", local);
    TORCH_CHECK(valid_bits(bits), "LoCo kernels: bits = ", bits, " must be ", listed(loco::limits::kWireBits));
    TORCH_CHECK(group >= loco::limits::kMinGroupSize && group <= loco::limits::kMaxGroupSize &&
                    (group & (group - 1)) == 0,
                "LoCo kernels: group_size = ", group, " must be a power of two from ", loco::limits::kMinGroupSize,
                " to ", loco::limits::kMaxGroupSize);
    TORCH_CHECK(beta >= 0.0 && beta < 1.0, "LoCo kernels: err_beta = ", beta, " must satisfy 0 <= err_beta < 1");
    TORCH_CHECK(grid == "symmetric" || grid == "midrise", "LoCo kernels: grid = '", grid,
                "' must be 'symmetric' or 'midrise'");
    if (needs_input) {
        TORCH_CHECK(valid_bits(in_bits), "LoCo kernels: in_bits = ", in_bits, " must be ",
                    listed(loco::limits::kWireBits));
        TORCH_CHECK(in_blocks >= 1, "LoCo kernels: in_blocks = ", in_blocks, " must be positive");
    }
    h.world = (int)world;
    h.local = (int)local;
    h.bits = (int)bits;
    h.group_size = (int)group;
    h.beta = (float)beta;
    h.grid = grid == "midrise" ? loco::kMidrise : loco::kSymmetric;
    h.hadamard = hadamard;
    h.in_bits = (int)in_bits;
    h.in_blocks = (int)in_blocks;
    return h;
}

// A bucket's wire layout (deepspeed_loco.layout.WireLayout of `bits` bits): parameter widths, their first columns,
// bytes.
struct Wire {
    std::vector<int64_t> widths, offsets;
    int64_t data_bytes = 0, row_bytes = 0;
};

Wire wire_layout(const std::vector<int64_t>& widths, const loco::HopArgs& h, int64_t bits, const char* what) {
    Wire out;
    out.widths = widths;
    int64_t columns = 0;
    for (const int64_t width : out.widths) {
        TORCH_CHECK(width >= 0 && width % h.group_size == 0, "LoCo kernels: ", what, " width ", width,
                    " is not a multiple of the group size");
        out.offsets.push_back(columns);
        columns += width;
    }
    out.data_bytes = columns * bits / 8;
    out.row_bytes = out.data_bytes + columns / h.group_size * 4;
    return out;
}

// The padded partition widths P' of gradients of `numels` elements (deepspeed_loco.layout.padded_partition_size).
std::vector<int64_t> padded_widths(const std::vector<int64_t>& numels, const loco::HopArgs& h) {
    std::vector<int64_t> widths;
    for (const int64_t numel : numels) {
        TORCH_CHECK(numel >= 0, "LoCo kernels: numel = ", numel, " is negative");
        widths.push_back(ceil_div(ceil_div(numel, h.world), h.group_size) * h.group_size);
    }
    return widths;
}

void check_on(const at::Tensor& t, const at::Device& device, const char* what) {
    TORCH_CHECK(t.is_cuda() && t.device() == device, "LoCo kernels: ", what, " must be on ", device, ", got ",
                t.device());
}

// `tensors` (`what` each, `all` together in the messages) checked to be on `device` and of tensors[0]'s dtype, as
// contiguous tensors (strided ones copied) that the caller keeps alive until the launch.
std::vector<at::Tensor> contiguous_on(const std::vector<at::Tensor>& tensors, const at::Device& device,
                                      const char* what, const char* all) {
    std::vector<at::Tensor> contiguous;
    for (const at::Tensor& t : tensors) {
        check_on(t, device, what);
        TORCH_CHECK(t.scalar_type() == tensors[0].scalar_type(), "LoCo kernels: ", all, " must share one dtype, got ",
                    tensors[0].scalar_type(), " and ", t.scalar_type());
        contiguous.push_back(t.contiguous());
    }
    return contiguous;
}

// A (rows, width) tensor of `dtype` on `device`, unit stride along the row, any non-negative row stride.
void check_matrix(const at::Tensor& t, at::ScalarType dtype, int64_t rows, int64_t width, const at::Device& device,
                  const char* what) {
    check_on(t, device, what);
    TORCH_CHECK(t.scalar_type() == dtype, "LoCo kernels: ", what, " must be ", dtype, ", got ", t.scalar_type());
    TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == width, "LoCo kernels: ", what, " must have shape (",
                rows, ", ", width, "), got ", t.sizes());
    TORCH_CHECK(width <= 1 || t.stride(1) == 1, "LoCo kernels: ", what,
                " must have unit stride along a row, got strides ", t.strides());
    TORCH_CHECK(t.stride(0) >= 0, "LoCo kernels: ", what, " has a negative row stride");
}

// The kernels' view of a wire buffer uint8 (rows, row_bytes): packed values, then the fp32 scales of each row.
loco::WireArgs wire_args(const at::Tensor& buffer, const Wire& w, int64_t rows, const at::Device& device,
                         const char* what) {
    check_matrix(buffer, at::kByte, rows, w.row_bytes, device, what);
    uint8_t* data = buffer.data_ptr<uint8_t>();
    TORCH_CHECK(buffer.stride(0) % 4 == 0 && reinterpret_cast<uintptr_t>(data + w.data_bytes) % 4 == 0,
                "LoCo kernels: the scales of ", what, " must be 4-byte aligned (row stride ", buffer.stride(0), ")");
    return loco::WireArgs{data, buffer.stride(0), reinterpret_cast<float*>(data + w.data_bytes), buffer.stride(0) / 4};
}

// The error buffers of a bucket: values (and int8 scales) per parameter, `rows` x width each.
void set_errors(std::vector<loco::BucketItem>& items, const std::vector<at::Tensor>& values,
                const std::vector<at::Tensor>& scales, int64_t error_bits, int64_t rows, const Wire& w,
                int64_t group_size, const at::Device& device) {
    TORCH_CHECK(error_bits == 0 || one_of(error_bits, loco::limits::kErrorBits), "LoCo kernels: error_bits = ",
                error_bits, " must be 0, ", listed(loco::limits::kErrorBits));
    if (error_bits == 0) {
        TORCH_CHECK(values.empty(), "LoCo kernels: error values given with error_bits = 0");
        return;
    }
    TORCH_CHECK(values.size() == items.size(), "LoCo kernels: ", values.size(), " error buffers for ", items.size(),
                " parameters");
    TORCH_CHECK(error_bits == 32 || scales.size() == items.size(), "LoCo kernels: int8 error needs its scales");
    for (size_t i = 0; i < items.size(); ++i) {
        const int64_t cols = w.widths[i];
        check_matrix(values[i], error_bits == 8 ? at::kChar : at::kFloat, rows, cols, device, "error values");
        TORCH_CHECK(reinterpret_cast<uintptr_t>(values[i].data_ptr()) % 16 == 0 &&
                        values[i].stride(0) * values[i].element_size() % 16 == 0,
                    "LoCo kernels: error values must start 16-byte aligned with rows a multiple of 16 bytes apart "
                    "(row stride ", values[i].stride(0), ")");
        items[i].err_values = values[i].data_ptr();
        items[i].err_stride = values[i].stride(0);
        if (error_bits == 8) {
            check_matrix(scales[i], at::kFloat, rows, cols / group_size, device, "error scales");
            items[i].err_scale = scales[i].data_ptr<float>();
            items[i].err_scale_stride = scales[i].stride(0);
        }
    }
}

// Numbers the blocks (each parameter's rows x groups (row, group) pairs, kBlock / team pairs per block, a team being
// group_size / (8 * chunks) threads of the launch's kernel), drops parameters without columns, and copies the table
// to the device (asynchronously, on the current stream). Returns the device table and sets `blocks`.
at::Tensor upload(std::vector<loco::BucketItem>& items, int64_t rows, int64_t group_size, int chunks,
                  const at::Device& device, int64_t* blocks) {
    std::vector<loco::BucketItem> kept;
    int64_t total = 0;
    for (loco::BucketItem item : items) {
        if (item.cols == 0) continue;
        // the kernels index a parameter's pairs (and a block's overhang past them) in 32 bits
        TORCH_CHECK(loco::row_groups(rows, item.cols, (int)group_size) <= 0x7fffffffLL - loco::kBlock,
                    "LoCo kernels: a parameter of ", rows, " x ", item.cols, " columns has 2^31 or more groups; use a "
                    "larger group_size");
        item.groups = loco::fast_divisor((uint32_t)(item.cols / group_size));
        item.first_block = total;
        total += loco::blocks_for(rows, item.cols, (int)group_size, chunks);
        kept.push_back(item);
    }
    TORCH_CHECK(total <= 0x7fffffffLL, "LoCo kernels: ", total, " blocks exceed one launch; use smaller buckets");
    *blocks = total;
    items = kept;
    const int64_t bytes = (int64_t)(kept.size() * sizeof(loco::BucketItem));
    at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    if (bytes > 0) std::memcpy(host.data_ptr(), kept.data(), bytes);
    return host.to(device, /*non_blocking=*/true);
}

void raise_if(const char* message) { TORCH_CHECK(message == nullptr, message); }

// Why the kernels cannot take these tensors, or "" when they can: the first tensor off CUDA or on another device than
// the first, or a 2-D tensor without unit stride along its rows. The wrapper (loco_cuda.py) then runs the reference;
// checked here rather than in Python because a bucket holds hundreds of tensors (measured: 1.3 ms of host time per
// LoCo bucket of 256 parameters with the checks in Python).
std::string unsupported(const std::vector<at::Tensor>& tensors) {
    if (tensors.empty()) return "";
    const at::Device device = tensors[0].device();
    for (const at::Tensor& t : tensors) {
        if (!t.is_cuda()) return "a tensor is not on a CUDA device";
        if (t.device() != device) return "tensors are on different devices";
        if (t.dim() == 2 && t.size(1) > 1 && t.stride(1) != 1)
            return "a wire or error tensor without unit stride along its rows";
    }
    return "";
}

// The noise statistics of a launch (the ops' optional `stats`, fp32 (n,) on `device`, added to): per-block partial
// sums (blocks, n) for the kernel to fill, or an undefined tensor without `stats`. add_stats adds them up after
// the launch (torch's sum: a fixed order, so the bits do not depend on scheduling).
at::Tensor stats_partials(const c10::optional<at::Tensor>& stats, int64_t n, int64_t blocks, const at::Device& device) {
    if (!stats.has_value()) return at::Tensor();
    const at::Tensor& s = *stats;
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.dim() == 1 && s.size(0) == n && s.device() == device,
                "LoCo kernels: stats must be float32 (", n, ",) on ", device, ", got ", s.scalar_type(), " ",
                s.sizes(), " on ", s.device());
    return at::empty({blocks, n}, s.options());
}

float* partials_ptr(const at::Tensor& partials) { return partials.defined() ? partials.data_ptr<float>() : nullptr; }

void add_stats(const c10::optional<at::Tensor>& stats, const at::Tensor& partials) {
    if (partials.defined() && partials.size(0) > 0) stats->add_(partials.sum(0));
}

int dtype_code(at::ScalarType t, const char* what) {
    switch (t) {
        case at::kFloat: return loco::kFloat32;
        case at::kHalf: return loco::kFloat16;
        case at::kBFloat16: return loco::kBFloat16;
        default: TORCH_CHECK(false, "LoCo kernels: ", what, " must be float32, float16 or bfloat16, got ", t);
    }
}

// deepspeed_loco::quantize_bucket_ on CUDA (hop 1): `send` uint8 (world, row_bytes) of the wire of `bits` bits whose
// widths are the gradients' padded partitions; error_bits 0 (no error lists), 8 or 32.
void quantize_bucket(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& error_values,
                     const std::vector<at::Tensor>& error_scales, int64_t error_bits, at::Tensor& send, int64_t world,
                     int64_t local, int64_t bits, int64_t group_size, double err_beta, bool hadamard,
                     const std::string& grid, const c10::optional<at::Tensor>& stats) {
    const loco::HopArgs h = hop_args(world, local, bits, group_size, err_beta, hadamard, grid, 0, 0, false);
    TORCH_CHECK(!grads.empty(), "LoCo kernels: a bucket without gradients");
    std::vector<int64_t> numels;
    for (const at::Tensor& grad : grads) numels.push_back(grad.numel());
    const Wire w = wire_layout(padded_widths(numels, h), h, h.bits, "wire");
    const at::Device device = send.device();
    const int dtype = dtype_code(grads[0].scalar_type(), "grad");
    const std::vector<at::Tensor> contiguous = contiguous_on(grads, device, "grad", "the gradients of a bucket");
    std::vector<loco::BucketItem> items(grads.size());
    for (size_t i = 0; i < grads.size(); ++i) {
        loco::BucketItem& item = items[i];
        item.grad = contiguous[i].data_ptr();
        item.numel = numels[i];
        item.part = ceil_div(item.numel, h.world);
        item.cols = w.widths[i];
        item.col = w.offsets[i];
    }
    set_errors(items, error_values, error_scales, error_bits, h.world, w, h.group_size, device);
    const loco::WireArgs out = wire_args(send, w, h.world, device, "send");
    const c10::cuda::CUDAGuard guard(device);
    int64_t blocks = 0;
    const int chunks = loco::chunks_per_thread(loco::kHop1Kernel, h.hadamard, (int)error_bits);
    const at::Tensor table = upload(items, h.world, h.group_size, chunks, device, &blocks);
    const at::Tensor partials = stats_partials(stats, 2, blocks, device);
    raise_if(loco::quantize_bucket(h, dtype, (int)error_bits,
                                   reinterpret_cast<const loco::BucketItem*>(table.data_ptr()), (int)items.size(),
                                   blocks, out, partials_ptr(partials), at::cuda::getCurrentCUDAStream().stream()));
    add_stats(stats, partials);
}

// deepspeed_loco::requantize_bucket_ on CUDA (a later hop): `recv` uint8 (in_blocks * nodes, in_row_bytes) of the
// wire of `in_bits` bits, `send` uint8 (nodes, row_bytes) of `bits` bits, both of parameter widths `widths`.
void requantize_bucket(const at::Tensor& recv, const std::vector<at::Tensor>& error_values,
                       const std::vector<at::Tensor>& error_scales, int64_t error_bits, at::Tensor& send,
                       const std::vector<int64_t>& widths, int64_t world, int64_t local, int64_t bits, int64_t in_bits,
                       int64_t in_blocks, int64_t group_size, double err_beta, const std::string& grid,
                       const c10::optional<at::Tensor>& stats) {
    const loco::HopArgs h = hop_args(world, local, bits, group_size, err_beta, false, grid, in_bits, in_blocks, true);
    const Wire win = wire_layout(widths, h, h.in_bits, "in_wire");
    const Wire w = wire_layout(widths, h, h.bits, "wire");
    const int64_t nodes = h.world / h.local;
    const at::Device device = send.device();
    std::vector<loco::BucketItem> items(w.widths.size());
    for (size_t i = 0; i < items.size(); ++i) {
        items[i].cols = w.widths[i];
        items[i].col = w.offsets[i];
    }
    set_errors(items, error_values, error_scales, error_bits, nodes, w, h.group_size, device);
    const loco::WireArgs in = wire_args(recv, win, h.in_blocks * nodes, device, "recv");
    const loco::WireArgs out = wire_args(send, w, nodes, device, "send");
    const c10::cuda::CUDAGuard guard(device);
    int64_t blocks = 0;
    const int chunks = loco::chunks_per_thread(loco::kHop2Kernel, false, (int)error_bits);
    const at::Tensor table = upload(items, nodes, h.group_size, chunks, device, &blocks);
    const at::Tensor partials = stats_partials(stats, 2, blocks, device);
    raise_if(loco::requantize_bucket(h, (int)error_bits, reinterpret_cast<const loco::BucketItem*>(table.data_ptr()),
                                     (int)items.size(), blocks, in, out, partials_ptr(partials),
                                     at::cuda::getCurrentCUDAStream().stream()));
    add_stats(stats, partials);
}

// deepspeed_loco::final_mean_bucket on CUDA: `recv` uint8 (rows, row_bytes) of the wire of `bits` bits whose widths
// are the padded partitions of `numels`. Returns the mean partitions of this rank, concatenated: `out_dtype`
// (sum of ceil(numel / world),).
at::Tensor final_mean_bucket(const at::Tensor& recv, const std::vector<int64_t>& numels, int64_t world, int64_t bits,
                             int64_t group_size, bool hadamard, const std::string& grid, int64_t rank,
                             at::ScalarType out_dtype, const c10::optional<at::Tensor>& stats) {
    const loco::HopArgs h = hop_args(world, 1, bits, group_size, 0.0, hadamard, grid, 0, 0, false);
    const Wire w = wire_layout(padded_widths(numels, h), h, h.bits, "wire");
    TORCH_CHECK(rank >= 0 && rank < h.world, "LoCo kernels: rank = ", rank, " must be in [0, ", h.world, ")");
    TORCH_CHECK(recv.dim() == 2 && recv.size(0) >= 1, "LoCo kernels: recv must be 2-D with rows, got ", recv.sizes());
    const int dtype = dtype_code(out_dtype, "out_dtype");
    const at::Device device = recv.device();
    const loco::WireArgs in = wire_args(recv, w, recv.size(0), device, "recv");
    int64_t total = 0;
    for (const int64_t numel : numels) total += ceil_div(numel, h.world);
    at::Tensor flat = at::empty({total}, recv.options().dtype(out_dtype));
    std::vector<loco::BucketItem> items(numels.size());
    int64_t offset = 0;
    for (size_t i = 0; i < items.size(); ++i) {
        loco::BucketItem& item = items[i];
        item.part = ceil_div(numels[i], h.world);
        item.valid = std::max<int64_t>(0, std::min<int64_t>(item.part, numels[i] - rank * item.part));
        item.cols = w.widths[i];
        item.col = w.offsets[i];
        item.out = static_cast<char*>(flat.data_ptr()) + offset * flat.element_size();
        offset += item.part;
    }
    const c10::cuda::CUDAGuard guard(device);
    int64_t blocks = 0;
    const int chunks = loco::chunks_per_thread(loco::kFinalKernel, h.hadamard, 0);
    const at::Tensor table = upload(items, 1, h.group_size, chunks, device, &blocks);
    const at::Tensor partials = stats_partials(stats, 1, blocks, device);
    raise_if(loco::final_mean_bucket(h, dtype, reinterpret_cast<const loco::BucketItem*>(table.data_ptr()),
                                     (int)items.size(), blocks, in, (int)recv.size(0), partials_ptr(partials),
                                     at::cuda::getCurrentCUDAStream().stream()));
    add_stats(stats, partials);
    return flat;
}

// The live rho's shared sample on CUDA (deepspeed_loco.ops.loco_reference.gather_sample): fp32 (n,) on the
// tensors' device, out[i] = scales[owners[i]] * float(tensors[owners[i]].flatten()[coords[i]]), 0 where coords[i]
// is -1. `owners` int32 (n,), `coords` int64 (n,) and `scales` fp32 (len(tensors),) are on the CPU: validated
// here, then written to the device with the tensors' pointers in one asynchronous copy; one launch.
at::Tensor gather_sample(const std::vector<at::Tensor>& tensors, const at::Tensor& owners, const at::Tensor& coords,
                         const at::Tensor& scales) {
    TORCH_CHECK(!tensors.empty(), "LoCo sample: no tensors to sample");
    const int64_t count = (int64_t)tensors.size(), n = coords.numel();
    auto check_host = [](const at::Tensor& t, at::ScalarType dtype, int64_t size, const char* what) {
        TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == 1 && t.size(0) == size &&
                        t.is_contiguous(),
                    "LoCo sample: ", what, " must be a contiguous CPU ", dtype, " tensor of ", size, " elements");
    };
    check_host(coords, at::kLong, n, "coords");
    check_host(owners, at::kInt, n, "owners");
    check_host(scales, at::kFloat, count, "scales");
    const at::Device device = tensors[0].device();
    const int dtype = dtype_code(tensors[0].scalar_type(), "a sampled tensor");
    const std::vector<at::Tensor> contiguous =
        contiguous_on(tensors, device, "a sampled tensor", "the sampled tensors");
    const int32_t* owner = owners.data_ptr<int32_t>();
    const int64_t* coord = coords.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
        TORCH_CHECK(owner[i] >= 0 && owner[i] < count, "LoCo sample: owners[", i, "] = ", owner[i],
                    " must be in [0, ", count, ")");
        TORCH_CHECK(coord[i] >= -1 && coord[i] < contiguous[owner[i]].numel(), "LoCo sample: coords[", i, "] = ",
                    coord[i], " must be -1 or in [0, ", contiguous[owner[i]].numel(), ")");
    }
    // one pinned table: pointers (count), coords (n), scales (count), owners (n); 8-byte fields first
    const int64_t bytes = 8 * count + 8 * n + 4 * count + 4 * n;
    at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    char* p = static_cast<char*>(host.data_ptr());
    for (int64_t k = 0; k < count; ++k) {
        const void* source = contiguous[k].data_ptr();
        std::memcpy(p + 8 * k, &source, 8);
    }
    std::memcpy(p + 8 * count, coord, 8 * n);
    std::memcpy(p + 8 * count + 8 * n, scales.data_ptr<float>(), 4 * count);
    std::memcpy(p + 12 * count + 8 * n, owner, 4 * n);
    const c10::cuda::CUDAGuard guard(device);
    const at::Tensor table = host.to(device, /*non_blocking=*/true);
    at::Tensor out = at::empty({n}, table.options().dtype(at::kFloat));
    const char* base = static_cast<const char*>(table.data_ptr());
    loco::SampleArgs a;
    a.sources = reinterpret_cast<const void* const*>(base);
    a.coords = reinterpret_cast<const int64_t*>(base + 8 * count);
    a.scales = reinterpret_cast<const float*>(base + 8 * count + 8 * n);
    a.owners = reinterpret_cast<const int32_t*>(base + 12 * count + 8 * n);
    a.out = out.data_ptr<float>();
    a.n = n;
    raise_if(loco::gather_sample(dtype, a, at::cuda::getCurrentCUDAStream().stream()));
    return out;
}

// The limits of loco_limits.h, as deepspeed_loco.layout.limits names them (a test compares the two).
py::dict limits() {
    py::dict out;
    out["WIRE_BITS"] = py::tuple(py::cast(as_vector(loco::limits::kWireBits)));
    out["ERROR_BITS"] = py::tuple(py::cast(as_vector(loco::limits::kErrorBits)));
    out["MIN_GROUP_SIZE"] = loco::limits::kMinGroupSize;
    out["MAX_GROUP_SIZE"] = loco::limits::kMaxGroupSize;
    return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "LoCo fused CUDA kernels, one launch per hop per bucket: the CUDA implementations of the "
              "deepspeed_loco ops (deepspeed_loco/ops/library.py)";
    m.def("limits", &limits, "the limits of loco_limits.h (bits, error bits, group sizes)");
    m.def("unsupported", &unsupported,
          "why the kernels cannot take these tensors (device or row stride), '' when they can");
    m.def("quantize_bucket", &quantize_bucket,
          "hop 1 of a bucket: partition, swizzle, [rotate,] compensate, quantize, update the errors, pack");
    m.def("requantize_bucket", &requantize_bucket,
          "a later hop of a bucket: dequantize-sum the received blocks, compensate, quantize, update, pack");
    m.def("final_mean_bucket", &final_mean_bucket,
          "the last hop's received rows to this rank's mean partitions ([rotated back,] divided by W, trimmed), "
          "concatenated");
    m.def("gather_sample", &gather_sample,
          "the live rho's shared sample: scaled fp32 values of many tensors at given coordinates, one launch");
}
