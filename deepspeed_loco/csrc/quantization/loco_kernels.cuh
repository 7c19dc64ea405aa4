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

#include "loco_formats.h"

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

// Everything a hop's kernel needs besides tensors: the C form of deepspeed_loco.layout.HopArgs, filled once at
// the binding boundary (which validates it against loco_limits.h). `bits`: this hop's wire bits; `in_bits` /
// `in_blocks`: the previous hop's bits and the number of blocks summed (hop 2); `beta` rounded to fp32.
struct HopArgs {
    int world, local, bits, group_size;
    float beta;
    Rounding rounding;  // the wire grid's (loco_formats.h; the int8 error buffer is always nearest-even, qmax 127)
    bool hadamard;
    int in_bits, in_blocks;
};

// A bucket's wire buffer: rows of `data_stride` bytes, packed values first, the fp32 scales of the row at
// `scale` (row stride `scale_stride` floats). Parameter columns [col, col + cols) of row r: values at
// data + r * data_stride + col * bits / 8, scales at scale + r * scale_stride + col / group_size.
struct WireArgs {
    uint8_t* data;
    int64_t data_stride;
    float* scale;
    int64_t scale_stride;
};

// The exact own block of a hop (zeropp_loco_param.exact_own_block): the block a rank sends itself skips the wire's
// quantization and its error, and goes to the next step as fp32 rows of an own buffer (the bucket's columns, row
// stride `*_stride` floats, 16-byte aligned). `own`: this rank's block index among the hop's peers (its rows: hop 1
// slots [own * kept, (own + 1) * kept), hop 2 output row own), -1 without; its rows go to `out` (hop 1: kept rows,
// hop 2: one row) and are written to the wire as zeros. `in_own`: the previous hop's own block index (hop 2: the
// received block, the final mean: the received row) that is not read: `in`'s rows take its place, added after the
// other blocks; -1 without.
struct OwnBlock {
    int own = -1, in_own = -1, kept = 0;
    float* out = nullptr;
    int64_t out_stride = 0;
    const float* in = nullptr;
    int64_t in_stride = 0;
};

// Division of 32-bit n < 2^31 by a fixed d in [1, 2^31) as a multiply-high and a shift (the round-up method:
// mul = ceil(2^(31 + l) / d) with l = ceil(log2 d) fits 32 bits, and n * (mul - 2^(31+l)/d) / 2^(31+l) < 1/d keeps
// the floor), set up once on the host.
struct FastDivisor {
    uint32_t d, mul, shift;  // d == 1: mul and shift unused
};

inline FastDivisor fast_divisor(uint32_t d) {
    FastDivisor f{d, 0u, 0u};
    if (d > 1) {
        uint32_t l = 0;
        while ((1ull << l) < d) ++l;
        f.mul = (uint32_t)(((1ull << (31 + l)) + d - 1) / d);
        f.shift = l - 1;  // the multiply-high already divides by 2^32
    }
    return f;
}

LOCO_HD uint32_t divide(uint32_t n, const FastDivisor& f) {
#if defined(__CUDA_ARCH__)
    const uint32_t high = __umulhi(n, f.mul);
#else
    const uint32_t high = (uint32_t)(((uint64_t)n * f.mul) >> 32);
#endif
    return f.d == 1 ? n : high >> f.shift;
}

// One parameter of a bucket, as the kernels' device-side table holds it. The grid of a launch covers every
// (row, group) pair of every parameter: parameter i owns blocks [first_block, next item's first_block), each block
// kBlock / team consecutive pairs in row-major order (so a parameter with a few groups per row still fills blocks).
struct BucketItem {
    const void* grad;     // hop 1: the contiguous gradient
    void* out;            // final: the mean partition (part elements of the output dtype, contiguous)
    int64_t numel;        // hop 1: gradient elements
    int64_t part;         // hop 1 and final: ZeRO-3 partition size ceil(numel / world)
    int64_t valid;        // final: columns of this rank's partition below numel (the rest is written as zero)
    int64_t cols;         // padded partition P' (a multiple of the group size)
    int64_t col;          // first column of the parameter in the bucket's wire rows
    void* err_values;     // error buffer (rows, cols): int8 or fp32 values with row stride err_stride elements,
    float* err_scale;     //   int8: one fp32 scale per group, row stride err_scale_stride; unused without error
    int64_t err_stride, err_scale_stride;
    int64_t first_block;
    FastDivisor groups;   // groups per row: cols / group_size
};

constexpr int kBlock = 256;         // threads per block
// A thread holds `chunks` chunks of 8 consecutive values of its group, so a group of S values has a team of
// S / (8 * chunks) threads; the launchers' chunks_per_thread says how many each kernel uses.

// (row, group) pairs of a parameter with `rows` rows of `cols` columns in groups of `group_size` (a power of two
// within loco_limits.h's bounds); the kernels index them with 32-bit arithmetic (FastDivisor), so the binding keeps
// them below 2^31.
inline int64_t row_groups(int64_t rows, int64_t cols, int group_size) { return rows * (cols / group_size); }

// Blocks that cover those pairs, kBlock / (group_size / (8 * chunks)) pairs per block (written kBlock * 8 * chunks /
// group_size: `chunks` may count chunks of several groups per thread, see chunks_per_thread).
inline int64_t blocks_for(int64_t rows, int64_t cols, int group_size, int chunks) {
    const int64_t per_block = (int64_t)kBlock * 8 * chunks / group_size;
    return (row_groups(rows, cols, group_size) + per_block - 1) / per_block;
}

#if !defined(LOCO_NO_LAUNCHERS)
// Chunks of 8 values per thread of the kernel that a launch of `kernel` with this rotation and error storage runs
// (hop 2 never rotates; the final mean has no error), times the groups each thread takes in turn (1 unless built
// with LOCO_HOP_GROUPS): the binding numbers the blocks of the launch with it (blocks_for).
enum Kernel : int { kHop1Kernel = 0, kHop2Kernel = 1, kFinalKernel = 2 };
int chunks_per_thread(Kernel kernel, bool rotate, ErrorStorage storage);

// Each launcher runs one kernel over the `count` parameters of `items` (a device array, `blocks` blocks in all)
// on `stream`. Arguments are validated by the binding. `stats`: nullptr (an unmeasured launch: its kernel is compiled
// without any of the statistics), or fp32 (blocks, N) that each block fills with its partial sums of the noise
// statistics (hops: N = 2, the squares of the hop's input and of the quantization error c - deq; final: N = 1, the
// squares of the fp32 mean), for the binding to add up (no atomics: deterministic).

// hop 1: partition each gradient into `world` rows of `part` elements padded to `cols`, in slot order (slot
// d*M + n carries row n*L + d), [rotate each group,] compensate with its error (world, cols), quantize into
// `out` (world rows) and update the error in place. All gradients have dtype `grad_dtype`. With `own.own` >= 0 the
// own slots go to `own.out` (after the rotation) and the error has world - own.kept rows (the own slots left out).
const char* quantize_bucket(const HopArgs& args, int grad_dtype, ErrorStorage storage, const BucketItem* items,
                            int count, int64_t blocks, WireArgs out, const OwnBlock& own, float* stats,
                            cudaStream_t stream);

// hop 2: sum the `in_blocks` dequantized blocks of `in` (in_blocks * nodes rows; block i = rows [i*nodes,
// (i+1)*nodes), nodes = world / local) in block order, compensate with the error (nodes, cols), quantize into
// `out` (nodes rows). With `own.in_own` >= 0 that block is skipped and `own.in` (nodes rows) added last; with
// `own.own` >= 0 that output row goes to `own.out` (one row) and the error has nodes - 1 rows.
const char* requantize_bucket(const HopArgs& args, ErrorStorage storage, const BucketItem* items, int count,
                              int64_t blocks, WireArgs in, WireArgs out, const OwnBlock& own, float* stats,
                              cudaStream_t stream);

// final: item.out[j] = (sum over the `rows` rows of dequant(in)[row, col + j], [rotated back per group]) /
// world for j < valid, zero for valid <= j < part (`out_dtype`, contiguous). With `own.in_own` >= 0 that row is
// skipped and `own.in` (one row) added last.
const char* final_mean_bucket(const HopArgs& args, int out_dtype, const BucketItem* items, int count,
                              int64_t blocks, WireArgs in, int rows, const OwnBlock& own, float* stats,
                              cudaStream_t stream);

// The same three launches with an exact own block (own.own >= 0, or own.in_own >= 0 after hop 1): defined in
// loco_kernels_own.cu (a translation unit of its own: see there); the launchers above hand such launches to them.
struct OwnLaunchers {
    decltype(&quantize_bucket) hop1;
    decltype(&requantize_bucket) hop2;
    decltype(&final_mean_bucket) final_mean;
};
extern const OwnLaunchers kOwnLaunchers;

// The live rho's shared sample (deepspeed_loco.ops.loco_reference.gather_sample): out[i] = scales[owners[i]] *
// float(sources[owners[i]][coords[i]]), 0 where coords[i] < 0, for i < n; every source of `dtype` and contiguous.
// All arrays on the device; validated by the binding.
struct SampleArgs {
    const void* const* sources;
    const int64_t* coords;
    const float* scales;
    const int32_t* owners;
    float* out;
    int64_t n;
};
const char* gather_sample(int dtype, const SampleArgs& args, cudaStream_t stream);
#endif

// ------------------------------------------------------------------------------------------------------
// Element arithmetic, identical on host and device.
// ------------------------------------------------------------------------------------------------------
namespace math {

constexpr uint32_t kInfBits = 0x7f800000u;     // |v| bits >= this: inf or NaN
constexpr uint32_t kNaNBits = 0x7fc00000u;     // the NaN torch writes (float("nan"))
constexpr float kRoundMagic = 12582912.0f;     // 1.5 * 2^23: t + magic rounds t to an integer, half to even
constexpr uint32_t kRoundMagicBits = 0x4b400000u;

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
LOCO_HD float f_rcp(float a) { return __frcp_rn(a); }  // fl(1 / a), like f_div(1, a)
LOCO_HD float f_rint(float a) { return rintf(a); }
LOCO_HD float f_fma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
// magic + floor(q) for an integer magic in [2^23 + 2^22, 2^24 - 2^22] and |q| < 2^22: one add rounded toward -inf.
LOCO_HD float floor_biased(float q, float magic) { return __fadd_rd(q, magic); }
#else
LOCO_HD float f_add(float a, float b) { return a + b; }
LOCO_HD float f_sub(float a, float b) { return a - b; }
LOCO_HD float f_mul(float a, float b) { return a * b; }
LOCO_HD float f_div(float a, float b) { return a / b; }
LOCO_HD float f_rcp(float a) { return 1.0f / a; }
LOCO_HD float f_rint(float a) { return rintf(a); }
LOCO_HD float f_fma(float a, float b, float c) { return fmaf(a, b, c); }
LOCO_HD float floor_biased(float q, float magic) {
    const float s = q + magic;  // magic + rint(q), exact
    return s - magic > q ? s - 1.0f : s;
}
#endif
// magic + rint(q) (half to even: magic is even) for |q| < 2^22, magic as for floor_biased.
LOCO_HD float rint_biased(float q, float magic) { return f_add(q, magic); }

LOCO_HD float f_min(float a, float b) { return a < b ? a : b; }
LOCO_HD float f_max(float a, float b) { return a > b ? a : b; }

// A group's key is the bits of max |v| taken with NaN propagation (any NaN gives the NaN 0x7fffffff): as an
// unsigned integer it orders like |v|, so team maxima of keys are keys, and it is both the absmax and the
// finiteness test (key >= kInfBits: inf or NaN in the group). absmax_step is one instruction on the device.
LOCO_HD float absmax_step(float m, float v) {
#if defined(__CUDA_ARCH__)
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(m), "f"(fabsf(v)));
    return r;
#else
    const float a = fabsf(v);
    if (m != m || a != a) return bits_float(0x7fffffffu);
    return a > m ? a : m;
#endif
}
LOCO_HD uint32_t key_of(float absmax) { return float_bits(absmax); }
LOCO_HD bool key_finite(uint32_t key) { return key < kInfBits; }

// A grid's divisor d with its reciprocal in two parts, for group_scale: inv = fl(1 / d), inv_lo = fl((1 - d * inv) /
// d), so inv + inv_lo = 1 / d to about 2^-48 (the fma in `reciprocal` is exact: 1 - d * inv).
struct Reciprocal {
    float d, inv, inv_lo;
};

LOCO_HD Reciprocal reciprocal(float d) {
    Reciprocal r;
    r.d = d;
    r.inv = f_rcp(d);
    r.inv_lo = f_mul(f_fma(-d, r.inv, 1.0f), r.inv);
    return r;
}

constexpr float kTwoToMinus100 = 7.888609052210118e-31f;
constexpr float kSmallestNormal = 1.1754943508222875e-38f;  // 2^-126: a smaller scale's reciprocal may overflow
constexpr float kSubnormalLift = 1.8446744073709552e+19f;   // 2^64: lifts a subnormal scale and its values, exactly

// q0 = c * (inv + inv_lo), rounded once: within one ulp of c / d.
LOCO_HD float reciprocal_product(float c, const Reciprocal& d) { return f_fma(c, d.inv, f_mul(c, d.inv_lo)); }

// The codes of a grid of `bits` bits (deepspeed_loco.layout.formats.Grid.levels, whose mirror this is): scale =
// absmax / divisor; code k in [low, high] stands for (k + half) * scale, half the rounding's cell_centre; the values
// are symmetric about 0: high = 2^(b-1) - 1, low = -(high + 2 half), divisor = high + half (the highest value, in
// steps). Nearest-even (symmetric grid): k = rint(c / scale) in [-qmax, qmax]; floor (mid-rise grid): k = floor(c /
// scale) in [-2^(b-1), 2^(b-1) - 1], every code used (c / scale: the ratio of `quantize`). `divisor` carries its
// reciprocal (set up once per launch) so that a group's scale costs one reciprocal_product.
struct Levels {
    Reciprocal divisor;
    float low, high, half;
};

LOCO_HD Levels levels(int bits, Rounding rounding) {
    Levels l;
    l.high = (float)((1 << (bits - 1)) - 1);
    l.half = cell_centre(rounding);
    l.divisor = reciprocal(l.high + l.half);
    l.low = -(l.high + 2.0f * l.half);
    return l;
}

// Value of code k (as float): (k + half) * scale, rounded once after the exact sum. For half = 0 the sum is k.
LOCO_HD float dequant(float k, float half, float scale) { return f_mul(f_add(k, half), scale); }

// Per-group quantization rule derived from the group's absmax key.
struct Rule {
    float s;    // the scale, absmax / divisor; NaN for a non-finite group; 0 for a zero (or underflowing) group
    float inv;  // kReciprocal: fl(1 / scale); kLifted: fl(1 / (scale * 2^64)); the factor of every value's ratio
    int mode;
    LOCO_HD float scale() const { return s; }
};
constexpr int kAllZero = 0;     // q = 0 for every element (zero, underflowing or non-finite group)
constexpr int kReciprocal = 1;  // ratio c * inv (a normal scale)
constexpr int kLifted = 2;      // ratio (c * 2^64) * inv (a subnormal scale)

// The scale absmax / divisor, IEEE-rounded, as q0 = reciprocal_product(absmax, divisor) for absmax >= 2^-100, the
// division itself below. Why q0 is already the IEEE quotient: every divisor is D / 2^j with D odd and at most 255
// (1, 3, 7, 127; 1.5, 3.5, 7.5, 127.5), and absmax = A * 2^i with A < 2^24, so
// absmax / divisor is never a midpoint between floats (that needs 25 significant bits; A / D, if an integer, has at
// most 24) and stays at least 2^-33 of its size away from one, while q0 is within about 2^-46 of it, and normal
// (>= 2^-107).
LOCO_HD float group_scale(float absmax, const Levels& lv) {
    return absmax >= kTwoToMinus100 ? reciprocal_product(absmax, lv.divisor) : f_div(absmax, lv.divisor.d);
}

LOCO_HD Rule make_rule(uint32_t key, const Levels& lv) {
    Rule r;
    r.inv = 0.0f;
    if (!key_finite(key)) {
        r.s = bits_float(kNaNBits);
        r.mode = kAllZero;
        return r;
    }
    r.s = group_scale(bits_float(key), lv);
    if (!(r.s > 0.0f)) {
        r.mode = kAllZero;
    } else if (r.s >= kSmallestNormal) {
        r.inv = f_rcp(r.s);
        r.mode = kReciprocal;
    } else {
        r.inv = f_rcp(f_mul(r.s, kSubnormalLift));
        r.mode = kLifted;
    }
    return r;
}

// The ratio of c to the group's scale that the codes round (deepspeed_loco.ops.quantizer.ratios): c * fl(1 / scale),
// DeepSpeed's arithmetic; for a subnormal scale the same of c and the scale both lifted by 2^64 (exact).
LOCO_HD float ratio(float c, const Rule& rule) {
    return f_mul(rule.mode == kReciprocal ? c : f_mul(c, kSubnormalLift), rule.inv);
}

struct Quantized {
    int q;     // in [low, high]
    float qf;  // (float)q, +0 for 0
};

// One value's code: clamp(rint(ratio)) (nearest-even) or clamp(floor(ratio)); 0 for kAllZero groups.
template <Rounding R>
LOCO_HD Quantized quantize(float c, const Rule& rule, const Levels& lv) {
    Quantized out;
    out.q = 0;
    out.qf = 0.0f;
    if (rule.mode == kAllZero) return out;
    const float x = ratio(c, rule);
    const float q = f_min(f_max(R == Rounding::kFloor ? floorf(x) : f_rint(x), lv.low), lv.high);
    out.q = (int)q;
    out.qf = (float)out.q;
    return out;
}

// A code k of `Bits` bits as the kernels carry it between quantizing and packing: the float magic<Bits>() + k, where
// magic = M + offset (M = kRoundMagic = 1.5 * 2^23; offset 2^(Bits-1) below 8 bits, 0 for 8 bits). Its bits are those
// of M plus u = k + offset (integer addition: every such float lies in [2^23, 2^24), where the ulp is 1), so u, in
// [0, 2^Bits), sits in the low bits with zeros above it up to bit 21 (see pack_word), and k = biased - magic exactly.
template <int Bits>
LOCO_HD constexpr uint32_t code_offset() { return Bits == 8 ? 0u : 1u << (Bits - 1); }
template <int Bits>
LOCO_HD constexpr float magic() { return kRoundMagic + (float)code_offset<Bits>(); }
template <int Bits>
LOCO_HD float code_of(float biased) { return f_sub(biased, magic<Bits>()); }
LOCO_HD uint32_t code_bits(float biased) { return float_bits(biased); }

// The kernels' form of `quantize`: biased[i] = magic<Bits>() + code (see code_of), equal to `quantize`'s codes
// element by element. A group with a kReciprocal rule takes quantize_chunk_fast (one product and one rounding add per
// value, no branch, no clamp); the others (kLifted, kAllZero: rare) quantize_chunk_exact, every value's `quantize`.
// Precondition: every |v| is at most the absmax the rule was made from (a group's own values): then |c * inv| <=
// divisor * (1 + 2^-21) (three roundings: the scale, its reciprocal, the product), which rounds to no code beyond the
// grid's (the divisor is at most 127.5), so the fast codes need no clamp.
template <Rounding R, int Bits>
LOCO_HD void quantize_chunk_fast(const float (&v)[8], const Rule& rule, float (&biased)[8]) {
    LOCO_UNROLL
    for (int i = 0; i < 8; ++i) {
        const float q = ratio(v[i], rule);  // c * inv: the caller took this path for a kReciprocal rule
        biased[i] = R == Rounding::kFloor ? floor_biased(q, magic<Bits>()) : rint_biased(q, magic<Bits>());
    }
}

template <Rounding R, int Bits>
LOCO_HD void quantize_chunk_exact(const float (&v)[8], const Rule& rule, const Levels& lv, float (&biased)[8]) {
    LOCO_UNROLL
    for (int i = 0; i < 8; ++i)
        biased[i] = rule.mode == kAllZero ? magic<Bits>() : f_add(quantize<R>(v[i], rule, lv).qf, magic<Bits>());
}

// Residual and LoCo update: e' = beta*e + (1-beta)*(c - dequant(q)), each operation rounded in this order. The
// kernels take beta*e when they read e (`decayed`) and finish with update_decayed.
LOCO_HD float residual(float c, float qf, float half, float scale) { return f_sub(c, dequant(qf, half, scale)); }
LOCO_HD float update_decayed(float decayed, float r, float one_minus_beta) {
    return f_add(decayed, f_mul(r, one_minus_beta));
}
LOCO_HD float update(float e, float r, float beta, float one_minus_beta) {
    return update_decayed(f_mul(e, beta), r, one_minus_beta);
}

// The sign bit of every value of a packed word; word ^ kSignBits<Bits> holds each code k as k + 2^(Bits-1).
template <int Bits>
LOCO_HD constexpr uint64_t sign_bits() {
    uint64_t m = 0;
    for (int j = 0; j < 8; ++j) m |= (uint64_t)1 << (Bits * j + Bits - 1);
    return m;
}

// Packed words: 8 codes of `Bits` bits, little-endian (value j at bits [Bits*j, Bits*j + Bits)), two's complement,
// from 8 biased codes (code_of). 8 bits: the low byte of each (u = k mod 256), 3 byte permutes per 4 on the device.
// Fewer bits: Horner's rule w = sum_j bits(b_j) * 2^(Bits*j) mod 2^32, one multiply-add per code; bits(b_j) = B + u_j
// (B = bits of M), so w = sum_j u_j * 2^(Bits*j) + B * sum_j 2^(Bits*j) mod 2^32, and the first sum has 8 * Bits <= 32
// bits: subtracting the constant leaves the offset codes u_j = k_j + 2^(Bits-1) (nothing above bit 8 * Bits), and
// flipping each sign bit the codes.
template <int Bits>
LOCO_HD uint64_t pack_word(const float (&b)[8]) {
    if (Bits == 8) {
        uint32_t w[2];
        LOCO_UNROLL
        for (int h = 0; h < 2; ++h) {
#if defined(__CUDA_ARCH__)
            const uint32_t lo = __byte_perm(code_bits(b[4 * h]), code_bits(b[4 * h + 1]), 0x0040u);
            const uint32_t hi = __byte_perm(code_bits(b[4 * h + 2]), code_bits(b[4 * h + 3]), 0x0040u);
            w[h] = __byte_perm(lo, hi, 0x5410u);
#else
            w[h] = 0;
            for (int j = 0; j < 4; ++j) w[h] |= (code_bits(b[4 * h + j]) & 0xffu) << (8 * j);
#endif
        }
        return (uint64_t)w[0] | ((uint64_t)w[1] << 32);
    }
    constexpr uint32_t radix = 1u << Bits;
    uint32_t series = 0;  // sum_j radix^j, j < 8, mod 2^32 (folded by the compiler)
    for (int j = 0; j < 8; ++j) series = series * radix + 1u;
    const uint32_t junk = kRoundMagicBits * series;
    uint32_t w = code_bits(b[7]);
    LOCO_UNROLL
    for (int j = 6; j >= 0; --j) w = w * radix + code_bits(b[j]);
    return (uint64_t)((w - junk) ^ (uint32_t)sign_bits<Bits>());
}

// The value of code j of a packed word whose sign bits were flipped (`offset_word` = word ^ sign_bits<Bits>()) in
// steps, k + cell_centre(R): k as a float (nearest-even) or k + 0.5 (floor), exact and without an integer-to-float
// conversion: the offset code u = k + h (h = 2^(Bits-1)) is placed in the mantissa of 1.5 * 2^23 (or of 1.5 * 2^22 as
// 2u, for halves) and the constant M + h (M + h - 0.5) subtracted, both exact.
// `magic_bits`: kRoundMagicBits, passed in where a kernel holds it in a register (see OldError<8, C>).
// On the device, cell centre 0: 8 bits take byte j by one byte permute beside the top three bytes of M (whose low
// byte is zero); 4 bits the same from a word of one nibble a byte (the even or the odd codes, masked once per word
// and shared by its four codes): the same bits as the shift-and-mask below.
template <int Bits, Rounding R>
LOCO_HD float code_value(uint64_t offset_word, int j, uint32_t magic_bits = kRoundMagicBits) {
    constexpr uint32_t h = 1u << (Bits - 1);
    constexpr bool halves = cell_centre(R) != 0.0f;
    static_assert(cell_centre(R) == 0.0f || cell_centre(R) == 0.5f, "code_value decodes cell centres 0 and 1/2");
    static_assert((kRoundMagicBits & 0xffu) == 0u, "the byte permutes below take M's low byte as zero");
#if defined(__CUDA_ARCH__)
    if (Bits == 8 && !halves)
        return f_sub(__uint_as_float(__byte_perm((uint32_t)(offset_word >> (32 * (j >> 2))), magic_bits,
                                                 0x7650u + (uint32_t)(j & 3))),
                     kRoundMagic + (float)h);
    if (Bits == 4 && !halves) {
        const uint32_t word = (uint32_t)offset_word;
        const uint32_t nibbles = (j & 1) ? (word >> 4) & 0x0f0f0f0fu : word & 0x0f0f0f0fu;
        return f_sub(__uint_as_float(__byte_perm(nibbles, magic_bits, 0x7650u + (uint32_t)(j >> 1))),
                     kRoundMagic + (float)h);
    }
#endif
    constexpr int up = halves ? 1 : 0;
    const int at = Bits * j - up;
    const uint32_t field = (uint32_t)(at >= 0 ? offset_word >> at : offset_word << up) & (((1u << Bits) - 1u) << up);
    if (halves) return f_sub(bits_float(0x4ac00000u | field), 6291456.0f + (float)h - 0.5f);  // 1.5 * 2^22
    return f_sub(bits_float(kRoundMagicBits | field), kRoundMagic + (float)h);
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
