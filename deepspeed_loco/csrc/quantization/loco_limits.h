// LoCo's limits, written once. The kernels (loco_kernels.cu compiles a variant for each), the binding
// (loco_binding.cpp validates against them and exports them as `loco_ops.limits()`) and Python
// (deepspeed_loco/layout/limits.py reads this file; deepspeed_loco/config.py validates zeropp_loco_param with it)
// all take them from here. Keep one `constexpr int NAME = value;` or `constexpr int NAME[] = {a, b};` per line:
// limits.py parses exactly that form.
#pragma once

namespace loco {
namespace limits {

constexpr int kWireBits[] = {2, 3, 4, 8};  // gradient bits on a hop's wire (the kernels' with_bits)
constexpr int kErrorBits[] = {8, 32};      // error-buffer storage: int8 + fp32 scale per group, or fp32
constexpr int kMinGroupSize = 32;          // quantization group: a power of two in [kMinGroupSize, kMaxGroupSize]
constexpr int kMaxGroupSize = 4096;

}  // namespace limits
}  // namespace loco
