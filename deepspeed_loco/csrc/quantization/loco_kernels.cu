// LoCo fused CUDA kernels: hop 1 (partition + swizzle + compensate + quantize + error update + pack), hop 2
// (dequantize-sum the L received blocks + compensate + quantize + error update + pack) and the final
// dequantize-sum-mean. No torch header: the binding (loco_binding.cpp) calls the launchers below.
//
// Work split (docs/kernels.md): a block of kBlock threads; each quantization group of S elements is handled by
// a team of S / 16 threads (2 .. 256), each thread holding kChunks chunks of 8 consecutive values in registers
// (chunk c of lane l covers columns 8 * (c * team + l) .. +8 of the group, so a warp's loads are contiguous).
// Two team reductions per group (absmax of c, absmax of the new error) use warp shuffles (team <= 32) or
// shared memory (team > 32). Every input byte is read once and every output byte written once; there is no
// temporary in device memory. All offsets are 64-bit.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <math.h>

#include <type_traits>

#include "loco_kernels.cuh"

#if defined(__USE_FAST_MATH__)
#error "loco_kernels.cu must be built without --use_fast_math (the reference fixes IEEE fp32 arithmetic)"
#endif

namespace loco {
namespace {

using namespace math;

constexpr int kBlock = 256;            // threads per block
constexpr int kChunks = 2;             // chunks of 8 values per thread
constexpr int kValuesPerThread = 8 * kChunks;
constexpr int kMinGroup = 32;
constexpr int kMaxGroup = 4096;
constexpr int kMaxGridY = 65535;

template <int Bits>
struct Q {
    static constexpr float kMax = (float)((1 << (Bits - 1)) - 1);
};

__device__ __forceinline__ bool aligned(const void* p, uintptr_t bytes) {
    return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

// ---------------------------------------------------------------------------------------------- gradients
template <int DT>
struct Grad;

template <>
struct Grad<kFloat32> {
    static constexpr int kSize = 4;
    __device__ static float one(const void* g, int64_t i) { return __ldcs(static_cast<const float*>(g) + i); }
    __device__ static void eight(const void* g, int64_t i, float (&x)[8]) {
        const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(g) + i);
        const float4 a = __ldcs(p), b = __ldcs(p + 1);
        x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
        x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
    }
};

template <>
struct Grad<kFloat16> {
    static constexpr int kSize = 2;
    __device__ static float one(const void* g, int64_t i) {
        return __half2float(__ushort_as_half(__ldcs(static_cast<const unsigned short*>(g) + i)));
    }
    __device__ static void eight(const void* g, int64_t i, float (&x)[8]) {
        const uint4 r = __ldcs(reinterpret_cast<const uint4*>(static_cast<const unsigned short*>(g) + i));
        const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            x[2 * k] = __half2float(__ushort_as_half((unsigned short)(w[k] & 0xffffu)));
            x[2 * k + 1] = __half2float(__ushort_as_half((unsigned short)(w[k] >> 16)));
        }
    }
};

template <>
struct Grad<kBFloat16> {
    static constexpr int kSize = 2;
    __device__ static float one(const void* g, int64_t i) {
        return bf16_bits_to_float(__ldcs(static_cast<const unsigned short*>(g) + i));
    }
    __device__ static void eight(const void* g, int64_t i, float (&x)[8]) {
        const uint4 r = __ldcs(reinterpret_cast<const uint4*>(static_cast<const unsigned short*>(g) + i));
        const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            x[2 * k] = __uint_as_float(w[k] << 16);
            x[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
        }
    }
};

// ------------------------------------------------------------------------------------------ packed words
template <int Bits>
__device__ __forceinline__ uint64_t load_word(const uint8_t* p) {
    if (Bits == 8 && aligned(p, 8)) {
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        return (uint64_t)v.x | ((uint64_t)v.y << 32);
    }
    if (Bits == 4 && aligned(p, 4)) return *reinterpret_cast<const uint32_t*>(p);
    if (Bits == 2 && aligned(p, 2)) return *reinterpret_cast<const unsigned short*>(p);
    uint64_t w = 0;
#pragma unroll
    for (int b = 0; b < Bits; ++b) w |= (uint64_t)p[b] << (8 * b);
    return w;
}

template <int Bits>
__device__ __forceinline__ void store_word(uint8_t* p, uint64_t w) {
    if (Bits == 8 && aligned(p, 8)) {
        __stcs(reinterpret_cast<uint2*>(p), make_uint2((uint32_t)w, (uint32_t)(w >> 32)));
        return;
    }
    if (Bits == 4 && aligned(p, 4)) {
        __stcs(reinterpret_cast<unsigned int*>(p), (unsigned int)w);
        return;
    }
    if (Bits == 2 && aligned(p, 2)) {
        __stcs(reinterpret_cast<unsigned short*>(p), (unsigned short)w);
        return;
    }
#pragma unroll
    for (int b = 0; b < Bits; ++b) p[b] = (uint8_t)(w >> (8 * b));
}

// ------------------------------------------------------------------------------------------ error buffer
// Where one row of an error buffer and its scale for the current group live.
struct ErrorRow {
    void* values;  // at the group's first column
    float* scale;  // the group's scale (int8 storage)
};

template <int EBits>
__device__ __forceinline__ ErrorRow error_row(const ErrorArgs& err, int64_t row, int64_t col0, int64_t group) {
    ErrorRow r{nullptr, nullptr};
    if (EBits == 8) {
        r.values = static_cast<int8_t*>(err.values) + row * err.values_stride + col0;
        r.scale = err.scale + row * err.scale_stride + group;
    } else if (EBits == 32) {
        r.values = static_cast<float*>(err.values) + row * err.values_stride + col0;
    }
    return r;
}

// The stored error of the thread's chunks as loaded: int8 keeps the raw bytes and the group's scale (decoded
// when used, which saves registers), fp32 keeps the values, none is zero.
template <int EBits>
struct OldError {
    __device__ float at(int, int) const { return 0.0f; }
};

template <>
struct OldError<8> {
    uint2 raw[kChunks];
    float scale;
    __device__ float at(int c, int i) const {
        const uint32_t w = i < 4 ? raw[c].x : raw[c].y;
        return f_mul((float)(int)(int8_t)(uint8_t)(w >> (8 * (i & 3))), scale);
    }
};

template <>
struct OldError<32> {
    float e[kChunks][8];
    __device__ float at(int c, int i) const { return e[c][i]; }
};

// Loads the error of the chunks of lane `lane` (chunk c starts 8 * (c * team + lane) columns into the group).
__device__ __forceinline__ void load_error(const ErrorRow&, int, int, OldError<0>&) {}

__device__ __forceinline__ void load_error(const ErrorRow& r, int lane, int team, OldError<8>& out) {
    out.scale = *r.scale;
    const int8_t* base = static_cast<const int8_t*>(r.values);
    if (aligned(base, 8)) {
#pragma unroll
        for (int c = 0; c < kChunks; ++c) out.raw[c] = *reinterpret_cast<const uint2*>(base + 8 * (c * team + lane));
    } else {
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
            const uint8_t* p = reinterpret_cast<const uint8_t*>(base + 8 * (c * team + lane));
            out.raw[c].x = p[0] | (p[1] << 8) | (p[2] << 16) | ((uint32_t)p[3] << 24);
            out.raw[c].y = p[4] | (p[5] << 8) | (p[6] << 16) | ((uint32_t)p[7] << 24);
        }
    }
}

__device__ __forceinline__ void load_error(const ErrorRow& r, int lane, int team, OldError<32>& out) {
    const float* base = static_cast<const float*>(r.values);
    if (aligned(base, 16)) {
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
            const float4* p = reinterpret_cast<const float4*>(base + 8 * (c * team + lane));
            const float4 a = p[0], b = p[1];
            out.e[c][0] = a.x; out.e[c][1] = a.y; out.e[c][2] = a.z; out.e[c][3] = a.w;
            out.e[c][4] = b.x; out.e[c][5] = b.y; out.e[c][6] = b.z; out.e[c][7] = b.w;
        }
    } else {
#pragma unroll
        for (int c = 0; c < kChunks; ++c)
#pragma unroll
            for (int i = 0; i < 8; ++i) out.e[c][i] = base[8 * (c * team + lane) + i];
    }
}

__device__ __forceinline__ void zero_error(OldError<0>&) {}
__device__ __forceinline__ void zero_error(OldError<8>& e) {
#pragma unroll
    for (int c = 0; c < kChunks; ++c) e.raw[c] = make_uint2(0u, 0u);
    e.scale = 0.0f;
}
__device__ __forceinline__ void zero_error(OldError<32>& e) {
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
#pragma unroll
        for (int i = 0; i < 8; ++i) e.e[c][i] = 0.0f;
}

// ------------------------------------------------------------------------------------------- reductions
// Unsigned max over the team of 2^team_log2 consecutive threads (uniform across the block).
__device__ __forceinline__ uint32_t team_max(uint32_t v, int team_log2, uint32_t* red) {
    if (team_log2 < 5) {
        for (int off = (1 << team_log2) >> 1; off > 0; off >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, off));
        return v;
    }
#if __CUDA_ARCH__ >= 800
    v = __reduce_max_sync(0xffffffffu, v);
#else
    for (int off = 16; off > 0; off >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, off));
#endif
    if (team_log2 == 5) return v;
    __syncthreads();  // the previous reduction's readers are done with red
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    const int warps = 1 << (team_log2 - 5);
    const int first = (threadIdx.x >> team_log2) * warps;
    uint32_t m = 0;
    for (int w = 0; w < warps; ++w) m = max(m, red[first + w]);
    return m;
}

// ----------------------------------------------------------------------------------- Hadamard rotation
// The butterfly of ops/hadamard.py on a team's group: strides 1, 2, 4 inside a chunk, 8 .. 4 * team across lanes
// (warp shuffles, or shared memory once the partner is in another warp), 8 * team across the two chunks; each
// stage maps (a, b) at columns (j, j + stride) to (a + b, a - b), in increasing stride order like the reference.
static_assert(kChunks == 2, "the last butterfly stage pairs the two chunks of a thread");

// One bit per column (1 = negated), columns 8 * k .. 8 * k + 7 in byte k, for every group size up to kMaxGroup.
struct SignBits {
    uint8_t byte[kMaxGroup / 8];
};

constexpr SignBits make_sign_bits() {
    SignBits t{};
    for (uint32_t col = 0; col < (uint32_t)kMaxGroup; ++col)
        if (hadamard_negative(col)) t.byte[col / 8] = (uint8_t)(t.byte[col / 8] | (1u << (col % 8)));
    return t;
}

__device__ const SignBits kSignBits = make_sign_bits();

// The sign bytes of the thread's chunks (chunk c covers group columns 8 * (c * team + lane) .. +8).
struct ChunkSigns {
    uint32_t bits[kChunks];
};

__device__ __forceinline__ ChunkSigns chunk_signs(int lane, int team) {
    ChunkSigns s;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) s.bits[c] = kSignBits.byte[c * team + lane];
    return s;
}

// v *= d (exact: a sign flip).
__device__ __forceinline__ void apply_signs(float (&v)[kChunks][8], const ChunkSigns& s) {
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
#pragma unroll
        for (int i = 0; i < 8; ++i) v[c][i] = __uint_as_float(__float_as_uint(v[c][i]) ^ (((s.bits[c] >> i) & 1u) << 31));
}

__device__ __forceinline__ void scale_all(float (&v)[kChunks][8], float scale) {
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
#pragma unroll
        for (int i = 0; i < 8; ++i) v[c][i] = f_mul(v[c][i], scale);
}

// Sylvester-Hadamard butterfly of the team's group, in place. Every thread of the block must call it (shuffles
// and barriers), inactive teams with zeros; `xchg` holds kValuesPerThread * kBlock floats.
__device__ __forceinline__ void butterfly(float (&v)[kChunks][8], int lane, int team_log2, float* xchg) {
#pragma unroll
    for (int h = 1; h < 8; h <<= 1)
#pragma unroll
        for (int c = 0; c < kChunks; ++c)
#pragma unroll
            for (int i = 0; i < 8; ++i)
                if ((i & h) == 0) {
                    const float a = v[c][i], b = v[c][i + h];
                    v[c][i] = f_add(a, b);
                    v[c][i + h] = f_sub(a, b);
                }
    const int team = 1 << team_log2;
    for (int k = 1; k < team; k <<= 1) {
        const bool lower = (lane & k) == 0;
        if (k < 32) {
#pragma unroll
            for (int c = 0; c < kChunks; ++c)
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const float other = __shfl_xor_sync(0xffffffffu, v[c][i], k);
                    v[c][i] = lower ? f_add(v[c][i], other) : f_sub(other, v[c][i]);
                }
        } else {
            __syncthreads();  // the previous exchange's readers are done with xchg
#pragma unroll
            for (int c = 0; c < kChunks; ++c)
#pragma unroll
                for (int i = 0; i < 8; ++i) xchg[(c * 8 + i) * kBlock + threadIdx.x] = v[c][i];
            __syncthreads();
            const int partner = threadIdx.x ^ k;  // teams are aligned: the partner is in the same team
#pragma unroll
            for (int c = 0; c < kChunks; ++c)
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const float other = xchg[(c * 8 + i) * kBlock + partner];
                    v[c][i] = lower ? f_add(v[c][i], other) : f_sub(other, v[c][i]);
                }
        }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float a = v[0][i], b = v[1][i];
        v[0][i] = f_add(a, b);
        v[1][i] = f_sub(a, b);
    }
}

// ------------------------------------------------------------------------------- compensate + quantize
// v: compensated values c of the thread's chunks (all zero for an inactive team); old: the old error.
// Quantizes the group to `data`/`scale`, then (EBits != 0) stores the updated error to `er`.
template <int Bits, int EBits>
__device__ __forceinline__ void quantize_group(float (&v)[kChunks][8], const OldError<EBits>& old, uint32_t key,
                                               bool active, int lane, int team, int team_log2, uint8_t* data,
                                               float* scale, const ErrorRow& er, float beta, float one_minus_beta,
                                               uint32_t* red) {
    key = team_max(key, team_log2, red);
    const Rule rule = make_rule(key, Q<Bits>::kMax);
    float qf[kChunks][8];
    quantize_chunks<kChunks>(v, rule, Q<Bits>::kMax, qf);
    if (active) {
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
            uint64_t word = 0;
#pragma unroll
            for (int i = 0; i < 8; ++i) word |= pack_value<Bits>(q_of(qf[c][i]), i);
            store_word<Bits>(data + (int64_t)(c * team + lane) * Bits, word);
        }
        if (lane == 0) __stcs(scale, rule.scale);
    }
    if (EBits == 0) return;
    uint32_t ekey = 0;
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            v[c][i] = update(old.at(c, i), residual(v[c][i], qf[c][i], rule.scale), beta, one_minus_beta);
            ekey = max(ekey, abs_key(v[c][i]));
        }
    ekey = team_max(ekey, team_log2, red);
    if (EBits == 32) {
        const bool finite = key_finite(ekey);
        if (!active) return;
        float* base = static_cast<float*>(er.values);
        const bool vec = aligned(base, 16);
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
            float* p = base + 8 * (c * team + lane);
            float o[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) o[i] = finite ? v[c][i] : 0.0f;
            if (vec) {
                reinterpret_cast<float4*>(p)[0] = make_float4(o[0], o[1], o[2], o[3]);
                reinterpret_cast<float4*>(p)[1] = make_float4(o[4], o[5], o[6], o[7]);
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) p[i] = o[i];
            }
        }
        return;
    }
    // int8 storage: the same quantizer with 8 bits; a non-finite group is stored as zero (scale 0, q 0).
    const Rule erule = make_rule(ekey, 127.0f);
    quantize_chunks<kChunks>(v, erule, 127.0f, qf);
    if (!active) return;
    int8_t* base = static_cast<int8_t*>(er.values);
    const bool vec = aligned(base, 8);
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
        uint32_t lo = 0, hi = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const uint32_t b = (uint32_t)q_of(qf[c][i]) & 0xffu;
            if (i < 4) lo |= b << (8 * i); else hi |= b << (8 * (i - 4));
        }
        int8_t* p = base + 8 * (c * team + lane);
        if (vec) {
            *reinterpret_cast<uint2*>(p) = make_uint2(lo, hi);
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) p[i] = (int8_t)((i < 4 ? lo : hi) >> (8 * (i & 3)));
        }
    }
    if (lane == 0) *er.scale = key_finite(ekey) ? erule.scale : 0.0f;
}

// c = v + e (when there is an error buffer), in place; returns the thread's absmax key of c.
template <int EBits>
__device__ __forceinline__ uint32_t compensate(float (&v)[kChunks][8], const OldError<EBits>& old) {
    uint32_t key = 0;
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            if (EBits != 0) v[c][i] = f_add(v[c][i], old.at(c, i));
            key = max(key, abs_key(v[c][i]));
        }
    return key;
}

// ------------------------------------------------------------------------------------------------ hop 1
struct Hop1Params {
    const void* grad;
    int64_t numel, part, cols, groups_per_row;
    int world, local, nodes, group_size, team_log2;
    float hadamard_scale;  // fp32(1 / sqrt(group_size))
    ErrorArgs err;
    float one_minus_beta;
    WireArgs out;
};

// Shared memory for the butterfly's cross-warp exchange: only kernels that rotate groups of more than 512
// (teams wider than a warp) use it, the others declare none.
template <bool Rotate>
struct Exchange {
    __device__ static float* get() { return nullptr; }
};

template <>
struct Exchange<true> {
    __device__ static float* get() {
        __shared__ float xchg[kValuesPerThread * kBlock];
        return xchg;
    }
};

template <int DT, int Bits, int EBits, bool Rotate>
__global__ void __launch_bounds__(kBlock) hop1_kernel(const Hop1Params p) {
    __shared__ uint32_t red[kBlock / 32];
    const int team = 1 << p.team_log2;
    const int lane = threadIdx.x & (team - 1);
    const int64_t group = (int64_t)blockIdx.x * (kBlock >> p.team_log2) + (threadIdx.x >> p.team_log2);
    const bool active = group < p.groups_per_row;
    const int64_t col0 = group * p.group_size;
    ChunkSigns signs{};
    if (Rotate) signs = chunk_signs(lane, team);
    for (int64_t slot = blockIdx.y; slot < p.world; slot += gridDim.y) {
        const int64_t row = (slot % p.nodes) * p.local + slot / p.nodes;  // slot d*M + n carries row n*L + d
        const int64_t row_start = row * p.part;
        const int64_t row_valid = max((int64_t)0, min(p.part, p.numel - row_start));
        const ErrorRow er = error_row<EBits>(p.err, slot, col0, group);
        float v[kChunks][8];
        OldError<EBits> old;
        uint32_t key = 0;
        if (active) {
            load_error(er, lane, team, old);
            const int64_t first = col0 + 8 * lane;                          // chunk 0's first column
            const int64_t last = col0 + 8 * ((kChunks - 1) * team + lane);  // last chunk's first column
            // chunks are 8 * team elements apart, a multiple of 16 bytes: chunk 0's alignment holds for all
            const bool fast = last + 8 <= row_valid &&
                              aligned(static_cast<const char*>(p.grad) + (row_start + first) * Grad<DT>::kSize, 16);
            if (fast) {
#pragma unroll
                for (int c = 0; c < kChunks; ++c) Grad<DT>::eight(p.grad, row_start + first + 8 * c * team, v[c]);
            } else {
#pragma unroll
                for (int c = 0; c < kChunks; ++c) {
                    const int64_t col = first + 8 * c * team;
#pragma unroll
                    for (int i = 0; i < 8; ++i)
                        v[c][i] = col + i < row_valid ? Grad<DT>::one(p.grad, row_start + col + i) : 0.0f;
                }
            }
            if (!Rotate) key = compensate(v, old);
        } else {
#pragma unroll
            for (int c = 0; c < kChunks; ++c)
#pragma unroll
                for (int i = 0; i < 8; ++i) v[c][i] = 0.0f;
            zero_error(old);
        }
        if (Rotate) {  // every thread, inactive teams with zeros: the butterfly exchanges across the team
            apply_signs(v, signs);
            butterfly(v, lane, p.team_log2, Exchange<Rotate>::get());
            scale_all(v, p.hadamard_scale);
            key = compensate(v, old);
        }
        uint8_t* data = p.out.data + slot * p.out.data_stride + (col0 >> 3) * Bits;
        float* scale = p.out.scale + slot * p.out.scale_stride + group;
        quantize_group<Bits, EBits>(v, old, key, active, lane, team, p.team_log2, data, scale, er, p.err.beta,
                                    p.one_minus_beta, red);
    }
}

// ------------------------------------------------------------------------------------------------ hop 2
struct Hop2Params {
    WireArgs in;
    int64_t cols, groups_per_row;
    int local, nodes, group_size, team_log2;
    ErrorArgs err;
    float one_minus_beta;
    WireArgs out;
};

constexpr int kBlocksPerBatch = 4;  // received blocks whose loads are issued together

// v = sum over the `local` received blocks of dequant(block), in block order (fp32), for row m of the output.
// Loads of kBlocksPerBatch blocks are issued before any of them is used.
template <int InBits>
__device__ __forceinline__ void sum_blocks(const WireArgs& in, int local, int nodes, int64_t m, int64_t group,
                                           int64_t col0, int lane, int team, float (&v)[kChunks][8]) {
    const int64_t byte0 = (col0 >> 3) * InBits;
    for (int b0 = 0; b0 < local; b0 += kBlocksPerBatch) {
        uint64_t w[kBlocksPerBatch][kChunks];
        float s[kBlocksPerBatch];
#pragma unroll
        for (int j = 0; j < kBlocksPerBatch; ++j) {
            if (b0 + j < local) {
                const int64_t row = (int64_t)(b0 + j) * nodes + m;
                const uint8_t* data = in.data + row * in.data_stride + byte0;
                s[j] = in.scale[row * in.scale_stride + group];
#pragma unroll
                for (int c = 0; c < kChunks; ++c) w[j][c] = load_word<InBits>(data + (int64_t)(c * team + lane) * InBits);
            }
        }
#pragma unroll
        for (int j = 0; j < kBlocksPerBatch; ++j) {
            if (b0 + j < local) {
#pragma unroll
                for (int c = 0; c < kChunks; ++c)
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        const float d = f_mul((float)unpack_value<InBits>(w[j][c], i), s[j]);
                        v[c][i] = b0 + j == 0 ? d : f_add(v[c][i], d);
                    }
            }
        }
    }
}

template <int Bits, int EBits>
__global__ void __launch_bounds__(kBlock) hop2_kernel(const Hop2Params p) {
    __shared__ uint32_t red[kBlock / 32];
    const int team = 1 << p.team_log2;
    const int lane = threadIdx.x & (team - 1);
    const int64_t group = (int64_t)blockIdx.x * (kBlock >> p.team_log2) + (threadIdx.x >> p.team_log2);
    const bool active = group < p.groups_per_row;
    const int64_t col0 = group * p.group_size;
    for (int64_t m = blockIdx.y; m < p.nodes; m += gridDim.y) {
        const ErrorRow er = error_row<EBits>(p.err, m, col0, group);
        float v[kChunks][8];
        OldError<EBits> old;
        uint32_t key = 0;
        if (active) {
            load_error(er, lane, team, old);
            switch (p.in.bits) {
                case 2: sum_blocks<2>(p.in, p.local, p.nodes, m, group, col0, lane, team, v); break;
                case 3: sum_blocks<3>(p.in, p.local, p.nodes, m, group, col0, lane, team, v); break;
                case 4: sum_blocks<4>(p.in, p.local, p.nodes, m, group, col0, lane, team, v); break;
                default: sum_blocks<8>(p.in, p.local, p.nodes, m, group, col0, lane, team, v); break;
            }
            key = compensate(v, old);
        } else {
#pragma unroll
            for (int c = 0; c < kChunks; ++c)
#pragma unroll
                for (int i = 0; i < 8; ++i) v[c][i] = 0.0f;
            zero_error(old);
        }
        uint8_t* data = p.out.data + m * p.out.data_stride + (col0 >> 3) * Bits;
        float* scale = p.out.scale + m * p.out.scale_stride + group;
        quantize_group<Bits, EBits>(v, old, key, active, lane, team, p.team_log2, data, scale, er, p.err.beta,
                                    p.one_minus_beta, red);
    }
}

// ------------------------------------------------------------------------------------------------ final
struct FinalParams {
    WireArgs in;
    int64_t part, valid, chunks;
    int rows, group_log2;
    float world;
    void* out;
};

template <int OutDT>
__device__ __forceinline__ void store_out(void* out, int64_t col, int64_t count, const float (&x)[8]) {
    if constexpr (OutDT == kFloat32) {
        float* p = static_cast<float*>(out) + col;
        if (count >= 8 && aligned(p, 16)) {
            __stcs(reinterpret_cast<float4*>(p), make_float4(x[0], x[1], x[2], x[3]));
            __stcs(reinterpret_cast<float4*>(p) + 1, make_float4(x[4], x[5], x[6], x[7]));
        } else {
            for (int i = 0; i < 8 && i < count; ++i) p[i] = x[i];
        }
    } else {
        unsigned short h[8];
#pragma unroll
        for (int i = 0; i < 8; ++i)
            h[i] = OutDT == kFloat16 ? __half_as_ushort(__float2half_rn(x[i])) : float_to_bf16_bits(x[i]);
        unsigned short* p = static_cast<unsigned short*>(out) + col;
        if (count >= 8 && aligned(p, 16)) {
            __stcs(reinterpret_cast<uint4*>(p),
                   make_uint4(h[0] | ((uint32_t)h[1] << 16), h[2] | ((uint32_t)h[3] << 16),
                              h[4] | ((uint32_t)h[5] << 16), h[6] | ((uint32_t)h[7] << 16)));
        } else {
            for (int i = 0; i < 8 && i < count; ++i) p[i] = h[i];
        }
    }
}

constexpr int kFinalChunks = 4;  // chunks of 8 output columns per thread (kBlock apart: coalesced)

template <int Bits, int OutDT>
__global__ void __launch_bounds__(kBlock) final_kernel(const FinalParams p) {
    const int64_t stride = (int64_t)gridDim.x * kBlock * kFinalChunks;
    for (int64_t base = (int64_t)blockIdx.x * kBlock * kFinalChunks + threadIdx.x; base < p.chunks; base += stride) {
        float total[kFinalChunks][8];
        for (int r = 0; r < p.rows; ++r) {
            uint64_t w[kFinalChunks];
            float s[kFinalChunks];
            const uint8_t* row = p.in.data + r * p.in.data_stride;
            const float* scales = p.in.scale + r * p.in.scale_stride;
#pragma unroll
            for (int k = 0; k < kFinalChunks; ++k) {
                const int64_t chunk = base + (int64_t)k * kBlock;
                if (chunk < p.chunks) {
                    w[k] = load_word<Bits>(row + chunk * Bits);
                    s[k] = scales[(chunk * 8) >> p.group_log2];
                }
            }
#pragma unroll
            for (int k = 0; k < kFinalChunks; ++k) {
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const float d = f_mul((float)unpack_value<Bits>(w[k], i), s[k]);
                    total[k][i] = r == 0 ? d : f_add(total[k][i], d);
                }
            }
        }
#pragma unroll
        for (int k = 0; k < kFinalChunks; ++k) {
            const int64_t chunk = base + (int64_t)k * kBlock;
            if (chunk >= p.chunks) continue;
            const int64_t col = chunk * 8;
#pragma unroll
            for (int i = 0; i < 8; ++i) total[k][i] = col + i < p.valid ? f_div(total[k][i], p.world) : 0.0f;
            store_out<OutDT>(p.out, col, p.part - col, total[k]);
        }
    }
}

// With Hadamard rotation: the same sum, then each group rotated back, on the team layout of the hops (a group per
// team of group_size / 16 threads), since the inverse butterfly needs a whole group.
struct FinalRotatedParams {
    WireArgs in;
    int64_t part, valid, groups_per_row;
    int rows, group_size, team_log2;
    float world, hadamard_scale;
    void* out;
};

template <int Bits, int OutDT>
__global__ void __launch_bounds__(kBlock) final_rotated_kernel(const FinalRotatedParams p) {
    const int team = 1 << p.team_log2;
    const int lane = threadIdx.x & (team - 1);
    const int64_t group = (int64_t)blockIdx.x * (kBlock >> p.team_log2) + (threadIdx.x >> p.team_log2);
    const bool active = group < p.groups_per_row;
    const int64_t col0 = group * p.group_size;
    float v[kChunks][8];
#pragma unroll
    for (int c = 0; c < kChunks; ++c)
#pragma unroll
        for (int i = 0; i < 8; ++i) v[c][i] = 0.0f;
    if (active) {
        for (int r = 0; r < p.rows; ++r) {
            const uint8_t* data = p.in.data + r * p.in.data_stride + (col0 >> 3) * Bits;
            const float s = p.in.scale[r * p.in.scale_stride + group];
#pragma unroll
            for (int c = 0; c < kChunks; ++c) {
                const uint64_t w = load_word<Bits>(data + (int64_t)(c * team + lane) * Bits);
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const float d = f_mul((float)unpack_value<Bits>(w, i), s);
                    v[c][i] = r == 0 ? d : f_add(v[c][i], d);
                }
            }
        }
    }
    butterfly(v, lane, p.team_log2, Exchange<true>::get());
    scale_all(v, p.hadamard_scale);
    apply_signs(v, chunk_signs(lane, team));
    if (!active) return;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
        const int64_t col = col0 + 8 * (c * team + lane);
        if (col >= p.part) continue;
#pragma unroll
        for (int i = 0; i < 8; ++i) v[c][i] = col + i < p.valid ? f_div(v[c][i], p.world) : 0.0f;
        store_out<OutDT>(p.out, col, p.part - col, v[c]);
    }
}

// ------------------------------------------------------------------------------------------- launching
template <typename F>
bool with_bits(int bits, F&& f) {
    switch (bits) {
        case 2: f(std::integral_constant<int, 2>{}); return true;
        case 3: f(std::integral_constant<int, 3>{}); return true;
        case 4: f(std::integral_constant<int, 4>{}); return true;
        case 8: f(std::integral_constant<int, 8>{}); return true;
        default: return false;
    }
}

template <typename F>
bool with_error_bits(int bits, F&& f) {
    switch (bits) {
        case 0: f(std::integral_constant<int, 0>{}); return true;
        case 8: f(std::integral_constant<int, 8>{}); return true;
        case 32: f(std::integral_constant<int, 32>{}); return true;
        default: return false;
    }
}

template <typename F>
bool with_dtype(int dtype, F&& f) {
    switch (dtype) {
        case kFloat32: f(std::integral_constant<int, kFloat32>{}); return true;
        case kFloat16: f(std::integral_constant<int, kFloat16>{}); return true;
        case kBFloat16: f(std::integral_constant<int, kBFloat16>{}); return true;
        default: return false;
    }
}

int log2_exact(int64_t v) {
    int l = 0;
    while ((int64_t)1 << l < v) ++l;
    return ((int64_t)1 << l) == v ? l : -1;
}

const char* check_group_size(int group_size) {
    if (group_size < kMinGroup || group_size > kMaxGroup || log2_exact(group_size) < 0)
        return "LoCo kernels: group_size must be a power of two from 32 to 4096";
    return nullptr;
}

bool valid_bits(int bits) { return bits == 2 || bits == 3 || bits == 4 || bits == 8; }

const char* check_error(const ErrorArgs& err) {
    if (err.bits != 0 && err.bits != 8 && err.bits != 32) return "LoCo kernels: error bits must be 0, 8 or 32";
    if (err.bits != 0 && err.values == nullptr) return "LoCo kernels: error values pointer is null";
    if (err.bits == 8 && err.scale == nullptr) return "LoCo kernels: int8 error without scales";
    if (!(err.beta >= 0.0f && err.beta < 1.0f)) return "LoCo kernels: beta must satisfy 0 <= beta < 1";
    return nullptr;
}

const char* launched() {
    const cudaError_t status = cudaGetLastError();
    return status == cudaSuccess ? nullptr : cudaGetErrorString(status);
}

// Grid over (column groups, rows): teams of group_size / 16 threads, kBlock / team groups per block.
const char* group_grid(int64_t groups_per_row, int64_t rows, int group_size, dim3* grid, int* team_log2) {
    *team_log2 = log2_exact(group_size / kValuesPerThread);
    const int64_t per_block = kBlock >> *team_log2;
    const int64_t blocks = (groups_per_row + per_block - 1) / per_block;
    if (blocks > 0x7fffffffLL) return "LoCo kernels: too many groups per row for one launch";
    *grid = dim3((unsigned)blocks, (unsigned)(rows < kMaxGridY ? rows : kMaxGridY), 1);
    return nullptr;
}

// fp32(1 / sqrt(group_size)), rounded like the reference (double, then fp32).
float hadamard_scale(int group_size) { return (float)(1.0 / sqrt((double)group_size)); }

const char* final_rotated(WireArgs in, int rows, int64_t cols, int group_size, int world, int64_t part,
                          int64_t valid, void* out, int out_dtype, cudaStream_t stream) {
    FinalRotatedParams p{in, part, valid, cols / group_size, rows, group_size, 0, (float)world,
                         hadamard_scale(group_size), out};
    dim3 grid;
    if (const char* m = group_grid(p.groups_per_row, 1, group_size, &grid, &p.team_log2)) return m;
    bool ok = with_dtype(out_dtype, [&](auto dt) {
        with_bits(in.bits, [&](auto bits) {
            final_rotated_kernel<decltype(bits)::value, decltype(dt)::value><<<grid, kBlock, 0, stream>>>(p);
        });
    });
    if (!ok) return "LoCo kernels: output dtype must be float32, float16 or bfloat16";
    return launched();
}

}  // namespace

const char* hop1(const void* grad, int grad_dtype, int64_t numel, int world, int local, int64_t part, int64_t cols,
                 int group_size, bool hadamard, ErrorArgs err, WireArgs out, cudaStream_t stream) {
    if (const char* m = check_group_size(group_size)) return m;
    if (const char* m = check_error(err)) return m;
    if (!valid_bits(out.bits)) return "LoCo kernels: gradient bits must be 2, 3, 4 or 8";
    if (world < 1 || local < 1 || world % local != 0) return "LoCo kernels: world must be a positive multiple of local";
    if (numel < 0 || part < 0 || part * (int64_t)world < numel) return "LoCo kernels: part must be ceil(numel / world)";
    if (cols < part || cols % group_size != 0) return "LoCo kernels: cols must be part rounded up to the group size";
    if (cols == 0) return nullptr;
    Hop1Params p{grad, numel, part, cols, cols / group_size, world, local, world / local, group_size, 0,
                 hadamard_scale(group_size), err, math::f_sub(1.0f, err.beta), out};
    dim3 grid;
    if (const char* m = group_grid(p.groups_per_row, world, group_size, &grid, &p.team_log2)) return m;
    bool ok = with_dtype(grad_dtype, [&](auto dt) {
        with_bits(out.bits, [&](auto bits) {
            with_error_bits(err.bits, [&](auto ebits) {
                if (hadamard)
                    hop1_kernel<decltype(dt)::value, decltype(bits)::value, decltype(ebits)::value, true>
                        <<<grid, kBlock, 0, stream>>>(p);
                else
                    hop1_kernel<decltype(dt)::value, decltype(bits)::value, decltype(ebits)::value, false>
                        <<<grid, kBlock, 0, stream>>>(p);
            });
        });
    });
    if (!ok) return "LoCo kernels: gradient dtype must be float32, float16 or bfloat16";
    return launched();
}

const char* hop2(WireArgs in, int local, int nodes, int64_t cols, int group_size, ErrorArgs err, WireArgs out,
                 cudaStream_t stream) {
    if (const char* m = check_group_size(group_size)) return m;
    if (const char* m = check_error(err)) return m;
    if (!valid_bits(out.bits) || !valid_bits(in.bits)) return "LoCo kernels: gradient bits must be 2, 3, 4 or 8";
    if (local < 1 || nodes < 1) return "LoCo kernels: local and nodes must be positive";
    if (cols < 0 || cols % group_size != 0) return "LoCo kernels: cols must be a multiple of the group size";
    if (cols == 0) return nullptr;
    Hop2Params p{in, cols, cols / group_size, local, nodes, group_size, 0, err, math::f_sub(1.0f, err.beta), out};
    dim3 grid;
    if (const char* m = group_grid(p.groups_per_row, nodes, group_size, &grid, &p.team_log2)) return m;
    with_bits(out.bits, [&](auto bits) {
        with_error_bits(err.bits, [&](auto ebits) {
            hop2_kernel<decltype(bits)::value, decltype(ebits)::value><<<grid, kBlock, 0, stream>>>(p);
        });
    });
    return launched();
}

const char* final_mean(WireArgs in, int rows, int64_t cols, int group_size, bool hadamard, int world, int64_t part,
                       int64_t valid, void* out, int out_dtype, cudaStream_t stream) {
    if (const char* m = check_group_size(group_size)) return m;
    if (!valid_bits(in.bits)) return "LoCo kernels: gradient bits must be 2, 3, 4 or 8";
    if (rows < 1 || world < 1) return "LoCo kernels: rows and world must be positive";
    if (part < 0 || cols < part || cols % group_size != 0) return "LoCo kernels: cols must be part rounded up";
    if (valid < 0 || valid > part) return "LoCo kernels: valid must be in [0, part]";
    if (part == 0) return nullptr;
    if (hadamard) return final_rotated(in, rows, cols, group_size, world, part, valid, out, out_dtype, stream);
    FinalParams p{in, part, valid, (part + 7) / 8, rows, log2_exact(group_size), (float)world, out};
    const int64_t per_block = (int64_t)kBlock * kFinalChunks;
    const int64_t blocks_needed = (p.chunks + per_block - 1) / per_block;
    const unsigned blocks = (unsigned)(blocks_needed < (1LL << 30) ? blocks_needed : (1LL << 30));
    bool ok = with_dtype(out_dtype, [&](auto dt) {
        with_bits(in.bits, [&](auto bits) {
            final_kernel<decltype(bits)::value, decltype(dt)::value><<<blocks, kBlock, 0, stream>>>(p);
        });
    });
    if (!ok) return "LoCo kernels: output dtype must be float32, float16 or bfloat16";
    return launched();
}

}  // namespace loco
