// LoCo fused kernels: plain C++ launcher API and the fp32 element arithmetic they share.
//
// This header includes no torch header. The launcher declarations compile in any C++17 translation unit
// that can see <cuda_runtime_api.h>; the element arithmetic (namespace loco::math) also compiles as plain
// host C++ (g++ -ffp-contract=off), which is how the CPU tests check it against the Python reference.
//
// Contract (deepspeed_loco/ops/loco_reference.py): every fp32 operation is rounded once, in the reference's
// order, with no contraction into FMA; integer outputs (packed data, int8 error) and fp32 scales are
// bit-identical to the reference run on the CPU.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define LOCO_HD __host__ __device__ __forceinline__
#else
#define LOCO_HD inline
#include <math.h>
#include <string.h>
#endif

#if !defined(LOCO_NO_LAUNCHERS)
#include <cuda_runtime_api.h>
#endif

#if defined(__CUDACC__)
#define LOCO_UNROLL _Pragma("unroll")
#else
#define LOCO_UNROLL
#endif

namespace loco {

// ------------------------------------------------------------------------------------------------------
// Launcher API (implemented in loco_kernels.cu). Each returns nullptr on success or a static message:
// an invalid argument (nothing launched) or the CUDA error of the launch.
// ------------------------------------------------------------------------------------------------------

enum GradDType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// A block of rows on the wire: packed values uint8 (rows, cols * bits / 8) with a row stride of
// `data_stride` bytes, and one fp32 scale per group, (rows, cols / group_size), row stride `scale_stride`
// floats. Both have unit stride along a row.
struct WireArgs {
    uint8_t* data;
    int64_t data_stride;
    float* scale;
    int64_t scale_stride;
    int bits;  // 2, 3, 4 or 8
};

// An error-feedback buffer (rows, cols): bits 0 = none (plain quantization), 8 = int8 values + fp32 scale
// per group (`scale`, row stride `scale_stride`), 32 = fp32 values. `values` has unit stride along a row
// and a row stride of `values_stride` elements.
struct ErrorArgs {
    int bits;
    void* values;
    int64_t values_stride;
    float* scale;
    int64_t scale_stride;
    float beta;  // already rounded to fp32; 1 - beta is formed in fp32 by the launcher
};

#if !defined(LOCO_NO_LAUNCHERS)
// hop 1: partition `grad` (numel elements, dtype `grad_dtype`) into `world` rows of `part` = ceil(numel/world)
// elements padded to `cols`, in slot order (slot d*M + n carries row n*L + d), compensate with `err`
// (world, cols), quantize to `out` (world rows) and update `err` in place.
// `hadamard`: each group is rotated (H (d * x) * s, s = fp32(1/sqrt(group_size))) before compensation.
const char* hop1(const void* grad, int grad_dtype, int64_t numel, int world, int local, int64_t part,
                 int64_t cols, int group_size, bool hadamard, ErrorArgs err, WireArgs out, cudaStream_t stream);

// hop 2: sum the `local` dequantized blocks of `in` ((local*nodes) rows; block i = rows [i*nodes,
// (i+1)*nodes)) in block order, compensate with `err` (nodes, cols), quantize to `out` (nodes rows).
const char* hop2(WireArgs in, int local, int nodes, int64_t cols, int group_size, ErrorArgs err, WireArgs out,
                 cudaStream_t stream);

// final: out[j] = (sum over the `rows` rows of dequant(in)[row, j]) / world for j < `part`, zero for
// j >= `valid`; `out` is contiguous, `part` elements of `out_dtype`. `hadamard`: the row sum of each group is
// rotated back (d * (H t) * s) before the division.
const char* final_mean(WireArgs in, int rows, int64_t cols, int group_size, bool hadamard, int world,
                       int64_t part, int64_t valid, void* out, int out_dtype, cudaStream_t stream);
#endif

// ------------------------------------------------------------------------------------------------------
// Element arithmetic, identical on host and device.
// ------------------------------------------------------------------------------------------------------
namespace math {

constexpr uint32_t kInfBits = 0x7f800000u;     // |v| bits >= this: inf or NaN
constexpr uint32_t kNaNBits = 0x7fc00000u;     // the NaN torch writes (float("nan"))
constexpr float kRoundMagic = 12582912.0f;     // 1.5 * 2^23: t + magic rounds t to an integer, half to even
constexpr uint32_t kRoundMagicBits = 0x4b400000u;
// Distance from a half-integer under which the reciprocal product may round differently from the IEEE
// quotient: |c*inv - c/scale| <= 127.5 * 2^-23 < 2^-16 and |fl(c/scale) - c/scale| <= 2^-18 for |q| <= 127.
constexpr float kTieGuard = 0.5f - 0.00006103515625f;  // 0.5 - 2^-14

LOCO_HD uint32_t float_bits(float v) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(v);
#else
    uint32_t u;
    memcpy(&u, &v, 4);
    return u;
#endif
}

LOCO_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float v;
    memcpy(&v, &u, 4);
    return v;
#endif
}

#if defined(__CUDA_ARCH__)
LOCO_HD float f_add(float a, float b) { return __fadd_rn(a, b); }
LOCO_HD float f_sub(float a, float b) { return __fsub_rn(a, b); }
LOCO_HD float f_mul(float a, float b) { return __fmul_rn(a, b); }
LOCO_HD float f_div(float a, float b) { return __fdiv_rn(a, b); }
LOCO_HD float f_rint(float a) { return rintf(a); }
#else
LOCO_HD float f_add(float a, float b) { return a + b; }
LOCO_HD float f_sub(float a, float b) { return a - b; }
LOCO_HD float f_mul(float a, float b) { return a * b; }
LOCO_HD float f_div(float a, float b) { return a / b; }
LOCO_HD float f_rint(float a) { return rintf(a); }
#endif

LOCO_HD float f_min(float a, float b) { return a < b ? a : b; }
LOCO_HD float f_max(float a, float b) { return a > b ? a : b; }

// Key whose unsigned maximum over a group is both the absmax (as bits) and the finiteness test.
LOCO_HD uint32_t abs_key(float v) { return float_bits(v) & 0x7fffffffu; }
LOCO_HD bool key_finite(uint32_t key) { return key < kInfBits; }

// Per-group quantization rule derived from the group's absmax key.
struct Rule {
    float scale;  // absmax / qmax; NaN for a non-finite group; 0 for a zero (or underflowing) group
    float inv;    // fl(1 / scale) when mode == kReciprocal
    int mode;
};
constexpr int kAllZero = 0;     // q = 0 for every element (zero, underflowing or non-finite group)
constexpr int kReciprocal = 1;  // q from c * inv, exact division near half-integers
constexpr int kDivide = 2;      // q from c / scale (scale outside [2^-125, 2^125])

LOCO_HD Rule make_rule(uint32_t key, float qmax) {
    Rule r;
    r.inv = 0.0f;
    if (!key_finite(key)) {
        r.scale = bits_float(kNaNBits);
        r.mode = kAllZero;
        return r;
    }
    r.scale = f_div(bits_float(key), qmax);
    if (!(r.scale > 0.0f)) {
        r.mode = kAllZero;
    } else if (r.scale >= 2.350988701644575e-38f /* 2^-125 */ && r.scale <= 4.253529586511730e+37f /* 2^125 */) {
        r.inv = f_div(1.0f, r.scale);
        r.mode = kReciprocal;
    } else {
        r.mode = kDivide;
    }
    return r;
}

struct Quantized {
    int q;     // in [-qmax, qmax]
    float qf;  // (float)q, +0 for 0
};

// q = clamp(rint(c / scale), -qmax, qmax) with IEEE division, 0 for kAllZero groups.
LOCO_HD Quantized quantize(float c, const Rule& rule, float qmax) {
    Quantized out;
    if (rule.mode == kAllZero) {
        out.q = 0;
        out.qf = 0.0f;
        return out;
    }
    if (rule.mode == kReciprocal) {
        const float t = f_min(f_max(f_mul(c, rule.inv), -qmax), qmax);
        const float shifted = f_add(t, kRoundMagic);
        const float rounded = f_sub(shifted, kRoundMagic);
        const float gap = f_sub(t, rounded);
        if (gap <= kTieGuard && gap >= -kTieGuard) {
            out.q = (int)(float_bits(shifted) - kRoundMagicBits);
            out.qf = rounded;
            return out;
        }
    }
    const float q = f_min(f_max(f_rint(f_div(c, rule.scale)), -qmax), qmax);
    out.q = (int)q;
    out.qf = (float)out.q;
    return out;
}

// The kernels' form of `quantize` for the values one thread holds: qf[c][i] = (float)q, +0 for 0. The reciprocal
// product is computed for all values without branches; if any of them lies within 2^-14 of a half-integer the
// whole set is redone with IEEE division (rare), so the result always equals `quantize` element by element.
template <int C>
LOCO_HD void quantize_chunks(const float (&v)[C][8], const Rule& rule, float qmax, float (&qf)[C][8]) {
    if (rule.mode == kReciprocal) {
        float worst = 0.0f;
        LOCO_UNROLL
        for (int c = 0; c < C; ++c) {
            LOCO_UNROLL
            for (int i = 0; i < 8; ++i) {
                const float t = f_min(f_max(f_mul(v[c][i], rule.inv), -qmax), qmax);
                const float rounded = f_sub(f_add(t, kRoundMagic), kRoundMagic);
                worst = f_max(worst, fabsf(f_sub(t, rounded)));
                qf[c][i] = rounded;
            }
        }
        if (worst <= kTieGuard) return;
    }
    LOCO_UNROLL
    for (int c = 0; c < C; ++c) {
        LOCO_UNROLL
        for (int i = 0; i < 8; ++i) qf[c][i] = rule.mode == kAllZero ? 0.0f : quantize(v[c][i], rule, qmax).qf;
    }
}

// q (two's complement, low bits are what is packed) from an integer-valued qf with |qf| < 2^22.
LOCO_HD int q_of(float qf) { return (int)(float_bits(f_add(qf, kRoundMagic)) - kRoundMagicBits); }

// Residual and LoCo update: e' = beta*e + (1-beta)*(c - q*scale), each operation rounded in this order.
LOCO_HD float residual(float c, float qf, float scale) { return f_sub(c, f_mul(qf, scale)); }
LOCO_HD float update(float e, float r, float beta, float one_minus_beta) {
    return f_add(f_mul(e, beta), f_mul(r, one_minus_beta));
}

// Sign-extends value j (0..7) of a packed little-endian word of 8 values of `Bits` bits.
template <int Bits>
LOCO_HD int unpack_value(uint64_t word, int j) {
    const int64_t shifted = (int64_t)(word << (64 - Bits * (j + 1)));
    return (int)(shifted >> (64 - Bits));
}

template <int Bits>
LOCO_HD uint64_t pack_value(int q, int j) {
    return ((uint64_t)((uint32_t)q & ((1u << Bits) - 1u))) << (Bits * j);
}

// Randomized Hadamard rotation (deepspeed_loco/ops/hadamard.py): column i of every group is negated before the
// butterfly (forward) or after it (inverse) when bit 31 of MurmurHash3's finalizer fmix32(i) is set.
LOCO_HD constexpr uint32_t fmix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return h;
}

LOCO_HD constexpr bool hadamard_negative(uint32_t column) { return (fmix32(column) >> 31) != 0u; }

// fp32 -> bf16 bits, round to nearest even, NaN -> 0x7fc0 (torch's conversion).
LOCO_HD uint16_t float_to_bf16_bits(float v) {
    const uint32_t u = float_bits(v);
    if ((u & 0x7fffffffu) > kInfBits) return (uint16_t)0x7fc0u;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

LOCO_HD float bf16_bits_to_float(uint16_t b) { return bits_float(((uint32_t)b) << 16); }

}  // namespace math
}  // namespace loco
