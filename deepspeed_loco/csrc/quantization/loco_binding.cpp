// Torch binding of the LoCo kernels (loco_kernels.cu): checks devices, dtypes, shapes and strides with clear
// errors, then calls the plain C++ launchers on the current CUDA stream. Signatures mirror
// deepspeed_loco/ops/loco_reference.py; the Python wrappers are in deepspeed_loco/ops/loco_cuda.py.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <optional>

#include "loco_kernels.cuh"

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool valid_bits(int64_t bits) { return bits == 2 || bits == 3 || bits == 4 || bits == 8; }

void check_group_size(int64_t group_size) {
    TORCH_CHECK(group_size >= 32 && group_size <= 4096 && (group_size & (group_size - 1)) == 0,
                "LoCo kernels: group_size = ", group_size, " must be a power of two from 32 to 4096");
}

int grad_dtype_code(at::ScalarType t, const char* what) {
    switch (t) {
        case at::kFloat: return loco::kFloat32;
        case at::kHalf: return loco::kFloat16;
        case at::kBFloat16: return loco::kBFloat16;
        default: TORCH_CHECK(false, "LoCo kernels: ", what, " must be float32, float16 or bfloat16, got ", t);
    }
}

void check_on(const at::Tensor& t, const at::Device& device, const char* what) {
    TORCH_CHECK(t.is_cuda() && t.device() == device, "LoCo kernels: ", what, " must be on ", device, ", got ",
                t.device());
}

// A (rows, width) tensor of `dtype`, unit stride along the row, any row stride.
void check_matrix(const at::Tensor& t, at::ScalarType dtype, int64_t rows, int64_t width, const char* what) {
    TORCH_CHECK(t.scalar_type() == dtype, "LoCo kernels: ", what, " must be ", dtype, ", got ", t.scalar_type());
    TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == width, "LoCo kernels: ", what, " must have shape (",
                rows, ", ", width, "), got ", t.sizes());
    TORCH_CHECK(width <= 1 || t.stride(1) == 1, "LoCo kernels: ", what, " must have unit stride along a row, got strides ",
                t.strides());
    TORCH_CHECK(t.stride(0) >= 0, "LoCo kernels: ", what, " has a negative row stride");
}

loco::WireArgs wire(const at::Tensor& data, const at::Tensor& scale, int64_t bits, int64_t rows, int64_t cols,
                    int64_t group_size, const at::Device& device, const char* what_data, const char* what_scale) {
    TORCH_CHECK(valid_bits(bits), "LoCo kernels: bits = ", bits, " must be 2, 3, 4 or 8");
    check_on(data, device, what_data);
    check_on(scale, device, what_scale);
    check_matrix(data, at::kByte, rows, cols * bits / 8, what_data);
    check_matrix(scale, at::kFloat, rows, cols / group_size, what_scale);
    return loco::WireArgs{data.data_ptr<uint8_t>(), data.stride(0), scale.data_ptr<float>(), scale.stride(0),
                          (int)bits};
}

loco::ErrorArgs error(const std::optional<at::Tensor>& values, const std::optional<at::Tensor>& scale,
                      int64_t error_bits, double beta, int64_t rows, int64_t cols, int64_t group_size,
                      const at::Device& device) {
    TORCH_CHECK(beta >= 0.0 && beta < 1.0, "LoCo kernels: beta = ", beta, " must satisfy 0 <= beta < 1");
    loco::ErrorArgs err{0, nullptr, 0, nullptr, 0, (float)beta};
    if (error_bits == 0) return err;
    TORCH_CHECK(error_bits == 8 || error_bits == 32, "LoCo kernels: error_bits = ", error_bits, " must be 0, 8 or 32");
    TORCH_CHECK(values.has_value(), "LoCo kernels: error values missing for error_bits = ", error_bits);
    check_on(*values, device, "error values");
    check_matrix(*values, error_bits == 8 ? at::kChar : at::kFloat, rows, cols, "error values");
    err.bits = (int)error_bits;
    err.values = values->data_ptr();
    err.values_stride = values->stride(0);
    if (error_bits == 8) {
        TORCH_CHECK(scale.has_value(), "LoCo kernels: int8 error needs its scales");
        check_on(*scale, device, "error scales");
        check_matrix(*scale, at::kFloat, rows, cols / group_size, "error scales");
        err.scale = scale->data_ptr<float>();
        err.scale_stride = scale->stride(0);
    }
    return err;
}

void raise_if(const char* message) { TORCH_CHECK(message == nullptr, message); }

void hop1(const at::Tensor& grad, int64_t world, int64_t local, const std::optional<at::Tensor>& error_values,
          const std::optional<at::Tensor>& error_scale, int64_t error_bits, double beta, int64_t bits,
          int64_t group_size, at::Tensor& out_data, at::Tensor& out_scale, bool hadamard) {
    TORCH_CHECK(grad.is_cuda(), "LoCo kernels: grad must be a CUDA tensor, got ", grad.device());
    TORCH_CHECK(grad.is_contiguous(), "LoCo kernels: grad must be contiguous");
    TORCH_CHECK(world >= 1 && local >= 1 && world % local == 0, "LoCo kernels: world_size = ", world,
                " must be a positive multiple of local_size = ", local);
    check_group_size(group_size);
    const int dtype = grad_dtype_code(grad.scalar_type(), "grad");
    const at::Device device = grad.device();
    const int64_t numel = grad.numel();
    const int64_t part = ceil_div(numel, world);
    const int64_t cols = ceil_div(part, group_size) * group_size;
    const loco::WireArgs out = wire(out_data, out_scale, bits, world, cols, group_size, device, "out_data", "out_scale");
    const loco::ErrorArgs err = error(error_values, error_scale, error_bits, beta, world, cols, group_size, device);
    const c10::cuda::CUDAGuard guard(device);
    raise_if(loco::hop1(grad.data_ptr(), dtype, numel, (int)world, (int)local, part, cols, (int)group_size, hadamard,
                        err, out, at::cuda::getCurrentCUDAStream().stream()));
}

void hop2(const at::Tensor& recv_data, const at::Tensor& recv_scale, int64_t local, int64_t in_bits,
          const std::optional<at::Tensor>& error_values, const std::optional<at::Tensor>& error_scale,
          int64_t error_bits, double beta, int64_t bits, int64_t group_size, at::Tensor& out_data,
          at::Tensor& out_scale) {
    TORCH_CHECK(recv_data.is_cuda(), "LoCo kernels: recv_data must be a CUDA tensor, got ", recv_data.device());
    TORCH_CHECK(recv_data.dim() == 2, "LoCo kernels: recv_data must be 2-D, got ", recv_data.sizes());
    TORCH_CHECK(valid_bits(in_bits), "LoCo kernels: in_bits = ", in_bits, " must be 2, 3, 4 or 8");
    check_group_size(group_size);
    const int64_t rows = recv_data.size(0);
    TORCH_CHECK(local >= 1 && rows % local == 0, "LoCo kernels: recv_data has ", rows,
                " rows, not a multiple of local_size = ", local);
    const int64_t nodes = rows / local;
    TORCH_CHECK(recv_data.size(1) * 8 % in_bits == 0, "LoCo kernels: recv_data width ", recv_data.size(1),
                " is not a whole number of ", in_bits, "-bit values");
    const int64_t cols = recv_data.size(1) * 8 / in_bits;
    TORCH_CHECK(cols % group_size == 0, "LoCo kernels: recv_data holds ", cols,
                " values per row, not a multiple of group_size = ", group_size);
    const at::Device device = recv_data.device();
    const loco::WireArgs in =
        wire(recv_data, recv_scale, in_bits, rows, cols, group_size, device, "recv_data", "recv_scale");
    const loco::WireArgs out = wire(out_data, out_scale, bits, nodes, cols, group_size, device, "out_data", "out_scale");
    const loco::ErrorArgs err = error(error_values, error_scale, error_bits, beta, nodes, cols, group_size, device);
    const c10::cuda::CUDAGuard guard(device);
    raise_if(loco::hop2(in, (int)local, (int)nodes, cols, (int)group_size, err, out,
                        at::cuda::getCurrentCUDAStream().stream()));
}

at::Tensor final_mean(const at::Tensor& recv_data, const at::Tensor& recv_scale, int64_t bits, int64_t group_size,
                      int64_t world, int64_t numel, int64_t rank, int64_t out_dtype, bool hadamard) {
    TORCH_CHECK(recv_data.is_cuda(), "LoCo kernels: recv_data must be a CUDA tensor, got ", recv_data.device());
    TORCH_CHECK(recv_data.dim() == 2 && recv_data.size(0) >= 1, "LoCo kernels: recv_data must be 2-D with rows, got ",
                recv_data.sizes());
    TORCH_CHECK(valid_bits(bits), "LoCo kernels: bits = ", bits, " must be 2, 3, 4 or 8");
    check_group_size(group_size);
    TORCH_CHECK(world >= 1 && numel >= 0 && rank >= 0 && rank < world, "LoCo kernels: need world_size >= 1, numel >= 0"
                " and 0 <= rank < world_size, got ", world, ", ", numel, ", ", rank);
    const at::ScalarType dtype = out_dtype == loco::kFloat32   ? at::kFloat
                                 : out_dtype == loco::kFloat16 ? at::kHalf
                                 : out_dtype == loco::kBFloat16 ? at::kBFloat16
                                                                : at::kDouble;
    TORCH_CHECK(dtype != at::kDouble, "LoCo kernels: out_dtype code ", out_dtype, " is not float32/float16/bfloat16");
    const int64_t rows = recv_data.size(0);
    const int64_t part = ceil_div(numel, world);
    const int64_t cols = ceil_div(part, group_size) * group_size;
    const at::Device device = recv_data.device();
    const loco::WireArgs in =
        wire(recv_data, recv_scale, bits, rows, cols, group_size, device, "recv_data", "recv_scale");
    const int64_t valid = std::max<int64_t>(0, std::min<int64_t>(part, numel - rank * part));
    at::Tensor out = at::empty({part}, recv_data.options().dtype(dtype));
    const c10::cuda::CUDAGuard guard(device);
    raise_if(loco::final_mean(in, (int)rows, cols, (int)group_size, hadamard, (int)world, part, valid, out.data_ptr(),
                              (int)out_dtype, at::cuda::getCurrentCUDAStream().stream()));
    return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "LoCo fused CUDA kernels (hop 1, hop 2, final mean); see deepspeed_loco/ops/loco_cuda.py";
    m.def("hop1", &hop1, "hop 1: partition, swizzle, [rotate,] compensate, quantize, update the error, pack");
    m.def("hop2", &hop2, "hop 2: dequantize-sum L blocks, compensate, quantize, update the error, pack");
    m.def("final_mean", &final_mean, "dequantize, sum the received rows, [rotate back,] divide by W, trim");
}
