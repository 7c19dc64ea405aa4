// LoCo fused CUDA kernels, one launch per hop per bucket: hop 1 (partition + swizzle + [rotate +] compensate +
// quantize + error update + pack), hop 2 (dequantize-sum the received blocks + compensate + quantize + error update
// + pack) and the final dequantize-sum-[unrotate-]mean. No torch header: the binding (loco_binding.cpp) builds the
// bucket's parameter table on the device and calls the launchers below. Compiled twice: as itself (the kernels
// without an exact own block, the public launchers, the shared sample) and, with LOCO_OWN_KERNELS, as
// loco_kernels_own.cu (the kernels that keep one).
//
// Work split (README.md beside this file): one 1-D grid over every (row, group) pair of every parameter of a bucket; a block
// of kBlock threads belongs to one parameter (found by one thread per table item, item_of_block) and covers
// kBlock / team consecutive pairs of it in row-major order (so parameters with few groups per row fill blocks too).
// Each quantization group of S elements is handled by a team of S / (8 * C) threads (1 .. 256), each thread
// holding C chunks (chunks_of: 2 or 4) of 8 consecutive values in registers (chunk c of lane l covers columns
// 8 * (c * team + l) .. +8 of the group, so a warp's loads are contiguous). Two team reductions per group (absmax
// of c, absmax of the new error) use warp shuffles (team <= 32) or shared memory (team > 32). Every input byte is
// read once and every output byte written once; there is no temporary in device memory. All offsets are 64-bit.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <math.h>

#include <type_traits>

#include "loco_kernels.cuh"
#include "loco_limits.h"

#if defined(__USE_FAST_MATH__)
#error "loco_kernels.cu must be built without --use_fast_math (the reference fixes IEEE fp32 arithmetic)"
#endif

namespace loco {
namespace {

using namespace math;

constexpr int kMaxGroup = 4096;

// Resident blocks per SM that the kernels with 2 chunks per thread ask the compiler to allow, which caps their
// registers at 65536 / (kBlock * LOCO_MIN_BLOCKS) (4: 64 registers, half the SM's threads). A build option for tuning.
#if !defined(LOCO_MIN_BLOCKS)
#define LOCO_MIN_BLOCKS 4
#endif

// Chunks of 8 values per thread: kernels that rotate keep 2 (the butterfly's last stage pairs a thread's two
// chunks), and so does the final mean (measured: 4 chunks spill there and ran 7% slower); hop 1 and hop 2 take
// LOCO_PLAIN_CHUNKS without an error buffer and LOCO_ERROR_CHUNKS with one (both default 4: the per-thread set-up,
// 150-250 instructions, is spread over 32 values; with an int8 error 4 chunks ran hop 1 8% and hop 2 7% faster than
// 2 on the H200, 4/4 bits). Kernels with 4 chunks ask for LOCO_WIDE_MIN_BLOCKS resident blocks (default 3: 80
// registers). Build options for tuning.
#if !defined(LOCO_PLAIN_CHUNKS)
#define LOCO_PLAIN_CHUNKS 4
#endif
#if !defined(LOCO_ERROR_CHUNKS)
#define LOCO_ERROR_CHUNKS 4
#endif
#if !defined(LOCO_WIDE_MIN_BLOCKS)
#define LOCO_WIDE_MIN_BLOCKS 3
#endif
static_assert((LOCO_PLAIN_CHUNKS == 2 || LOCO_PLAIN_CHUNKS == 4) && (LOCO_ERROR_CHUNKS == 2 || LOCO_ERROR_CHUNKS == 4),
              "chunks per thread: 2 or 4 (a group of 32 values is one thread's 4 chunks)");
constexpr int kRotateChunks = 2;
// Chunks per thread of the final mean without rotation (default 2; 4 spilled and ran 7% slower when the mean divided
// value by value; ptxas now: 4 chunks spill 344-536 bytes at 64 registers, need 92-117 uncapped, so time them with
// LOCO_FINAL_MIN_BLOCKS=2). A build option.
#if !defined(LOCO_FINAL_CHUNKS)
#define LOCO_FINAL_CHUNKS 2
#endif
static_assert(LOCO_FINAL_CHUNKS == 2 || LOCO_FINAL_CHUNKS == 4, "final mean: 2 or 4 chunks per thread");

// The limits of loco_limits.h are what the kernels are compiled for: every group fills whole teams of at least one
// thread and at most one block, and with_bits (below) has a case for every wire width; with_error_storage and
// with_rounding have one for every enumerator of loco_formats.h (the compiler's -Wswitch names a missing one).
static_assert(limits::kMinGroupSize >= 8 * 4 && (limits::kMinGroupSize & (limits::kMinGroupSize - 1)) == 0,
              "the smallest group is one thread's 4 chunks of 8 values");
static_assert(limits::kMaxGroupSize / (8 * kRotateChunks) <= kBlock, "the largest group's team fits in one block");
// The sizes indexed in 32 bits: a parameter's pairs and a block's overhang (locate_pair), a launch's blocks (at most
// one per pair: a block covers kBlock * 8 * chunks / group_size >= 1 pairs).
static_assert(limits::kMaxParameterPairs == 0x7fffffff - kBlock,
              "a parameter's pairs and a block's overhang: 2^31 - 1");
static_assert(limits::kMaxLaunchPairs == 0x7fffffff && kBlock * 8 * kRotateChunks >= limits::kMaxGroupSize,
              "a launch's blocks, at most its pairs: 2^31 - 1");
constexpr bool compiled_bits(int bits) { return bits == 2 || bits == 3 || bits == 4 || bits == 8; }
template <size_t N>
constexpr bool all_of(const int (&values)[N], bool (*test)(int)) {
    for (size_t i = 0; i < N; ++i)
        if (!test(values[i])) return false;
    return true;
}
static_assert(all_of(limits::kWireBits, compiled_bits), "with_bits must dispatch every wire bit width of the limits");

constexpr int chunks_of(Kernel kernel, bool rotate, ErrorStorage storage) {
    if (rotate) return kRotateChunks;
    if (kernel == kFinalKernel) return LOCO_FINAL_CHUNKS;
    return storage == ErrorStorage::kNone ? LOCO_PLAIN_CHUNKS : LOCO_ERROR_CHUNKS;
}

constexpr int min_blocks(int chunks) { return chunks > 2 ? LOCO_WIDE_MIN_BLOCKS : LOCO_MIN_BLOCKS; }

// Groups each team of hop 1 and hop 2 without rotation takes in turn (default 1). With G > 1 a block covers G times
// the pairs, in G steps of kBlock / team consecutive pairs (each step as coalesced as one block of G = 1), and the
// block's parameter lookup and launch set-up are paid once per G groups: a build option to time the set-up's share
// (README.md beside this file, "What limits each kernel").
#if !defined(LOCO_HOP_GROUPS)
#define LOCO_HOP_GROUPS 1
#endif
static_assert(LOCO_HOP_GROUPS >= 1 && LOCO_HOP_GROUPS <= 8, "LOCO_HOP_GROUPS: 1 to 8 groups per team");

constexpr int groups_of(Kernel kernel, bool rotate) {
    return rotate || kernel == kFinalKernel ? 1 : LOCO_HOP_GROUPS;
}

// Resident blocks per SM the final mean asks for (default LOCO_MIN_BLOCKS: 64 registers; it uses 54-56, so 4 blocks
// of 256 threads, half the SM's threads). The final mean has little work per thread (2 received rows of 16 values)
// and waits on two dependent loads (its table entry, then the received words), so more resident warps may hide more
// latency: a build option for tuning (ptxas, sm_90: 5 blocks give 48 registers, 6 give 40 with 12-64 bytes of
// spills, 8 give 32 with 200-380 bytes).
#if !defined(LOCO_FINAL_MIN_BLOCKS)
#define LOCO_FINAL_MIN_BLOCKS LOCO_MIN_BLOCKS
#endif

__device__ __forceinline__ bool aligned(const void* p, uintptr_t bytes) {
    return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

template <Rounding R>
using RoundingConstant = std::integral_constant<Rounding, R>;

// Runs f(RoundingConstant<r>{}): the launch's grid as a template argument (uniform per launch; every rounding's path
// is compiled into each kernel, so grids double no kernel).
template <typename F>
__device__ __forceinline__ void with_rounding(Rounding r, F&& f) {
    switch (r) {
        case Rounding::kNearestEven: f(RoundingConstant<Rounding::kNearestEven>{}); break;
        case Rounding::kFloor: f(RoundingConstant<Rounding::kFloor>{}); break;
    }
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
// A packed word of 8 codes at p. The binding keeps wire data 4-byte aligned with row strides of 4k bytes and a
// parameter's columns start at a multiple of the group size, so a word of 2 or 4 bytes is aligned and an 8-byte word
// is 4-byte aligned (two 32-bit accesses); 3-byte words go byte by byte.
template <int Bits>
__device__ __forceinline__ uint64_t load_word(const uint8_t* p) {
    if (Bits == 8) {
        const uint32_t* w = reinterpret_cast<const uint32_t*>(p);
        return (uint64_t)w[0] | ((uint64_t)w[1] << 32);
    }
    if (Bits == 4) return *reinterpret_cast<const uint32_t*>(p);
    if (Bits == 2) return *reinterpret_cast<const unsigned short*>(p);
    uint64_t w = 0;
#pragma unroll
    for (int b = 0; b < Bits; ++b) w |= (uint64_t)p[b] << (8 * b);
    return w;
}

template <int Bits>
__device__ __forceinline__ void store_word(uint8_t* p, uint64_t w) {
    if (Bits == 8) {
        __stcs(reinterpret_cast<unsigned int*>(p), (unsigned int)w);
        __stcs(reinterpret_cast<unsigned int*>(p) + 1, (unsigned int)(w >> 32));
    } else if (Bits == 4) {
        __stcs(reinterpret_cast<unsigned int*>(p), (unsigned int)w);
    } else if (Bits == 2) {
        __stcs(reinterpret_cast<unsigned short*>(p), (unsigned short)w);
    } else {
#pragma unroll
        for (int b = 0; b < Bits; ++b) p[b] = (uint8_t)(w >> (8 * b));
    }
}


// ------------------------------------------------------------------------------------------- launch and block
// The kernel parameters of every launch (hop 1, hop 2, final).
struct Launch {
    const BucketItem* items;
    int count;
    int team_log2, group_log2;
    int world, local, nodes, rows;  // rows: received rows the final mean sums
    int in_blocks;                  // hop 2: blocks of the previous hop summed (rows j * nodes + m of `in`)
    FastDivisor nodes_divisor;
    int item_rows;                  // rows of every parameter in this launch (hop 1: world, hop 2: nodes, final: 1)
    Rounding rounding;              // the wire grid's (both wires of hop 2 have the same grid)
    float beta, one_minus_beta, hadamard_scale;
    bool world_pow2;      // world is a power of two: the final mean multiplies by inv_world = 1 / world (exact)
    float inv_world;
    Levels levels;        // the output wire's grid (the input wire has the same grid, with its own bits)
    Levels error_levels;  // a scaled error buffer's: 8 or 4 bits, nearest-even (qmax 127 or 7)
    uint32_t magic_bits;  // math::kRoundMagicBits (see OldError<ErrorStorage::kInt8, C>)
    WireArgs in, out;
    float* stats;         // measured launches: N fp32 partial sums per block (N: 2 for the hops, 1 for the final mean)
    OwnBlock own;         // the exact own block (loco_kernels.cuh), read only by the kernels compiled with Own
};

// Where a team works: its block's parameter, and its own row and group of that parameter.
struct Block {
    const BucketItem* item;
    int64_t row, group, col0;  // group and its first column within the parameter
    int lane, team;
    bool active;               // the team's (row, group) pair exists (the last block of a parameter may be partly empty)
};

// The block's parameter: the last item whose first_block <= blockIdx.x. Up to kBlock items, every thread tests one
// item at once (one load's latency instead of a chain of log2(count) dependent loads, which dominates the short
// kernels of a bucket of small tensors); larger tables take a binary search. Called by every thread of the block.
__device__ __forceinline__ int item_of_block(const Launch& p) {
    const int64_t b = blockIdx.x;
    if (p.count == 1) return 0;
    if (p.count <= kBlock) {
        __shared__ int found;
        const int t = threadIdx.x;
        if (t < p.count && p.items[t].first_block <= b && (t + 1 == p.count || p.items[t + 1].first_block > b))
            found = t;
        __syncthreads();
        return found;
    }
    int lo = 0, hi = p.count - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (p.items[mid].first_block <= b) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// The team's pair of step `step` of `steps` (groups_of) in the block of parameter `item`.
__device__ __forceinline__ Block locate_pair(const Launch& p, const BucketItem* item, int step, int steps) {
    Block k;
    k.item = item;
    k.team = 1 << p.team_log2;
    k.lane = threadIdx.x & (k.team - 1);
    // a parameter has fewer than 2^31 (row, group) pairs (checked by the binding): 32-bit index arithmetic, the
    // division by the groups per row a multiply-high (FastDivisor)
    const uint32_t pair =
        ((uint32_t)((int64_t)blockIdx.x - k.item->first_block) * (uint32_t)steps + (uint32_t)step) *
            (uint32_t)(kBlock >> p.team_log2) +
        (uint32_t)(threadIdx.x >> p.team_log2);
    const uint32_t row = divide(pair, k.item->groups);
    k.row = row;
    k.group = pair - row * k.item->groups.d;
    k.active = row < (uint32_t)p.item_rows;
    k.col0 = k.group << p.group_log2;
    return k;
}

__device__ __forceinline__ Block locate(const Launch& p) { return locate_pair(p, p.items + item_of_block(p), 0, 1); }

// This block's group in the bucket's wire rows: packed values of row `row` and the group's scale.
template <int Bits>
__device__ __forceinline__ uint8_t* wire_data(const WireArgs& w, int64_t row, const Block& k) {
    return w.data + row * w.data_stride + ((k.item->col + k.col0) >> 3) * Bits;
}

__device__ __forceinline__ float* wire_scale(const WireArgs& w, int64_t row, const Block& k, int group_log2) {
    return w.scale + row * w.scale_stride + ((k.item->col + k.col0) >> group_log2);
}


// ------------------------------------------------------------------------------------------ error buffer
// Where one row of an error buffer and its scale for the current group live.
struct ErrorRow {
    void* values;  // at the group's first column
    float* scale;  // the group's scale (int8 storage)
};

template <ErrorStorage E>
__device__ __forceinline__ ErrorRow error_row(const Block& k, int64_t row) {
    ErrorRow r{nullptr, nullptr};
    const BucketItem& it = *k.item;
    if (E == ErrorStorage::kInt8 || E == ErrorStorage::kInt4) {  // int4: two codes a byte
        r.values = static_cast<uint8_t*>(it.err_values) + row * it.err_stride + k.col0 / storage_format(E).per_element;
        r.scale = it.err_scale + row * it.err_scale_stride + k.group;
    } else if (E == ErrorStorage::kFp32) {
        r.values = static_cast<float*>(it.err_values) + row * it.err_stride + k.col0;
    }
    return r;
}

// The stored error of the thread's chunks as loaded: int8 keeps the raw bytes and the group's scale (decoded
// when used, which saves registers), fp32 keeps the values, none is zero.
template <ErrorStorage E, int C>
struct OldError {
    __device__ void bind(const Launch&) {}
    __device__ float at(int, int) const { return 0.0f; }
};

template <int C>
struct OldError<ErrorStorage::kInt8, C> {
    uint2 raw[C];  // the int8 codes with their sign bits flipped (see math::code_value)
    float scale;
    // kRoundMagicBits as read from the launch: a value the compiler cannot see keeps the byte permutes' selectors
    // immediate (with both operands constant it put the selectors in registers and re-made them before each use)
    uint32_t magic_bits;
    __device__ void bind(const Launch& p) { magic_bits = p.magic_bits; }
    __device__ float at(int c, int i) const {
        return f_mul(code_value<8, Rounding::kNearestEven>(((uint64_t)raw[c].y << 32) | raw[c].x, i, magic_bits),
                     scale);
    }
};

template <int C>
struct OldError<ErrorStorage::kInt4, C> {
    uint32_t raw[C];  // the 4-bit codes of a chunk with their sign bits flipped (see math::code_value)
    float scale;
    uint32_t magic_bits;  // as in OldError<ErrorStorage::kInt8, C>
    __device__ void bind(const Launch& p) { magic_bits = p.magic_bits; }
    __device__ float at(int c, int i) const {
        return f_mul(code_value<4, Rounding::kNearestEven>(raw[c], i, magic_bits), scale);
    }
};

template <int C>
struct OldError<ErrorStorage::kFp32, C> {
    float e[C][8];
    __device__ void bind(const Launch&) {}
    __device__ float at(int c, int i) const { return e[c][i]; }
};

// Loads the error of the chunks of lane `lane` (chunk c starts 8 * (c * team + lane) columns into the group).
template <int C>
__device__ __forceinline__ void load_error(const ErrorRow&, int, int, OldError<ErrorStorage::kNone, C>&) {}

// The binding keeps error rows 16-byte aligned: every chunk is one vector access.
template <int C>
__device__ __forceinline__ void load_error(const ErrorRow& r, int lane, int team,
                                           OldError<ErrorStorage::kInt8, C>& out) {
    out.scale = *r.scale;
    const int8_t* base = static_cast<const int8_t*>(r.values);
#pragma unroll
    for (int c = 0; c < C; ++c) {
        const uint2 raw = *reinterpret_cast<const uint2*>(base + 8 * (c * team + lane));
        out.raw[c] = make_uint2(raw.x ^ 0x80808080u, raw.y ^ 0x80808080u);
    }
}

// int4: a chunk's 8 codes are one 4-byte word (error rows 16-byte aligned, chunks 4 * team bytes apart).
template <int C>
__device__ __forceinline__ void load_error(const ErrorRow& r, int lane, int team,
                                           OldError<ErrorStorage::kInt4, C>& out) {
    out.scale = *r.scale;
    const uint32_t* base = static_cast<const uint32_t*>(r.values);
#pragma unroll
    for (int c = 0; c < C; ++c) out.raw[c] = base[c * team + lane] ^ 0x88888888u;
}

template <int C>
__device__ __forceinline__ void load_error(const ErrorRow& r, int lane, int team,
                                           OldError<ErrorStorage::kFp32, C>& out) {
    const float* base = static_cast<const float*>(r.values);
#pragma unroll
    for (int c = 0; c < C; ++c) {
        const float4* p = reinterpret_cast<const float4*>(base + 8 * (c * team + lane));
        const float4 a = p[0], b = p[1];
        out.e[c][0] = a.x; out.e[c][1] = a.y; out.e[c][2] = a.z; out.e[c][3] = a.w;
        out.e[c][4] = b.x; out.e[c][5] = b.y; out.e[c][6] = b.z; out.e[c][7] = b.w;
    }
}

// beta * e of the thread's chunks, taken when the error is read (so int8 codes are decoded once); none without error.
// LOCO_RECOMPUTE_DECAYED (a build option for tuning): int8 and int4 storage keep the loaded codes instead and decode
// them again when the update needs beta * e, by the same operations (so the same bits): three more instructions a
// value, and 32 fewer values live across the team reductions (README.md beside this file, "What limits each kernel").
#if !defined(LOCO_RECOMPUTE_DECAYED)
#define LOCO_RECOMPUTE_DECAYED 0
#endif
template <ErrorStorage E, int C,
          bool Recompute = LOCO_RECOMPUTE_DECAYED && (E == ErrorStorage::kInt8 || E == ErrorStorage::kInt4)>
struct DecayedError {
    float e[C][8];
    __device__ void bind(const OldError<E, C>&, float) {}
    __device__ void set(int c, int i, float error, float beta) { e[c][i] = f_mul(error, beta); }
    __device__ float at(int c, int i) const { return e[c][i]; }
};

template <ErrorStorage E, int C>
struct DecayedError<E, C, true> {
    OldError<E, C> old;
    float beta;
    // the copy's codes pass through an empty asm, so the compiler decodes them again rather than keep the first
    // decoding's values live
    __device__ void bind(const OldError<E, C>& loaded, float b) {
        old = loaded;
        beta = b;
        uint32_t* words = reinterpret_cast<uint32_t*>(old.raw);
#pragma unroll
        for (int w = 0; w < (int)(sizeof(old.raw) / 4); ++w) asm volatile("" : "+r"(words[w]));
    }
    __device__ void set(int, int, float, float) {}
    __device__ float at(int c, int i) const { return f_mul(old.at(c, i), beta); }
};

template <int C, bool Recompute>
struct DecayedError<ErrorStorage::kNone, C, Recompute> {
    __device__ void bind(const OldError<ErrorStorage::kNone, C>&, float) {}
    __device__ float at(int, int) const { return 0.0f; }
};

template <int C>
__device__ __forceinline__ void zero_error(OldError<ErrorStorage::kNone, C>&) {}
template <int C>
__device__ __forceinline__ void zero_error(OldError<ErrorStorage::kInt8, C>& e) {
#pragma unroll
    for (int c = 0; c < C; ++c) e.raw[c] = make_uint2(0x80808080u, 0x80808080u);  // codes 0
    e.scale = 0.0f;
}
template <int C>
__device__ __forceinline__ void zero_error(OldError<ErrorStorage::kInt4, C>& e) {
#pragma unroll
    for (int c = 0; c < C; ++c) e.raw[c] = 0x88888888u;  // codes 0
    e.scale = 0.0f;
}
template <int C>
__device__ __forceinline__ void zero_error(OldError<ErrorStorage::kFp32, C>& e) {
#pragma unroll
    for (int c = 0; c < C; ++c)
#pragma unroll
        for (int i = 0; i < 8; ++i) e.e[c][i] = 0.0f;
}

// ------------------------------------------------------------------------------------------- reductions
// Unsigned max over the team of 2^team_log2 consecutive threads (uniform across the block).
__device__ __forceinline__ uint32_t team_max(uint32_t v, int team_log2, uint32_t* red) {
    if (team_log2 < 5) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1)
            if (off < (1 << team_log2)) v = max(v, __shfl_xor_sync(0xffffffffu, v, off));
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
    uint32_t bits[kRotateChunks];
};

__device__ __forceinline__ ChunkSigns chunk_signs(int lane, int team) {
    ChunkSigns s;
#pragma unroll
    for (int c = 0; c < kRotateChunks; ++c) s.bits[c] = kSignBits.byte[c * team + lane];
    return s;
}

// v *= d (exact: a sign flip).
__device__ __forceinline__ void apply_signs(float (&v)[kRotateChunks][8], const ChunkSigns& s) {
#pragma unroll
    for (int c = 0; c < kRotateChunks; ++c)
#pragma unroll
        for (int i = 0; i < 8; ++i) v[c][i] = __uint_as_float(__float_as_uint(v[c][i]) ^ (((s.bits[c] >> i) & 1u) << 31));
}

__device__ __forceinline__ void scale_all(float (&v)[kRotateChunks][8], float scale) {
#pragma unroll
    for (int c = 0; c < kRotateChunks; ++c)
#pragma unroll
        for (int i = 0; i < 8; ++i) v[c][i] = f_mul(v[c][i], scale);
}

// Sylvester-Hadamard butterfly of the team's group, in place. Every thread of the block must call it (shuffles
// and barriers), inactive teams with zeros; `xchg` holds 8 * kRotateChunks * kBlock floats.
__device__ __forceinline__ void butterfly(float (&v)[kRotateChunks][8], int lane, int team_log2, float* xchg) {
#pragma unroll
    for (int h = 1; h < 8; h <<= 1)
#pragma unroll
        for (int c = 0; c < kRotateChunks; ++c)
#pragma unroll
            for (int i = 0; i < 8; ++i)
                if ((i & h) == 0) {
                    const float a = v[c][i], b = v[c][i + h];
                    v[c][i] = f_add(a, b);
                    v[c][i + h] = f_sub(a, b);
                }
    // across lanes the lower partner takes v + other and the upper other - v: both are fma(v, side, other) with side
    // = +1 or -1 (v * side is exact, so the fma rounds once, like the add), one instruction without a select
    const int team = 1 << team_log2;
    for (int k = 1; k < team; k <<= 1) {
        const float side = (lane & k) == 0 ? 1.0f : -1.0f;
        if (k < 32) {
#pragma unroll
            for (int c = 0; c < kRotateChunks; ++c)
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const float other = __shfl_xor_sync(0xffffffffu, v[c][i], k);
                    v[c][i] = f_fma(v[c][i], side, other);
                }
        } else {
            __syncthreads();  // the previous exchange's readers are done with xchg
#pragma unroll
            for (int c = 0; c < kRotateChunks; ++c)
#pragma unroll
                for (int i = 0; i < 8; ++i) xchg[(c * 8 + i) * kBlock + threadIdx.x] = v[c][i];
            __syncthreads();
            const int partner = threadIdx.x ^ k;  // teams are aligned: the partner is in the same team
#pragma unroll
            for (int c = 0; c < kRotateChunks; ++c)
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const float other = xchg[(c * 8 + i) * kBlock + partner];
                    v[c][i] = f_fma(v[c][i], side, other);
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

// Shared memory for the butterfly's cross-warp exchange: only kernels that rotate groups of more than 512
// (teams wider than a warp) use it, the others declare none.
template <bool Rotate>
struct Exchange {
    __device__ static float* get() { return nullptr; }
};

template <>
struct Exchange<true> {
    __device__ static float* get() {
        __shared__ float xchg[8 * kRotateChunks * kBlock];
        return xchg;
    }
};
// ------------------------------------------------------------------------------------- noise statistics
// The block's N per-thread fp32 sums added in a fixed order (warp butterfly, then the warps in order by thread 0) and
// written to out[0..N): per-block partial sums that the binding adds up (torch's sum: deterministic), so the bits
// never depend on scheduling (no float atomics). Every thread of the block calls it.
template <int N>
__device__ __forceinline__ void write_block_sums(float (&x)[N], float* out) {
    __shared__ float warp_sums[N][kBlock / 32];
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) x[j] = f_add(x[j], __shfl_xor_sync(0xffffffffu, x[j], o));
    if ((threadIdx.x & 31) == 0)
#pragma unroll
        for (int j = 0; j < N; ++j) warp_sums[j][threadIdx.x >> 5] = x[j];
    __syncthreads();
    if (threadIdx.x == 0)
#pragma unroll
        for (int j = 0; j < N; ++j) {
            float total = 0.0f;
            for (int w = 0; w < kBlock / 32; ++w) total = f_add(total, warp_sums[j][w]);
            out[j] = total;
        }
}

// sq += the sum of squares of the thread's values (fp32, in chunk order).
template <int C>
__device__ __forceinline__ void add_squares(const float (&v)[C][8], float& sq) {
#pragma unroll
    for (int c = 0; c < C; ++c)
#pragma unroll
        for (int i = 0; i < 8; ++i) sq = f_fma(v[c][i], v[c][i], sq);
}

// ------------------------------------------------------------------------------- compensate + quantize
// Runs pass(quantize_chunk) with the fastest chunk quantizer that gives `quantize`'s codes for the group's rule (see
// quantize_chunk_fast): one decision per group, none per chunk.
template <Rounding R, int Bits, typename Pass>
__device__ __forceinline__ void with_quantizer(const Rule& rule, const Levels& lv, Pass&& pass) {
    if (rule.mode == kReciprocal)
        pass([&](const float (&x)[8], float (&biased)[8]) { quantize_chunk_fast<R, Bits>(x, rule, biased); });
    else
        pass([&](const float (&x)[8], float (&biased)[8]) { quantize_chunk_exact<R, Bits>(x, rule, lv, biased); });
}

// The value of a biased code in steps, k + cell_centre(R) (k itself, with no add, for a cell centre of 0).
template <Rounding R, int Bits>
__device__ __forceinline__ float level_of(float biased) {
    if constexpr (cell_centre(R) != 0.0f)
        return f_add(code_of<Bits>(biased), cell_centre(R));
    else
        return code_of<Bits>(biased);
}

// Stores the new error `v` of the thread's chunks (team absmax from the threads' `m`) to `er`: fp32 values, or codes
// of storage_format(E).bits bits (8 or 4) rounded to nearest-even on the symmetric grid (p.error_levels) with the
// group's scale. A non-finite group is stored as zero. Every thread of the block calls it (a team reduction).
template <ErrorStorage E, int C>
__device__ __forceinline__ void store_error(const Launch& p, const Block& k, const float (&v)[C][8], float m,
                                            const ErrorRow& er, uint32_t* red) {
    const int lane = k.lane, team = k.team;
    const uint32_t ekey = team_max(key_of(m), p.team_log2, red);
    if constexpr (E == ErrorStorage::kFp32) {
        const bool finite = key_finite(ekey);
        if (!k.active) return;
        float* base = static_cast<float*>(er.values);
#pragma unroll
        for (int c = 0; c < C; ++c) {
            float* dst = base + 8 * (c * team + lane);
            float o[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) o[i] = finite ? v[c][i] : 0.0f;
            reinterpret_cast<float4*>(dst)[0] = make_float4(o[0], o[1], o[2], o[3]);
            reinterpret_cast<float4*>(dst)[1] = make_float4(o[4], o[5], o[6], o[7]);
        }
    } else {
        constexpr int EB = storage_format(E).bits;
        static_assert(EB == 8 || EB == 4, "a scaled error storage holds 8- or 4-bit codes");
        const Rule erule = make_rule(ekey, p.error_levels);
        if (!k.active) return;
        uint8_t* const codes = static_cast<uint8_t*>(er.values) + EB * lane;  // chunk c's word: + c * team * EB bytes
        with_quantizer<Rounding::kNearestEven, EB>(erule, p.error_levels, [&](auto&& quantize_chunk) {
#pragma unroll
            for (int c = 0; c < C; ++c) {
                float biased[8];
                quantize_chunk(v[c], biased);
                const uint64_t word = pack_word<EB>(biased);
                if constexpr (EB == 8)
                    *reinterpret_cast<uint2*>(codes + c * team * EB) =
                        make_uint2((uint32_t)word, (uint32_t)(word >> 32));
                else
                    *reinterpret_cast<uint32_t*>(codes + c * team * EB) = (uint32_t)word;
            }
        });
        if (lane == 0) *er.scale = key_finite(ekey) ? erule.scale() : 0.0f;
    }
}

// v: compensated values c of the thread's chunks (all zero for an inactive team); decayed: beta * the old error.
// Quantizes the group on the wire grid (rounding R, p.levels) to `data`/`scale`, then (E != kNone) stores the updated
// error to `er` (int8 storage: nearest-even, qmax 127). Measured: err_sq gains the squares of the quantization error
// c - deq of the thread's values (unmeasured kernels compile none of it). Each chunk is quantized, packed, stored and
// (with error) turned into its new error in one pass, so only 8 codes are live at a time.
template <int Bits, ErrorStorage E, Rounding R, bool Measured, int C>
__device__ __forceinline__ void quantize_group(const Launch& p, const Block& k, float (&v)[C][8],
                                               const DecayedError<E, C>& decayed, uint32_t key, uint8_t* data,
                                               float* scale, const ErrorRow& er, uint32_t* red, float& err_sq) {
    const int lane = k.lane, team = k.team;
    key = team_max(key, p.team_log2, red);
    const Rule rule = make_rule(key, p.levels);
    uint8_t* const words = data + (int64_t)lane * Bits;  // chunk c's packed word at words + c * team * Bits
    float m = 0.0f;                                       // absmax of the new error
    with_quantizer<R, Bits>(rule, p.levels, [&](auto&& quantize_chunk) {
#pragma unroll
        for (int c = 0; c < C; ++c) {
            float biased[8];
            quantize_chunk(v[c], biased);
            if (k.active) store_word<Bits>(words + (int64_t)c * team * Bits, pack_word<Bits>(biased));
            if constexpr (Measured || E != ErrorStorage::kNone) {
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const float r = f_sub(v[c][i], f_mul(level_of<R, Bits>(biased[i]), rule.scale()));
                    if constexpr (Measured) err_sq = f_fma(r, r, err_sq);
                    if constexpr (E != ErrorStorage::kNone) {
                        v[c][i] = update_decayed(decayed.at(c, i), r, p.one_minus_beta);
                        m = absmax_step(m, v[c][i]);
                    }
                }
            }
        }
    });
    if (k.active && lane == 0) __stcs(scale, rule.scale());
    if constexpr (E != ErrorStorage::kNone) store_error<E>(p, k, v, m, er, red);
}

// The wire grid's rounding of the launch as a template argument: quantize_group<Bits, E, R, Measured>.
template <int Bits, ErrorStorage E, bool Measured, int C>
__device__ __forceinline__ void quantize_group_on_grid(const Launch& p, const Block& k, float (&v)[C][8],
                                                       const DecayedError<E, C>& decayed, uint32_t key,
                                                       uint8_t* data, float* scale, const ErrorRow& er, uint32_t* red,
                                                       float& err_sq) {
    with_rounding(p.rounding, [&](auto rounding) {
        quantize_group<Bits, E, decltype(rounding)::value, Measured>(p, k, v, decayed, key, data, scale, er, red,
                                                                     err_sq);
    });
}

// c = v + e (when there is an error buffer), in place, and decayed = beta * e; returns the thread's absmax key of c.
template <ErrorStorage E, int C>
__device__ __forceinline__ uint32_t compensate(float (&v)[C][8], const OldError<E, C>& old, float beta,
                                               DecayedError<E, C>& decayed) {
    float m = 0.0f;
    decayed.bind(old, beta);
#pragma unroll
    for (int c = 0; c < C; ++c)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            if constexpr (E != ErrorStorage::kNone) {
                const float e = old.at(c, i);
                v[c][i] = f_add(v[c][i], e);
                decayed.set(c, i, e, beta);
            }
            m = absmax_step(m, v[c][i]);
        }
    return key_of(m);
}

template <int C>
__device__ __forceinline__ void zero_values(float (&v)[C][8]) {
#pragma unroll
    for (int c = 0; c < C; ++c)
#pragma unroll
        for (int i = 0; i < 8; ++i) v[c][i] = 0.0f;
}

// ------------------------------------------------------------------------------------------------ own block
// The team's group of row `row` of an own buffer (fp32, the bucket's columns, 16-byte aligned rows): chunk c of lane
// l at columns 8 * (c * team + l) of the group, two float4 each.
template <typename F>
__device__ __forceinline__ F* own_group(F* base, int64_t stride, int64_t row, const Block& k) {
    return base + row * stride + k.item->col + k.col0 + 8 * k.lane;
}

// Stores the team's values `v` as row `row` of the launch's own output.
template <int C>
__device__ __forceinline__ void store_own(const Launch& p, int64_t row, const Block& k, const float (&v)[C][8]) {
    float* const dst = own_group(p.own.out, p.own.out_stride, row, k);
#pragma unroll
    for (int c = 0; c < C; ++c) {
        float4* q = reinterpret_cast<float4*>(dst + 8 * c * k.team);
        q[0] = make_float4(v[c][0], v[c][1], v[c][2], v[c][3]);
        q[1] = make_float4(v[c][4], v[c][5], v[c][6], v[c][7]);
    }
}

// v += row `row` of the launch's own input (one fp32 addition per value, after the received blocks).
template <int C>
__device__ __forceinline__ void add_own(const Launch& p, int64_t row, const Block& k, float (&v)[C][8]) {
    const float* const src = own_group(p.own.in, p.own.in_stride, row, k);
#pragma unroll
    for (int c = 0; c < C; ++c) {
        const float4* q = reinterpret_cast<const float4*>(src + 8 * c * k.team);
        const float4 a = q[0], b = q[1];
        const float o[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) v[c][i] = f_add(v[c][i], o[i]);
    }
}

// Writes the team's group of wire row `row` of the launch's output as zeros: packed codes 0 and scale 0.
template <int Bits, int C>
__device__ __forceinline__ void zero_wire_group(const Launch& p, int64_t row, const Block& k) {
    uint8_t* const words = wire_data<Bits>(p.out, row, k) + (int64_t)k.lane * Bits;
#pragma unroll
    for (int c = 0; c < C; ++c) store_word<Bits>(words + (int64_t)c * k.team * Bits, 0);
    if (k.lane == 0) __stcs(wire_scale(p.out, row, k, p.group_log2), 0.0f);
}

// A team whose row is the rank's own: its values (as the hop would quantize them) go to own-output row `own_row`,
// its wire group is written as zeros, and it runs the quantizer as an inactive team with zeros (no write, no error,
// nothing in the statistics), so that the block's team reductions stay uniform. Returns the Block to quantize with.
template <int Bits, int C>
__device__ __forceinline__ Block keep_own(const Launch& p, const Block& k, int64_t wire_row, int64_t own_row,
                                          float (&v)[C][8]) {
    Block q = k;
    if (k.active) {
        store_own(p, own_row, k, v);
        zero_wire_group<Bits, C>(p, wire_row, k);
    }
    zero_values(v);
    q.active = false;
    return q;
}

// ------------------------------------------------------------------------------------------------ hop 1
// Block row = slot of the send buffer; slot d*M + n carries partition row n*L + d of its gradient.
// One (row, group) pair of hop 1 for the team: every thread of the block calls it (team reductions, rotation).
// Measured: sq[0] gains the squares of the gradient values, sq[1] those of the quantization error. Own: the launch
// keeps an exact own block (p.own); a kernel compiled without it has no trace of one.
template <int DT, int Bits, ErrorStorage E, bool Rotate, bool Measured, bool Own, int C>
__device__ __forceinline__ void hop1_group(const Launch& p, const Block& k, uint32_t* red, float (&sq)[2]) {
    const BucketItem& it = *k.item;
    const int lane = k.lane, team = k.team;
    const int64_t slot = k.row;
    const uint32_t node_of_slot = divide((uint32_t)slot, p.nodes_divisor);  // slot < world < 2^31
    const int64_t row = (int64_t)((uint32_t)slot - node_of_slot * (uint32_t)p.nodes) * p.local + node_of_slot;
    const int64_t part = it.part;
    const int64_t row_start = row * part;
    const int64_t row_valid = max((int64_t)0, min(part, it.numel - row_start));
    // the exact own block: slots [own_first, own_first + kept) keep no error rows, the later ones move up by kept
    const int64_t own_first = Own ? (int64_t)p.own.own * p.own.kept : 0;
    const bool own = Own && p.own.own >= 0 && slot >= own_first && slot < own_first + p.own.kept;
    const ErrorRow er =
        error_row<E>(k, Own && p.own.own >= 0 && slot >= own_first + p.own.kept ? slot - p.own.kept : slot);
    float v[C][8];
    OldError<E, C> old;
    old.bind(p);
    if (k.active) {
        if (own)
            zero_error(old);
        else
            load_error(er, lane, team, old);
        const int64_t first = k.col0 + 8 * lane;                          // chunk 0's first column
        const int64_t last = k.col0 + 8 * ((C - 1) * team + lane);  // last chunk's first column
        // chunks are 8 * team elements apart, a multiple of 16 bytes: chunk 0's alignment holds for all
        const bool fast = last + 8 <= row_valid &&
                          aligned(static_cast<const char*>(it.grad) + (row_start + first) * Grad<DT>::kSize, 16);
        if (fast) {
#pragma unroll
            for (int c = 0; c < C; ++c) Grad<DT>::eight(it.grad, row_start + first + 8 * c * team, v[c]);
        } else {
#pragma unroll
            for (int c = 0; c < C; ++c) {
                const int64_t col = first + 8 * c * team;
#pragma unroll
                for (int i = 0; i < 8; ++i)
                    v[c][i] = col + i < row_valid ? Grad<DT>::one(it.grad, row_start + col + i) : 0.0f;
            }
        }
    } else {  // inactive teams go on with zeros (uniform control flow for the team reductions)
        zero_values(v);
        zero_error(old);
    }
    if constexpr (Measured) add_squares(v, sq[0]);
    if constexpr (Rotate) {  // every thread: the butterfly exchanges across the team
        apply_signs(v, chunk_signs(lane, team));
        butterfly(v, lane, p.team_log2, Exchange<Rotate>::get());
        scale_all(v, p.hadamard_scale);
    }
    const Block q = own ? keep_own<Bits, C>(p, k, slot, slot - own_first, v) : k;
    DecayedError<E, C> decayed;
    const uint32_t key = compensate(v, old, p.beta, decayed);
    quantize_group_on_grid<Bits, E, Measured>(p, q, v, decayed, key, wire_data<Bits>(p.out, slot, k),
                                              wire_scale(p.out, slot, k, p.group_log2), er, red, sq[1]);
}

// Measured (a launch with stats): the block's sums go to p.stats[2 * block ..]; an unmeasured kernel has no trace of
// them (registers, loads, barriers). Own: a launch with an exact own block (the code that keeps one cost the
// kernels without it registers and spills, so they are compiled apart).
template <int DT, int Bits, ErrorStorage E, bool Rotate, bool Measured, bool Own,
          int C = chunks_of(kHop1Kernel, Rotate, E), int G = groups_of(kHop1Kernel, Rotate)>
__global__ void __launch_bounds__(kBlock, min_blocks(C)) hop1_kernel(const Launch p) {
    __shared__ uint32_t red[kBlock / 32];
    const BucketItem* const item = p.items + item_of_block(p);
    float sq[2] = {0.0f, 0.0f};
#pragma unroll 1
    for (int step = 0; step < G; ++step)
        hop1_group<DT, Bits, E, Rotate, Measured, Own, C>(p, locate_pair(p, item, step, G), red, sq);
    if constexpr (Measured) write_block_sums(sq, p.stats + 2 * (int64_t)blockIdx.x);
}

// ------------------------------------------------------------------------------------------------ hop 2
// Received rows whose loads are issued together: 8 words per thread in flight (4 rows of 2 chunks, 2 rows of 4).
template <int C>
constexpr int kRowsPerBatch = 8 / C;

// v = sum over j < count, j != skip, of dequant(row first + j * stride of `in`) for the thread's chunks, in j order
// (fp32; the first row summed is taken as it is), codes of `Bits` bits on the launch's grid (rounding R: value
// (k + cell_centre(R)) * scale). `skip` (Own only): -1, or the received block of the exact own block (never read; at
// least one other row is summed). The loads of kRowsPerBatch rows are issued before any of them is used; codes are
// decoded without integer-to-float conversions (math::code_value).
template <int Bits, Rounding R, bool Own, int C>
__device__ __forceinline__ void sum_rows(const Launch& p, const Block& k, int64_t first, int64_t stride, int count,
                                         int skip, float (&v)[C][8]) {
    const int lead = Own && skip == 0 ? 1 : 0;  // the first row summed
    for (int r0 = 0; r0 < count; r0 += kRowsPerBatch<C>) {
        uint64_t w[kRowsPerBatch<C>][C];
        float s[kRowsPerBatch<C>];
#pragma unroll
        for (int j = 0; j < kRowsPerBatch<C>; ++j) {
            if (r0 + j < count && (!Own || r0 + j != skip)) {
                const int64_t row = first + (int64_t)(r0 + j) * stride;
                const uint8_t* data = wire_data<Bits>(p.in, row, k);
                s[j] = *wire_scale(p.in, row, k, p.group_log2);
#pragma unroll
                for (int c = 0; c < C; ++c)
                    w[j][c] = load_word<Bits>(data + (int64_t)(c * k.team + k.lane) * Bits) ^ sign_bits<Bits>();
            }
        }
#pragma unroll
        for (int j = 0; j < kRowsPerBatch<C>; ++j) {
            if (r0 + j < count && (!Own || r0 + j != skip)) {
#pragma unroll
                for (int c = 0; c < C; ++c)
#pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        const float d = f_mul(code_value<Bits, R>(w[j][c], i, p.magic_bits), s[j]);
                        v[c][i] = r0 + j == lead ? d : f_add(v[c][i], d);
                    }
            }
        }
    }
}

// sum_rows on the launch's grid; Own: skipping the received own block (p.own.in_own) and adding own-input row
// `own_row` after the others.
template <int Bits, bool Own, int C>
__device__ __forceinline__ void sum_rows_on_grid(const Launch& p, const Block& k, int64_t first, int64_t stride,
                                                 int count, int64_t own_row, float (&v)[C][8]) {
    with_rounding(p.rounding, [&](auto rounding) {
        sum_rows<Bits, decltype(rounding)::value, Own>(p, k, first, stride, count, Own ? p.own.in_own : -1, v);
    });
    if constexpr (Own)
        if (p.own.in_own >= 0) add_own(p, own_row, k, v);
}

// Block row = output row m (node); the input bits are a run-time switch (p.in_bits). Measured: sq[0] gains the
// squares of the summed input, sq[1] those of the quantization error. Own: as in hop1_group (own, in_own or both).
template <int Bits, ErrorStorage E, bool Measured, bool Own, int C>
__device__ __forceinline__ void hop2_group(const Launch& p, int in_bits, const Block& k, uint32_t* red,
                                           float (&sq)[2]) {
    const int64_t m = k.row;
    // the exact own block: output row own keeps no error row, the later ones move up by one
    const bool own = Own && m == p.own.own;
    const ErrorRow er = error_row<E>(k, Own && p.own.own >= 0 && m > p.own.own ? m - 1 : m);
    float v[C][8];
    OldError<E, C> old;
    old.bind(p);
    if (k.active) {
        if (own)
            zero_error(old);
        else
            load_error(er, k.lane, k.team, old);
        switch (in_bits) {
            // the in_blocks received blocks of output row m: input rows j * nodes + m (own input: row m)
            case 2: sum_rows_on_grid<2, Own>(p, k, m, p.nodes, p.in_blocks, m, v); break;
            case 3: sum_rows_on_grid<3, Own>(p, k, m, p.nodes, p.in_blocks, m, v); break;
            case 4: sum_rows_on_grid<4, Own>(p, k, m, p.nodes, p.in_blocks, m, v); break;
            default: sum_rows_on_grid<8, Own>(p, k, m, p.nodes, p.in_blocks, m, v); break;
        }
    } else {
        zero_values(v);
        zero_error(old);
    }
    if constexpr (Measured) add_squares(v, sq[0]);
    const Block q = own ? keep_own<Bits, C>(p, k, m, 0, v) : k;
    DecayedError<E, C> decayed;
    const uint32_t key = compensate(v, old, p.beta, decayed);
    quantize_group_on_grid<Bits, E, Measured>(p, q, v, decayed, key, wire_data<Bits>(p.out, m, k),
                                              wire_scale(p.out, m, k, p.group_log2), er, red, sq[1]);
}

template <int Bits, ErrorStorage E, bool Measured, bool Own, int C = chunks_of(kHop2Kernel, false, E),
          int G = groups_of(kHop2Kernel, false)>
__global__ void __launch_bounds__(kBlock, min_blocks(C)) hop2_kernel(const Launch p, int in_bits) {
    __shared__ uint32_t red[kBlock / 32];
    const BucketItem* const item = p.items + item_of_block(p);
    float sq[2] = {0.0f, 0.0f};
#pragma unroll 1
    for (int step = 0; step < G; ++step)
        hop2_group<Bits, E, Measured, Own, C>(p, in_bits, locate_pair(p, item, step, G), red, sq);
    if constexpr (Measured) write_block_sums(sq, p.stats + 2 * (int64_t)blockIdx.x);
}

// ------------------------------------------------------------------------------------------------ final
// Two fp32 values as the packed pair {lo, hi} of fp16 or bf16 bits, rounded to nearest even (subnormals kept): one
// cvt.rn.{f16,bf16}x2.f32 (F2FP) on sm_80+ instead of one quarter-rate F2F (fp16) or about five integer instructions
// (bf16, math::float_to_bf16_bits) per value. Finite values and infinities convert bit for bit like torch's
// conversions; a NaN becomes the canonical NaN of the type (0x7fff / 0x7fff) instead of torch's 0x7fc0 (bf16), which
// the contract leaves open (NaN payloads of fp16/bf16 outputs).
template <int OutDT>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
    uint32_t d;
    if constexpr (OutDT == kFloat16)
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    else
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
#else
    if constexpr (OutDT == kFloat16)
        return __half_as_ushort(__float2half_rn(lo)) | ((uint32_t)__half_as_ushort(__float2half_rn(hi)) << 16);
    else
        return float_to_bf16_bits(lo) | ((uint32_t)float_to_bf16_bits(hi) << 16);
#endif
}

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
        uint32_t h[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) h[i] = pack_pair<OutDT>(x[2 * i], x[2 * i + 1]);
        unsigned short* p = static_cast<unsigned short*>(out) + col;
        if (count >= 8 && aligned(p, 16)) {
            __stcs(reinterpret_cast<uint4*>(p), make_uint4(h[0], h[1], h[2], h[3]));
        } else {
            for (int i = 0; i < 8 && i < count; ++i) p[i] = (unsigned short)(h[i >> 1] >> (16 * (i & 1)));
        }
    }
}

// The team's fp32 sums, / W, trimmed to the partition, stored as OutDT; Measured: sq gains their squares.
template <int OutDT, bool Measured, int C>
__device__ __forceinline__ void final_store(const Launch& p, const Block& k, const BucketItem& it, float (&v)[C][8],
                                            float& sq) {
    // / W: for W = 2^j the product by the exact 2^-j rounds the same real number once, so it is the IEEE quotient
    // bit for bit for every input (subnormal results, zeros, infinities; NaN stays NaN) at one FMUL instead of a
    // division sequence; other W divide (launch-uniform branch)
    if (p.world_pow2) {
#pragma unroll
        for (int c = 0; c < C; ++c)
#pragma unroll
            for (int i = 0; i < 8; ++i) v[c][i] = f_mul(v[c][i], p.inv_world);
    } else {
        const float world = (float)p.world;
#pragma unroll
        for (int c = 0; c < C; ++c)
#pragma unroll
            for (int i = 0; i < 8; ++i) v[c][i] = f_div(v[c][i], world);
    }
#pragma unroll
    for (int c = 0; c < C; ++c) {
        const int64_t col = k.col0 + 8 * (c * k.team + k.lane);
        if (col >= it.part) continue;
        if (col + 8 > it.valid) {  // the partition's last valid columns: zero the rest (one 64-bit test per chunk)
#pragma unroll
            for (int i = 0; i < 8; ++i)
                if (col + i >= it.valid) v[c][i] = 0.0f;
        }
        if constexpr (Measured)
#pragma unroll
            for (int i = 0; i < 8; ++i) sq = f_fma(v[c][i], v[c][i], sq);
        store_out<OutDT>(it.out, col, it.part - col, v[c]);
    }
}

// One output row per parameter; with Rotate each group's sum is rotated back (d * (H t) * s) before / W. Measured:
// the block's sum of squares of the fp32 mean it writes (before the cast) goes to p.stats[blockIdx.x]. Own: the
// launch's in_own row is replaced by the own input.
template <int Bits, int OutDT, bool Rotate, bool Measured, bool Own,
          int C = chunks_of(kFinalKernel, Rotate, ErrorStorage::kNone)>
__global__ void __launch_bounds__(kBlock, LOCO_FINAL_MIN_BLOCKS) final_kernel(const Launch p) {
    const Block k = locate(p);
    const BucketItem& it = *k.item;
    float v[C][8];
    if (k.active)
        sum_rows_on_grid<Bits, Own>(p, k, 0, 1, p.rows, 0, v);
    else
        zero_values(v);
    if constexpr (Rotate) {  // every thread, inactive teams with zeros
        butterfly(v, k.lane, p.team_log2, Exchange<Rotate>::get());
        scale_all(v, p.hadamard_scale);
        apply_signs(v, chunk_signs(k.lane, k.team));
    }
    float sq[1] = {0.0f};
    if (k.active) final_store<OutDT, Measured, C>(p, k, it, v, sq[0]);
    if constexpr (Measured) write_block_sums(sq, p.stats + (int64_t)blockIdx.x);
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

template <ErrorStorage E>
using StorageConstant = std::integral_constant<ErrorStorage, E>;

template <typename F>
bool with_error_storage(ErrorStorage storage, F&& f) {
    switch (storage) {
        case ErrorStorage::kNone: f(StorageConstant<ErrorStorage::kNone>{}); return true;
        case ErrorStorage::kInt4: f(StorageConstant<ErrorStorage::kInt4>{}); return true;
        case ErrorStorage::kInt8: f(StorageConstant<ErrorStorage::kInt8>{}); return true;
        case ErrorStorage::kFp32: f(StorageConstant<ErrorStorage::kFp32>{}); return true;
    }
    return false;
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

// f(std::true_type) or f(std::false_type): the rotation, or whether a launch is measured, as a template argument.
template <typename F>
void with_flag(bool flag, F&& f) {
    if (flag)
        f(std::true_type{});
    else
        f(std::false_type{});
}

int log2_of(int64_t v) {
    int l = 0;
    while ((int64_t)1 << (l + 1) <= v) ++l;
    return l;
}

// fp32(1 / sqrt(group_size)), rounded like the reference (double, then fp32).
float hadamard_scale(int group_size) { return (float)(1.0 / sqrt((double)group_size)); }

// `chunks`: chunks_of the kernel the launch runs (it sets the team size); `stats`: the measured launch's partial sums.
Launch make_launch(const HopArgs& a, int chunks, ErrorStorage storage, const BucketItem* items, int count,
                   WireArgs in, WireArgs out, int rows, const OwnBlock& own, float* stats) {
    Launch p;
    p.items = items;
    p.count = count;
    p.group_log2 = log2_of(a.group_size);
    p.team_log2 = log2_of(a.group_size / (8 * chunks));
    p.world = a.world;
    p.local = a.local;
    p.nodes = a.world / a.local;
    p.in_blocks = a.in_blocks;
    p.nodes_divisor = fast_divisor((uint32_t)p.nodes);
    p.rows = rows;
    p.item_rows = a.world;
    p.rounding = a.rounding;
    p.beta = a.beta;
    p.one_minus_beta = math::f_sub(1.0f, a.beta);
    p.hadamard_scale = hadamard_scale(a.group_size);
    p.world_pow2 = a.world > 0 && (a.world & (a.world - 1)) == 0;
    p.inv_world = p.world_pow2 ? 1.0f / (float)a.world : 0.0f;  // exact: 2^-j, j < 31
    p.levels = levels(a.bits, a.rounding);
    p.error_levels = levels(storage_format(storage).bits == 4 ? 4 : 8, Rounding::kNearestEven);  // scaled storages
    p.magic_bits = kRoundMagicBits;
    p.in = in;
    p.out = out;
    p.own = own;
    p.stats = stats;
    return p;
}

const char* launched() {
    const cudaError_t status = cudaGetLastError();
    return status == cudaSuccess ? nullptr : cudaGetErrorString(status);
}

constexpr const char* kBadArguments = "LoCo kernels: bits, error storage or dtype outside the compiled set";

// The launchers' bodies, for the kernels with (Own) or without an exact own block: each translation unit
// instantiates one (see the end of this file).
template <bool Own>
const char* launch_hop1(const HopArgs& a, int grad_dtype, ErrorStorage storage, const BucketItem* items, int count,
                        int64_t blocks, WireArgs out, const OwnBlock& own, float* stats, cudaStream_t stream) {
    if (blocks == 0) return nullptr;
    const Launch p = make_launch(a, chunks_of(kHop1Kernel, a.hadamard, storage), storage, items, count, WireArgs{},
                                 out, 0, own, stats);
    bool ok = false;
    with_dtype(grad_dtype, [&](auto dt) {
        with_bits(a.bits, [&](auto bits) {
            with_error_storage(storage, [&](auto e) {
                with_flag(a.hadamard, [&](auto rotate) {
                    with_flag(stats != nullptr, [&](auto measured) {
                        hop1_kernel<decltype(dt)::value, decltype(bits)::value, decltype(e)::value,
                                    decltype(rotate)::value, decltype(measured)::value, Own>
                            <<<(unsigned)blocks, kBlock, 0, stream>>>(p);
                        ok = true;
                    });
                });
            });
        });
    });
    return ok ? launched() : kBadArguments;
}

template <bool Own>
const char* launch_hop2(const HopArgs& a, ErrorStorage storage, const BucketItem* items, int count, int64_t blocks,
                        WireArgs in, WireArgs out, const OwnBlock& own, float* stats, cudaStream_t stream) {
    if (blocks == 0) return nullptr;
    Launch p =
        make_launch(a, chunks_of(kHop2Kernel, false, storage), storage, items, count, in, out, 0, own, stats);
    p.item_rows = p.nodes;
    bool ok = false;
    with_bits(a.bits, [&](auto bits) {
        with_error_storage(storage, [&](auto e) {
            with_flag(stats != nullptr, [&](auto measured) {
                hop2_kernel<decltype(bits)::value, decltype(e)::value, decltype(measured)::value, Own>
                    <<<(unsigned)blocks, kBlock, 0, stream>>>(p, a.in_bits);
                ok = true;
            });
        });
    });
    return ok ? launched() : kBadArguments;
}

template <bool Own>
const char* launch_final(const HopArgs& a, int out_dtype, const BucketItem* items, int count, int64_t blocks,
                         WireArgs in, int rows, const OwnBlock& own, float* stats, cudaStream_t stream) {
    if (blocks == 0) return nullptr;
    Launch p = make_launch(a, chunks_of(kFinalKernel, a.hadamard, ErrorStorage::kNone), ErrorStorage::kNone, items,
                           count, in, WireArgs{}, rows, own, stats);
    p.item_rows = 1;
    bool ok = false;
    with_dtype(out_dtype, [&](auto dt) {
        with_bits(a.bits, [&](auto bits) {
            with_flag(a.hadamard, [&](auto rotate) {
                with_flag(stats != nullptr, [&](auto measured) {
                    final_kernel<decltype(bits)::value, decltype(dt)::value, decltype(rotate)::value,
                                 decltype(measured)::value, Own><<<(unsigned)blocks, kBlock, 0, stream>>>(p);
                    ok = true;
                });
            });
        });
    });
    return ok ? launched() : kBadArguments;
}

}  // namespace

#if defined(LOCO_OWN_KERNELS)
// loco_kernels_own.cu: the launches with an exact own block, in a translation unit of their own (the kernels with
// and without one are twice the code; the builder compiles the two units in parallel).
const OwnLaunchers kOwnLaunchers{launch_hop1<true>, launch_hop2<true>, launch_final<true>};
#else
int chunks_per_thread(Kernel kernel, bool rotate, ErrorStorage storage) {
    return chunks_of(kernel, rotate, storage) * groups_of(kernel, rotate);
}

const char* quantize_bucket(const HopArgs& a, int grad_dtype, ErrorStorage storage, const BucketItem* items,
                            int count, int64_t blocks, WireArgs out, const OwnBlock& own, float* stats,
                            cudaStream_t stream) {
    return (own.own >= 0 ? kOwnLaunchers.hop1 : launch_hop1<false>)(a, grad_dtype, storage, items, count, blocks, out,
                                                                     own, stats, stream);
}

const char* requantize_bucket(const HopArgs& a, ErrorStorage storage, const BucketItem* items, int count,
                              int64_t blocks, WireArgs in, WireArgs out, const OwnBlock& own, float* stats,
                              cudaStream_t stream) {
    return (own.own >= 0 || own.in_own >= 0 ? kOwnLaunchers.hop2 : launch_hop2<false>)(a, storage, items, count, blocks,
                                                                                        in, out, own, stats, stream);
}

const char* final_mean_bucket(const HopArgs& a, int out_dtype, const BucketItem* items, int count, int64_t blocks,
                              WireArgs in, int rows, const OwnBlock& own, float* stats, cudaStream_t stream) {
    return (own.in_own >= 0 ? kOwnLaunchers.final_mean : launch_final<false>)(a, out_dtype, items, count, blocks, in,
                                                                              rows, own, stats, stream);
}

// ------------------------------------------------------------------------------------------ the shared sample
namespace {

// One thread a sampled coordinate; the product is one fp32 multiplication, as in the reference.
template <int DT>
__global__ void __launch_bounds__(kBlock) sample_kernel(const SampleArgs a) {
    const int64_t i = (int64_t)blockIdx.x * kBlock + threadIdx.x;
    if (i >= a.n) return;
    const int owner = a.owners[i];
    const int64_t at = a.coords[i];
    a.out[i] = at < 0 ? 0.0f : Grad<DT>::one(a.sources[owner], at) * a.scales[owner];
}

}  // namespace

const char* gather_sample(int dtype, const SampleArgs& a, cudaStream_t stream) {
    if (a.n == 0) return nullptr;
    const unsigned blocks = (unsigned)((a.n + kBlock - 1) / kBlock);
    const bool ok = with_dtype(dtype, [&](auto dt) {
        sample_kernel<decltype(dt)::value><<<blocks, kBlock, 0, stream>>>(a);
    });
    return ok ? launched() : kBadArguments;
}

#endif  // LOCO_OWN_KERNELS

}  // namespace loco
