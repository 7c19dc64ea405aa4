// LoCo's limits, written once. The kernels (loco_kernels.cu compiles a variant for each wire width), the binding
// (loco_binding.cpp validates against them and exports them as `loco_ops.limits()`) and Python
// (deepspeed_loco/layout/limits.py reads this file; deepspeed_loco/config.py validates zeropp_loco_param with it, and
// deepspeed_loco/ops/library.py checks a bucket's sizes with it before a launch) all take them from here. Keep one
// `constexpr int NAME = value;` or `constexpr int NAME[] = {a, b};` per line: limits.py parses exactly that form.
// The error-buffer storages and the quantization grids are formats, not limits: loco_formats.h.
#pragma once

namespace loco {
namespace limits {

constexpr int kWireBits[] = {2, 3, 4, 8};  // gradient bits on a hop's wire (the kernels' with_bits)
constexpr int kMinGroupSize = 32;          // quantization group: a power of two in [kMinGroupSize, kMaxGroupSize]
constexpr int kMaxGroupSize = 4096;

// Sizes the kernels index in 32 bits. A parameter's (row, group) pairs (rows x padded partition / group size) are
// numbered in 32 bits, a block's overhang of up to 256 pairs past the last included; a launch has at most one block
// per (row, group) pair of its bucket, and at most 2^31 - 1 blocks.
constexpr int kMaxParameterPairs = 2147483391;  // 2^31 - 1 - 256
constexpr int kMaxLaunchPairs = 2147483647;     // 2^31 - 1

}  // namespace limits
}  // namespace loco
