// Torch binding of the LoCo kernels (loco_kernels.cu): the CUDA implementations of the deepspeed_loco ops, registered
// for the CUDA dispatch key (TORCH_LIBRARY_IMPL). Each op's schema is written once, in deepspeed_loco/ops/library.py,
// beside its PyTorch reference; the dispatcher checks every function below against its op's schema when this
// extension loads. Everything is validated here (RuntimeError naming the argument): the hop's scalars against
// loco_limits.h and loco_formats.h, the wire widths, devices, dtypes, shapes, strides and sizes. Then the bucket's
// parameter table (loco::BucketItem) goes to the device in one asynchronous copy and one kernel runs on the current
// CUDA stream.
//
// A call these kernels cannot run (a tensor off CUDA or on another device than the call's, another dtype, a row
// without unit stride, a size above loco_limits.h) fails here with a message naming the input and what it must be:
// nothing is handed to the reference. Which implementation computes a call is decided in one place, before it:
// deepspeed_loco.ops.kernels_for (library.py).
//
// Messages are built without C++ streams (`text`): on the GPU image the JIT-built extension's own stream formatting
// of an integer crashed the process (a libstdc++ other than the one the process had loaded), so a failing check
// killed the rank instead of raising.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "loco_formats.h"
#include "loco_kernels.cuh"
#include "loco_limits.h"

// The ops' namespace (a further build for A/B timing registers its kernels under another one: benchmarks/kernels.py).
#if !defined(LOCO_OPS_NAMESPACE)
#define LOCO_OPS_NAMESPACE deepspeed_loco
#endif
#define LOCO_STRING_OF(x) #x
#define LOCO_STRING(x) LOCO_STRING_OF(x)

namespace py = pybind11;

namespace {

// ------------------------------------------------------------------------------------------------ messages
std::string piece(const char* s) { return s; }
std::string piece(const std::string& s) { return s; }
std::string piece(c10::string_view s) { return std::string(s.data(), s.size()); }
std::string piece(at::ScalarType t) { return c10::toString(t); }
std::string piece(const at::Device& d) { return d.str(); }
std::string piece(double v) {
    char out[32];
    std::snprintf(out, sizeof(out), "%g", v);
    return out;
}
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
std::string piece(T v) {
    return std::to_string(v);
}
std::string piece(at::IntArrayRef values) {
    std::string out = "[";
    for (size_t i = 0; i < values.size(); ++i) out += (i ? ", " : "") + std::to_string(values[i]);
    return out + "]";
}

// The concatenated text of `parts` (strings, numbers, dtypes, devices, sizes), formatted without a stream.
template <typename... Parts>
std::string text(const Parts&... parts) {
    std::string out;
    ((out += piece(parts)), ...);
    return out;
}

#define LOCO_CHECK(cond, ...) TORCH_CHECK(cond, text("LoCo kernels: ", __VA_ARGS__))

// ------------------------------------------------------------------------------------------------ scalars
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

// An int argument the kernels hold in 32 bits: at least `low`, at most 2^31 - 1.
int int32_argument(int64_t value, int64_t low, const char* name) {
    LOCO_CHECK(value >= low && value <= 0x7fffffffLL, name, " = ", value, " must be in [", low, ", 2147483647]");
    return (int)value;
}

// The rounding of the grid called `name` (loco_formats.h's kGrids, formats.py's GRIDS).
loco::Rounding rounding_of(c10::string_view name) {
    int found = -1;
    std::string valid;
    for (int i = 0; i < loco::kGridCount; ++i) {
        if (name == c10::string_view(loco::kGrids[i].name)) found = i;
        valid += (i ? ", '" : "'") + std::string(loco::kGrids[i].name) + "'";
    }
    LOCO_CHECK(found >= 0, "grid = '", name, "' must be one of ", valid);
    return loco::kGrids[found].rounding;
}

// The hop's scalars (the ops' schema arguments; deepspeed_loco.layout.HopArgs in Python) as the C struct
// loco::HopArgs, checked against loco_limits.h. `needs_input`: hop 2 (in_bits, in_blocks are used).
loco::HopArgs hop_args(int64_t world, int64_t local, int64_t bits, int64_t group, double beta, bool hadamard,
                       c10::string_view grid, int64_t in_bits, int64_t in_blocks, bool needs_input) {
    loco::HopArgs h{};
    h.world = int32_argument(world, 1, "world_size");
    h.local = int32_argument(local, 1, "local_size");
    LOCO_CHECK(world % local == 0, "world_size = ", world, " must be a positive multiple of local_size = ", local);
    LOCO_CHECK(valid_bits(bits), "bits = ", bits, " must be ", listed(loco::limits::kWireBits));
    LOCO_CHECK(group >= loco::limits::kMinGroupSize && group <= loco::limits::kMaxGroupSize &&
                   (group & (group - 1)) == 0,
               "group_size = ", group, " must be a power of two from ", loco::limits::kMinGroupSize, " to ",
               loco::limits::kMaxGroupSize);
    LOCO_CHECK(beta >= 0.0 && beta < 1.0, "err_beta = ", beta, " must satisfy 0 <= err_beta < 1");
    if (needs_input) {
        LOCO_CHECK(valid_bits(in_bits), "in_bits = ", in_bits, " must be ", listed(loco::limits::kWireBits));
        h.in_blocks = int32_argument(in_blocks, 1, "in_blocks");
    }
    h.bits = (int)bits;
    h.group_size = (int)group;
    h.beta = (float)beta;
    h.rounding = rounding_of(grid);
    h.hadamard = hadamard;
    h.in_bits = (int)in_bits;
    return h;
}

// ------------------------------------------------------------------------------------------------ tensors
// A bucket's wire layout (deepspeed_loco.layout.WireLayout of `bits` bits): parameter widths, their first columns,
// bytes.
struct Wire {
    std::vector<int64_t> widths, offsets;
    int64_t columns = 0, data_bytes = 0, row_bytes = 0;
};

Wire wire_layout(at::IntArrayRef widths, const loco::HopArgs& h, int64_t bits, const char* what) {
    Wire out;
    out.widths = widths.vec();
    int64_t columns = 0;
    for (const int64_t width : out.widths) {
        LOCO_CHECK(width >= 0 && width % h.group_size == 0, what, " width ", width,
                   " is not a multiple of the group size");
        out.offsets.push_back(columns);
        columns += width;
    }
    out.columns = columns;
    out.data_bytes = columns * bits / 8;
    out.row_bytes = out.data_bytes + columns / h.group_size * 4;
    return out;
}

// The sizes of loco_limits.h that the kernels index in 32 bits (deepspeed_loco.layout.limits.check_launch, which
// library.py runs before a call): the (row, group) pairs of each parameter (`what`[i]) on a hop of `rows` rows, and
// of the bucket. Checked before any tensor, so that only the sizes decide.
void check_pairs(const Wire& w, int64_t rows, int64_t group_size, const char* what) {
    int64_t pairs = 0;
    for (size_t i = 0; i < w.widths.size(); ++i) {
        const int64_t own = rows * (w.widths[i] / group_size);
        LOCO_CHECK(own <= loco::limits::kMaxParameterPairs, what, "[", i, "] has ", rows, " x ",
                   w.widths[i] / group_size, " = ", own, " (row, group) pairs on this hop, above kMaxParameterPairs = ",
                   loco::limits::kMaxParameterPairs, " (loco_limits.h); use a larger group_size");
        pairs += own;
    }
    LOCO_CHECK(pairs <= loco::limits::kMaxLaunchPairs, "the bucket of ", what, " (", w.widths.size(), " tensors) has ",
               pairs, " (row, group) pairs on this hop, above kMaxLaunchPairs = ", loco::limits::kMaxLaunchPairs,
               " (loco_limits.h); use smaller buckets");
}

// The padded partition widths P' of gradients of `numels` elements (deepspeed_loco.layout.padded_partition_size).
std::vector<int64_t> padded_widths(at::IntArrayRef numels, const loco::HopArgs& h) {
    std::vector<int64_t> widths;
    for (const int64_t numel : numels) {
        LOCO_CHECK(numel >= 0, "numel = ", numel, " is negative");
        widths.push_back(ceil_div(ceil_div(numel, h.world), h.group_size) * h.group_size);
    }
    return widths;
}

void check_on(const at::Tensor& t, const at::Device& device, const char* what) {
    LOCO_CHECK(t.is_cuda() && t.device() == device, what, " must be on ", device, ", got ", t.device());
}

// The device of a call: `t`'s (`what` in the message), which must be a CUDA device (the dispatcher sends a call here
// when any of its tensors is on CUDA; every other tensor of the call is checked to be on this one).
at::Device cuda_device(const at::Tensor& t, const char* what) {
    LOCO_CHECK(t.is_cuda(), what, " must be a CUDA tensor (the kernels run on CUDA tensors only), got one on ",
               t.device());
    return t.device();
}

// `tensors` (`what` each, `all` together in the messages) checked to be on `device` and of tensors[0]'s dtype, as
// contiguous tensors (strided ones copied) that the caller keeps alive until the launch.
std::vector<at::Tensor> contiguous_on(at::TensorList tensors, const at::Device& device, const char* what,
                                      const char* all) {
    std::vector<at::Tensor> contiguous;
    for (const at::Tensor& t : tensors) {
        check_on(t, device, what);
        LOCO_CHECK(t.scalar_type() == tensors[0].scalar_type(), all, " must share one dtype, got ",
                   tensors[0].scalar_type(), " and ", t.scalar_type());
        contiguous.push_back(t.contiguous());
    }
    return contiguous;
}

// A (rows, width) tensor of `dtype` on `device`, unit stride along the row, any non-negative row stride.
void check_matrix(const at::Tensor& t, at::ScalarType dtype, int64_t rows, int64_t width, const at::Device& device,
                  const char* what) {
    check_on(t, device, what);
    LOCO_CHECK(t.scalar_type() == dtype, what, " must be ", dtype, ", got ", t.scalar_type());
    LOCO_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == width, what, " must have shape (", rows, ", ", width,
               "), got ", t.sizes());
    LOCO_CHECK(width <= 1 || t.stride(1) == 1, what, " must have unit stride along a row, got strides ",
               t.strides());
    LOCO_CHECK(t.stride(0) >= 0, what, " has a negative row stride");
}

// The kernels' view of a wire buffer uint8 (rows, row_bytes): packed values, then the fp32 scales of each row.
loco::WireArgs wire_args(const at::Tensor& buffer, const Wire& w, int64_t rows, const at::Device& device,
                         const char* what) {
    check_matrix(buffer, at::kByte, rows, w.row_bytes, device, what);
    uint8_t* data = buffer.data_ptr<uint8_t>();
    LOCO_CHECK(buffer.stride(0) % 4 == 0 && reinterpret_cast<uintptr_t>(data + w.data_bytes) % 4 == 0,
               "the scales of ", what, " must be 4-byte aligned (row stride ", buffer.stride(0), ")");
    return loco::WireArgs{data, buffer.stride(0), reinterpret_cast<float*>(data + w.data_bytes), buffer.stride(0) / 4};
}

// The storage of a bucket's error buffers, from its values' dtype (formats.py's ErrorStorage.of_values): none for
// an empty list.
loco::ErrorStorage storage_of(at::TensorList values) {
    if (values.empty()) return loco::ErrorStorage::kNone;
    const at::ScalarType dtype = values[0].scalar_type();
    LOCO_CHECK(dtype == at::kByte || dtype == at::kChar || dtype == at::kFloat, "error values of dtype ", dtype,
               ": an error buffer holds torch.uint8 (int4), torch.int8 (int8) or torch.float32 (fp32) values");
    return dtype == at::kByte ? loco::ErrorStorage::kInt4
           : dtype == at::kChar ? loco::ErrorStorage::kInt8 : loco::ErrorStorage::kFp32;
}

// The dtype of a storage's values tensor (formats.py's StorageFormat.dtype).
at::ScalarType values_dtype(loco::ErrorStorage storage) {
    return storage == loco::ErrorStorage::kInt4 ? at::kByte
           : storage == loco::ErrorStorage::kInt8 ? at::kChar : at::kFloat;
}

// The error buffers of a bucket: values (and int8 scales) per parameter, `rows` x width each. A parameter without
// columns (zero elements) is checked for its shape only: the kernels never touch it (`upload` drops it).
void set_errors(std::vector<loco::BucketItem>& items, at::TensorList values, at::TensorList scales,
                loco::ErrorStorage storage, int64_t rows, const Wire& w, int64_t group_size,
                const at::Device& device) {
    if (storage == loco::ErrorStorage::kNone) {
        LOCO_CHECK(scales.empty(), scales.size(), " error scales without error values");
        return;
    }
    const loco::StorageFormat format = loco::storage_format(storage);
    const bool scaled = format.scaled;
    LOCO_CHECK(values.size() == items.size(), values.size(), " error buffers for ", items.size(), " parameters");
    LOCO_CHECK(scales.size() == (scaled ? items.size() : 0), scales.size(), " error scales for ", items.size(),
               scaled ? " scaled error buffers (each needs its fp32 scales)" : " fp32 error buffers (which take none)");
    for (size_t i = 0; i < items.size(); ++i) {
        const int64_t cols = w.widths[i];
        check_matrix(values[i], values_dtype(storage), rows, cols / format.per_element, device, "error values");
        if (scaled) check_matrix(scales[i], at::kFloat, rows, cols / group_size, device, "error scales");
        if (cols == 0) continue;
        LOCO_CHECK(reinterpret_cast<uintptr_t>(values[i].data_ptr()) % 16 == 0 &&
                       values[i].stride(0) * values[i].element_size() % 16 == 0,
                   "error values must start 16-byte aligned with rows a multiple of 16 bytes apart (row stride ",
                   values[i].stride(0), ")");
        items[i].err_values = values[i].data_ptr();
        items[i].err_stride = values[i].stride(0);
        if (scaled) {
            items[i].err_scale = scales[i].data_ptr<float>();
            items[i].err_scale_stride = scales[i].stride(0);
        }
    }
}

// Numbers the blocks (each parameter's rows x groups (row, group) pairs, kBlock / team pairs per block, a team being
// group_size / (8 * chunks) threads of the launch's kernel), drops parameters without columns, and copies the table
// to the device (asynchronously, on the current stream). Returns the device table and sets `blocks` (at most the
// bucket's pairs, which check_pairs bounded).
at::Tensor upload(std::vector<loco::BucketItem>& items, int64_t rows, int64_t group_size, int chunks,
                  const at::Device& device, int64_t* blocks) {
    std::vector<loco::BucketItem> kept;
    int64_t total = 0;
    for (loco::BucketItem item : items) {
        if (item.cols == 0) continue;
        item.groups = loco::fast_divisor((uint32_t)(item.cols / group_size));
        item.first_block = total;
        total += loco::blocks_for(rows, item.cols, (int)group_size, chunks);
        kept.push_back(item);
    }
    *blocks = total;
    items = kept;
    const int64_t bytes = (int64_t)(kept.size() * sizeof(loco::BucketItem));
    at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    if (bytes > 0) std::memcpy(host.data_ptr(), kept.data(), bytes);
    return host.to(device, /*non_blocking=*/true);
}

void raise_if(const char* message) { TORCH_CHECK(message == nullptr, message); }

int dtype_code(at::ScalarType t, const char* what) {
    LOCO_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16, what,
               " must be float32, float16 or bfloat16, got ", t);
    return t == at::kFloat ? loco::kFloat32 : t == at::kHalf ? loco::kFloat16 : loco::kBFloat16;
}

// ------------------------------------------------------------------------------------------------ statistics
// The noise statistics of a launch (the ops' optional `stats`, fp64 (n,) on `device`, added to): per-block fp32
// partial sums (blocks, n) for the kernel to fill, or an undefined tensor without `stats` (an unmeasured launch).
// add_stats adds them up after the launch in fp64 (torch's sum: a fixed order, so the bits do not depend on
// scheduling).
at::Tensor stats_partials(const std::optional<at::Tensor>& stats, int64_t n, int64_t blocks,
                          const at::Device& device) {
    if (!stats.has_value()) return at::Tensor();
    const at::Tensor& s = *stats;
    LOCO_CHECK(s.scalar_type() == at::kDouble && s.dim() == 1 && s.size(0) == n && s.device() == device,
               "stats must be float64 (", n, ",) on ", device, ", got ", s.scalar_type(), " ", s.sizes(), " on ",
               s.device());
    return at::empty({blocks, n}, s.options().dtype(at::kFloat));
}

float* partials_ptr(const at::Tensor& partials) { return partials.defined() ? partials.data_ptr<float>() : nullptr; }

void add_stats(const std::optional<at::Tensor>& stats, const at::Tensor& partials) {
    if (partials.defined() && partials.size(0) > 0) stats->add_(partials.sum(0, /*keepdim=*/false, at::kDouble));
}

// ------------------------------------------------------------------------------------------------ own block
// An index of the exact own block (`name`: own, in_own): -1 (none) or in [0, count), given with its buffer `buffer`
// (`what`: own_out, own_in) exactly when it is not -1.
int own_index(int64_t index, int64_t count, const std::optional<at::Tensor>& buffer, const char* name,
              const char* what) {
    LOCO_CHECK(index >= -1 && index < count, name, " = ", index, " must be -1 (no exact own block) or in [0, ", count,
               ")");
    LOCO_CHECK(buffer.has_value() == (index >= 0), what, index >= 0 ? " is required with " : " must be None with ",
               name, " = ", index);
    return (int)index;
}

// An own buffer: fp32 (rows, the bucket's columns) on `device`, unit stride along a row, rows 16-byte aligned.
float* own_rows(const at::Tensor& t, int64_t rows, const Wire& w, const at::Device& device, const char* what,
                int64_t* stride) {
    check_matrix(t, at::kFloat, rows, w.columns, device, what);
    LOCO_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % 4 == 0, what,
               " must start 16-byte aligned with rows a multiple of 4 floats apart (row stride ", t.stride(0), ")");
    *stride = t.stride(0);
    return t.data_ptr<float>();
}

// The exact own block of a launch: this hop's `own` (its `kept` rows to `own_out`) and the previous hop's `in_own`
// (its `in_rows` rows read from `own_in`), each checked against the buffer that goes with it.
loco::OwnBlock own_block(int64_t own, int64_t own_count, int64_t kept, const std::optional<at::Tensor>& own_out,
                         int64_t in_own, int64_t in_count, int64_t in_rows, const std::optional<at::Tensor>& own_in,
                         const Wire& w, const at::Device& device) {
    loco::OwnBlock b;
    b.own = own_index(own, own_count, own_out, "own", "own_out");
    b.in_own = own_index(in_own, in_count, own_in, "in_own", "own_in");
    b.kept = (int)kept;
    if (b.own >= 0) b.out = own_rows(*own_out, kept, w, device, "own_out", &b.out_stride);
    if (b.in_own >= 0) {
        LOCO_CHECK(in_count >= 2, "in_own = ", in_own, " needs at least 2 received blocks to sum, got ", in_count);
        b.in = own_rows(*own_in, in_rows, w, device, "own_in", &b.in_stride);
    }
    return b;
}

// ------------------------------------------------------------------------------------------------ the ops
// deepspeed_loco::quantize_bucket (hop 1): `send` uint8 (world, row_bytes) of the wire of `bits` bits whose widths
// are the gradients' padded partitions; error lists empty, int8 values with their scales, or fp32 values. `own`
// (-1 or this rank's block among the hop's peers) with `own_out` fp32 (world / peers, the wire's columns): the exact
// own block, whose slots keep no error rows.
void quantize_bucket(at::TensorList grads, at::TensorList error_values, at::TensorList error_scales,
                     const at::Tensor& send, int64_t world_size, int64_t local_size, int64_t bits, int64_t group_size,
                     double err_beta, bool hadamard, c10::string_view grid, const std::optional<at::Tensor>& stats,
                     int64_t own, const std::optional<at::Tensor>& own_out) {
    LOCO_CHECK(!grads.empty(), "a bucket without gradients");
    const loco::HopArgs h =
        hop_args(world_size, local_size, bits, group_size, err_beta, hadamard, grid, 0, 0, false);
    std::vector<int64_t> numels;
    for (const at::Tensor& grad : grads) numels.push_back(grad.numel());
    const Wire w = wire_layout(padded_widths(numels, h), h, h.bits, "wire");
    check_pairs(w, h.world, h.group_size, "grads");
    const at::Device device = cuda_device(send, "send");
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
    const int64_t peers = h.local > 1 ? h.local : h.world;  // the first hop's: intra-node, or inter-node when L = 1
    const loco::OwnBlock kept =
        own_block(own, peers, h.world / peers, own_out, -1, 0, 0, std::nullopt, w, device);
    const loco::ErrorStorage storage = storage_of(error_values);
    set_errors(items, error_values, error_scales, storage, kept.own >= 0 ? h.world - kept.kept : h.world, w,
               h.group_size, device);
    const loco::WireArgs out = wire_args(send, w, h.world, device, "send");
    const c10::cuda::CUDAGuard guard(device);
    int64_t blocks = 0;
    const int chunks = loco::chunks_per_thread(loco::kHop1Kernel, h.hadamard, storage);
    const at::Tensor table = upload(items, h.world, h.group_size, chunks, device, &blocks);
    const at::Tensor partials = stats_partials(stats, 2, blocks, device);
    raise_if(loco::quantize_bucket(h, dtype, storage, reinterpret_cast<const loco::BucketItem*>(table.data_ptr()),
                                   (int)items.size(), blocks, out, kept, partials_ptr(partials),
                                   at::cuda::getCurrentCUDAStream().stream()));
    add_stats(stats, partials);
}

// deepspeed_loco::requantize_bucket (a later hop): `recv` uint8 (in_blocks * nodes, in_row_bytes) of the wire of
// `in_bits` bits, `send` uint8 (nodes, row_bytes) of `bits` bits, both of parameter widths `widths`. `in_own`
// with `own_in` fp32 (nodes, columns): the received block replaced by the previous hop's exact own block; `own` with
// `own_out` fp32 (1, columns): this hop's (its row keeps no error row).
void requantize_bucket(const at::Tensor& recv, at::TensorList error_values, at::TensorList error_scales,
                       const at::Tensor& send, at::IntArrayRef widths, int64_t world_size, int64_t local_size,
                       int64_t bits, int64_t in_bits, int64_t in_blocks, int64_t group_size, double err_beta,
                       c10::string_view grid, const std::optional<at::Tensor>& stats,
                       const std::optional<at::Tensor>& own_in, int64_t in_own, int64_t own,
                       const std::optional<at::Tensor>& own_out) {
    const loco::HopArgs h =
        hop_args(world_size, local_size, bits, group_size, err_beta, false, grid, in_bits, in_blocks, true);
    const Wire win = wire_layout(widths, h, h.in_bits, "in_wire");
    const Wire w = wire_layout(widths, h, h.bits, "wire");
    const int64_t nodes = h.world / h.local;
    check_pairs(w, nodes, h.group_size, "widths");
    const at::Device device = cuda_device(send, "send");
    std::vector<loco::BucketItem> items(w.widths.size());
    for (size_t i = 0; i < items.size(); ++i) {
        items[i].cols = w.widths[i];
        items[i].col = w.offsets[i];
    }
    const loco::OwnBlock kept = own_block(own, nodes, 1, own_out, in_own, h.in_blocks, nodes, own_in, w, device);
    const loco::ErrorStorage storage = storage_of(error_values);
    set_errors(items, error_values, error_scales, storage, kept.own >= 0 ? nodes - 1 : nodes, w, h.group_size,
               device);
    const loco::WireArgs in = wire_args(recv, win, h.in_blocks * nodes, device, "recv");
    const loco::WireArgs out = wire_args(send, w, nodes, device, "send");
    const c10::cuda::CUDAGuard guard(device);
    int64_t blocks = 0;
    const int chunks = loco::chunks_per_thread(loco::kHop2Kernel, false, storage);
    const at::Tensor table = upload(items, nodes, h.group_size, chunks, device, &blocks);
    const at::Tensor partials = stats_partials(stats, 2, blocks, device);
    raise_if(loco::requantize_bucket(h, storage, reinterpret_cast<const loco::BucketItem*>(table.data_ptr()),
                                     (int)items.size(), blocks, in, out, kept, partials_ptr(partials),
                                     at::cuda::getCurrentCUDAStream().stream()));
    add_stats(stats, partials);
}

// deepspeed_loco::final_mean_bucket: `recv` uint8 (rows, row_bytes) of the wire of `bits` bits whose widths are the
// padded partitions of `numels`. Returns the mean partitions of this rank, concatenated: `out_dtype`
// (sum of ceil(numel / world),). `in_own` with `own_in` fp32 (1, columns): the received row replaced by the last
// hop's exact own block.
at::Tensor final_mean_bucket(const at::Tensor& recv, at::IntArrayRef numels, int64_t world_size, int64_t bits,
                             int64_t group_size, bool hadamard, c10::string_view grid, int64_t rank,
                             at::ScalarType out_dtype, const std::optional<at::Tensor>& stats,
                             const std::optional<at::Tensor>& own_in, int64_t in_own) {
    const loco::HopArgs h = hop_args(world_size, 1, bits, group_size, 0.0, hadamard, grid, 0, 0, false);
    const Wire w = wire_layout(padded_widths(numels, h), h, h.bits, "wire");
    check_pairs(w, 1, h.group_size, "numels");
    LOCO_CHECK(rank >= 0 && rank < h.world, "rank = ", rank, " must be in [0, ", h.world, ")");
    LOCO_CHECK(recv.dim() == 2 && recv.size(0) >= 1 && recv.size(0) <= 0x7fffffffLL,
               "recv must be 2-D with 1 to 2147483647 rows, got ", recv.sizes());
    const int dtype = dtype_code(out_dtype, "out_dtype");
    const at::Device device = cuda_device(recv, "recv");
    const loco::WireArgs in = wire_args(recv, w, recv.size(0), device, "recv");
    const loco::OwnBlock kept = own_block(-1, 0, 0, std::nullopt, in_own, recv.size(0), 1, own_in, w, device);
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
    const int chunks = loco::chunks_per_thread(loco::kFinalKernel, h.hadamard, loco::ErrorStorage::kNone);
    const at::Tensor table = upload(items, 1, h.group_size, chunks, device, &blocks);
    const at::Tensor partials = stats_partials(stats, 1, blocks, device);
    raise_if(loco::final_mean_bucket(h, dtype, reinterpret_cast<const loco::BucketItem*>(table.data_ptr()),
                                     (int)items.size(), blocks, in, (int)recv.size(0), kept, partials_ptr(partials),
                                     at::cuda::getCurrentCUDAStream().stream()));
    add_stats(stats, partials);
    return flat;
}

// deepspeed_loco::gather_sample, the live rho's shared sample: fp32 (n,) on the tensors' device, out[i] =
// scales[owners[i]] * float(tensors[owners[i]].flatten()[coords[i]]), 0 where coords[i] is -1. `owners` int32 (n,),
// `coords` int64 (n,) and `scales` fp32 (len(tensors),) are on the CPU: validated here, then written to the device
// with the tensors' pointers in one asynchronous copy; one launch.
at::Tensor gather_sample(at::TensorList tensors, const at::Tensor& owners, const at::Tensor& coords,
                         const at::Tensor& scales) {
    TORCH_CHECK(!tensors.empty(), "LoCo sample: no tensors to sample");
    const int64_t count = (int64_t)tensors.size(), n = coords.numel();
    auto check_host = [](const at::Tensor& t, at::ScalarType dtype, int64_t size, const char* what) {
        TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == 1 && t.size(0) == size &&
                        t.is_contiguous(),
                    text("LoCo sample: ", what, " must be a contiguous CPU ", dtype, " tensor of ", size, " elements"));
    };
    check_host(coords, at::kLong, n, "coords");
    check_host(owners, at::kInt, n, "owners");
    check_host(scales, at::kFloat, count, "scales");
    const at::Device device = cuda_device(tensors[0], "a sampled tensor");
    const int dtype = dtype_code(tensors[0].scalar_type(), "a sampled tensor");
    const std::vector<at::Tensor> contiguous =
        contiguous_on(tensors, device, "a sampled tensor", "the sampled tensors");
    const int32_t* owner = owners.data_ptr<int32_t>();
    const int64_t* coord = coords.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
        TORCH_CHECK(owner[i] >= 0 && owner[i] < count,
                    text("LoCo sample: owners[", i, "] = ", owner[i], " must be in [0, ", count, ")"));
        TORCH_CHECK(coord[i] >= -1 && coord[i] < contiguous[owner[i]].numel(),
                    text("LoCo sample: coords[", i, "] = ", coord[i], " must be -1 or in [0, ",
                         contiguous[owner[i]].numel(), ")"));
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

// ------------------------------------------------------------------------------------------------ exports
// The limits of loco_limits.h, as deepspeed_loco.layout.limits names them (a test compares the two).
py::dict limits() {
    py::dict out;
    out["WIRE_BITS"] = py::tuple(py::cast(as_vector(loco::limits::kWireBits)));
    out["MIN_GROUP_SIZE"] = loco::limits::kMinGroupSize;
    out["MAX_GROUP_SIZE"] = loco::limits::kMaxGroupSize;
    out["MAX_PARAMETER_PAIRS"] = loco::limits::kMaxParameterPairs;
    out["MAX_LAUNCH_PAIRS"] = loco::limits::kMaxLaunchPairs;
    return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(LOCO_OPS_NAMESPACE, CUDA, m) {
    m.impl("quantize_bucket", TORCH_FN(quantize_bucket));
    m.impl("requantize_bucket", TORCH_FN(requantize_bucket));
    m.impl("final_mean_bucket", TORCH_FN(final_mean_bucket));
    m.impl("gather_sample", TORCH_FN(gather_sample));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "LoCo fused CUDA kernels: loading this module registers the CUDA implementations of the " LOCO_STRING(
        LOCO_OPS_NAMESPACE) " ops (deepspeed_loco/ops/library.py)";
    m.def("limits", &limits, "the limits of loco_limits.h (wire bits, group sizes, sizes indexed in 32 bits)");
}
