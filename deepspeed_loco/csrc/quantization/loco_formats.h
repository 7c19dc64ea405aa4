// The formats of LoCo's numbers, as the kernels and the binding see them: the mirror of
// deepspeed_loco/layout/formats.py, where they are declared (same names, values and order;
// tests/unit/layout/test_formats.py compiles this header with g++ and compares). Plain C++17, no torch or CUDA
// header.
#pragma once

#if defined(__CUDACC__)
#define LOCO_FORMAT_FN __host__ __device__ constexpr
#else
#define LOCO_FORMAT_FN constexpr
#endif

namespace loco {

// How an error-feedback buffer keeps its fp32 error between steps: the kernels' code for a storage, described by
// storage_format (not a bit count).
enum class ErrorStorage : int {
    kNone = 0,  // no buffer (error feedback off)
    kInt4 = 1,  // 4-bit codes, two per byte (even column in the low nibble), and one fp32 scale per group (qmax 7)
    kInt8 = 2,  // int8 codes and one fp32 scale per group (symmetric, qmax 127)
    kFp32 = 3   // fp32 values, no scale
};

// What a storage is: `bits` of one value (the config's error_bits; 0: none), `per_element` values in one element of
// the values tensor (uint8 holds two 4-bit codes), `scaled`: one fp32 scale per group (error = code * scale, the
// symmetric grid of `bits` bits, nearest-even).
struct StorageFormat {
    int bits, per_element;
    bool scaled;
};

LOCO_FORMAT_FN StorageFormat storage_format(ErrorStorage s) {
    return s == ErrorStorage::kInt4   ? StorageFormat{4, 2, true}
           : s == ErrorStorage::kInt8 ? StorageFormat{8, 1, true}
           : s == ErrorStorage::kFp32 ? StorageFormat{32, 1, false}
                                      : StorageFormat{0, 1, false};
}

// How a grid turns the ratio c / scale (math::ratio) into a code k; code k stands for the centre of its cell of ratios,
// (k + cell_centre(rounding)) * scale.
enum class Rounding : int {
    kNearestEven = 0,  // k = rint(c / scale), ties to even: cell [k - 1/2, k + 1/2]
    kFloor = 1         // k = floor(c / scale): cell [k, k + 1)
};

LOCO_FORMAT_FN float cell_centre(Rounding r) { return r == Rounding::kFloor ? 0.5f : 0.0f; }

// The quantization grids by name, in formats.py's GRIDS order (the binding looks a hop's grid up by its name).
struct Grid {
    const char* name;
    Rounding rounding;
};

constexpr Grid kGrids[] = {
    {"symmetric", Rounding::kNearestEven},
    {"midrise", Rounding::kFloor},
};
constexpr int kGridCount = sizeof(kGrids) / sizeof(kGrids[0]);

}  // namespace loco
