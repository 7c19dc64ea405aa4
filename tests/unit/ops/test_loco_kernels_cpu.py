"""What of the fused-kernel code can be checked without a GPU.

* The kernels' element arithmetic (``deepspeed_loco/csrc/quantization/loco_kernels.cuh``, namespace ``loco::math``:
  the quantizer (the product by the group's reciprocal, the division by a subnormal scale), the LoCo update, the bit
  packing, the Hadamard signs) built as host C++ with g++ and compared bit for bit with the reference on adversarial
  inputs (ties, denormal and huge scales, non-finite groups).
* The builder (sources found, fast math stripped) and the dispatcher (reference on CPU, one log line,
  ``DS_LOCO_KERNELS``).
"""
import ctypes
import logging
import shutil
import subprocess

import pytest
import torch

from deepspeed_loco import ops
from deepspeed_loco.layout import GRID_NAMES
from deepspeed_loco.ops import library
from deepspeed_loco.ops.quantizer import dequantize_groups, pack, quantize_groups, unpack
from tests.unit.ops.adversarial import adversarial_groups

_SHIM = r"""
#define LOCO_NO_LAUNCHERS
#include "loco_kernels.cuh"
#include <type_traits>
using namespace loco::math;

// f(std::integral_constant<int, B>{}) for bits B = 2, 3, 4 or 8 (anything else: 8), as the launchers dispatch.
template <typename F>
static void with_bits(int bits, F&& f) {
    switch (bits) {
        case 2: f(std::integral_constant<int, 2>{}); break;
        case 3: f(std::integral_constant<int, 3>{}); break;
        case 4: f(std::integral_constant<int, 4>{}); break;
        default: f(std::integral_constant<int, 8>{}); break;
    }
}

template <int Bits>
static void store_packed(const float (&biased)[8], unsigned char* out) {
    const uint64_t word = pack_word<Bits>(biased);
    for (int b = 0; b < Bits; ++b) out[b] = (unsigned char)(word >> (8 * b));
}

// f(std::integral_constant<loco::Rounding, r>{}) for the rounding of grid `grid` (an index of loco::kGrids).
template <typename F>
static void with_grid(int grid, F&& f) {
    if (loco::kGrids[grid].rounding == loco::Rounding::kFloor)
        f(std::integral_constant<loco::Rounding, loco::Rounding::kFloor>{});
    else
        f(std::integral_constant<loco::Rounding, loco::Rounding::kNearestEven>{});
}

// grid: an index of loco::kGrids; codes to q, packed as the kernels pack them to `packed`
template <int Bits, loco::Rounding R>
static void quantize_all(const float* c, long long n, int group, signed char* q, float* scale, unsigned char* packed) {
    const Levels lv = levels(Bits, R);
    for (long long g = 0; g < n / group; ++g) {
        float m = 0.0f;
        for (int i = 0; i < group; ++i) m = absmax_step(m, c[g * group + i]);
        const Rule rule = make_rule(key_of(m), lv);
        scale[g] = rule.scale();
        for (int chunk = 0; chunk < group; chunk += 8) {  // as a kernel thread holds them, one chunk per thread
            const long long at = g * group + chunk;
            float v[8], biased[8];
            for (int i = 0; i < 8; ++i) v[i] = c[at + i];
            if (rule.mode == kReciprocal)  // as with_quantizer chooses
                quantize_chunk_fast<R, Bits>(v, rule, biased);
            else
                quantize_chunk_exact<R, Bits>(v, rule, lv, biased);
            for (int i = 0; i < 8; ++i) {
                q[at + i] = (signed char)(int)code_of<Bits>(biased[i]);
                const Quantized one = quantize<R>(c[at + i], rule, lv);
                if (float_bits(one.qf) != float_bits(code_of<Bits>(biased[i])) || one.q != q[at + i]) q[0] = 99;
            }
            store_packed<Bits>(biased, packed + at * Bits / 8);
        }
    }
}

extern "C" void host_quantize(const float* c, long long n, int group, int bits, int grid, signed char* q,
                              float* scale, unsigned char* packed) {
    with_bits(bits, [&](auto b) {
        with_grid(grid, [&](auto r) {
            quantize_all<decltype(b)::value, decltype(r)::value>(c, n, group, q, scale, packed);
        });
    });
}

// The scale of a group of absmax key keys[i] (make_rule: the divisor's reciprocal_product, or the division itself).
extern "C" void host_scales(const unsigned* keys, long long n, int bits, int grid, float* out) {
    const Levels lv = levels(bits, loco::kGrids[grid].rounding);
    for (long long i = 0; i < n; ++i) out[i] = make_rule(keys[i], lv).scale();
}

extern "C" void host_update(const float* c, const float* e, long long n, int group, int bits, int grid, float beta,
                            float* out) {
    const float omb = f_sub(1.0f, beta);
    const Levels lv = levels(bits, loco::kGrids[grid].rounding);
    for (long long g = 0; g < n / group; ++g) {
        float m = 0.0f;
        for (int i = 0; i < group; ++i) m = absmax_step(m, c[g * group + i]);
        const Rule rule = make_rule(key_of(m), lv);
        for (int i = 0; i < group; ++i) {
            const long long j = g * group + i;
            float qf = 0.0f;
            with_grid(grid, [&](auto r) { qf = quantize<decltype(r)::value>(c[j], rule, lv).qf; });
            out[j] = update(e[j], residual(c[j], qf, lv.half, rule.scale()), beta, omb);
        }
    }
}

extern "C" unsigned host_divide(unsigned n, unsigned d) { return loco::divide(n, loco::fast_divisor(d)); }

template <int Bits>
static void pack_all(const signed char* q, long long n, unsigned char* out) {
    for (long long w = 0; w < n / 8; ++w) {
        float biased[8];
        for (int j = 0; j < 8; ++j) biased[j] = magic<Bits>() + (float)q[8 * w + j];  // exact
        store_packed<Bits>(biased, out + w * Bits);
    }
}

// Codes q packed as the kernels pack them (pack_word of the biased codes).
extern "C" void host_pack(const signed char* q, long long n, int bits, unsigned char* out) {
    with_bits(bits, [&](auto b) { pack_all<decltype(b)::value>(q, n, out); });
}

template <int Bits, loco::Rounding R>
static void unpack_values(const unsigned char* data, long long n, float* out) {
    for (long long w = 0; w < n / 8; ++w) {
        uint64_t word = 0;
        for (int b = 0; b < Bits; ++b) word |= (uint64_t)data[w * Bits + b] << (8 * b);
        word ^= sign_bits<Bits>();
        for (int j = 0; j < 8; ++j) out[8 * w + j] = code_value<Bits, R>(word, j);
    }
}

// The value of every packed code on grid `grid`: k + its rounding's cell centre, as the kernels decode them.
extern "C" void host_unpack(const unsigned char* data, long long n, int bits, int grid, float* out) {
    with_bits(bits, [&](auto b) {
        with_grid(grid, [&](auto r) { unpack_values<decltype(b)::value, decltype(r)::value>(data, n, out); });
    });
}

extern "C" void host_to_bf16(const float* x, long long n, unsigned short* out) {
    for (long long i = 0; i < n; ++i) out[i] = float_to_bf16_bits(x[i]);
}

extern "C" void host_hadamard_signs(long long n, float* out) {
    for (long long i = 0; i < n; ++i) out[i] = hadamard_negative((uint32_t)i) ? -1.0f : 1.0f;
}
"""

BITS = [2, 3, 4, 8]


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """The kernels' element arithmetic compiled for the host (g++, no contraction, IEEE)."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("needs a C++ compiler (g++) to build the kernels' arithmetic for the host")
    from deepspeed_loco.ops.op_builder.loco import csrc_dir
    folder = tmp_path_factory.mktemp("loco_host")
    (folder / "shim.cpp").write_text(_SHIM)
    library = folder / "libloco_host.so"
    subprocess.run([compiler, "-O2", "-std=c++17", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC",
                    f"-I{csrc_dir()}", str(folder / "shim.cpp"), "-o", str(library)], check=True)
    return ctypes.CDLL(str(library))


def _ptr(t):
    return ctypes.c_void_p(t.data_ptr())


GRIDS = {name: index for index, name in enumerate(GRID_NAMES)}  # loco::kGrids' indices


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("group_size", [32, 256])
@pytest.mark.parametrize("bits", BITS)
def test_host_quantizer_is_bit_identical_to_the_reference(host, bits, group_size, grid):
    gen = torch.Generator().manual_seed(1000 * bits + group_size)
    c = torch.cat([adversarial_groups(group_size, bits, gen, g) for g in GRIDS])  # both grids' boundaries
    q = torch.empty(c.numel(), dtype=torch.int8)
    scale = torch.empty(c.numel() // group_size)
    packed = torch.empty(c.numel() * bits // 8, dtype=torch.uint8)
    host.host_quantize(_ptr(c), ctypes.c_longlong(c.numel()), group_size, bits, GRIDS[grid], _ptr(q), _ptr(scale),
                       _ptr(packed))
    want_q, want_scale = quantize_groups(c, bits, group_size, grid)
    assert torch.equal(q, want_q)
    assert torch.equal(packed, pack(want_q, bits))
    assert torch.equal(scale.view(torch.int32), want_scale.view(torch.int32))
    if grid == "midrise" and group_size > 1 << bits:  # every code occurs on the boundary groups
        assert set(q.unique().tolist()) == set(range(-(1 << (bits - 1)), 1 << (bits - 1)))


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("beta", [0.0, 0.8, 0.3])
@pytest.mark.parametrize("bits", BITS)
def test_host_loco_update_is_bit_identical_to_the_reference(host, bits, beta, grid):
    gen = torch.Generator().manual_seed(bits)
    c = adversarial_groups(32, bits, gen, grid)
    e = torch.randn(c.numel(), generator=gen) * 0.01
    out = torch.empty_like(c)
    host.host_update(_ptr(c), _ptr(e), ctypes.c_longlong(c.numel()), 32, bits, GRIDS[grid], ctypes.c_float(beta),
                     _ptr(out))
    q, scale = quantize_groups(c, bits, 32, grid)
    beta32 = torch.tensor(beta, dtype=torch.float32)
    want = e * beta32 + (c - dequantize_groups(q, scale, 32, grid)) * (1 - beta32)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("bits", BITS)
def test_host_packing_matches_the_reference_layout(host, bits):
    gen = torch.Generator().manual_seed(bits)
    half = 1 << (bits - 1)
    q = torch.randint(-half, half, (4096,), dtype=torch.int8, generator=gen)  # both grids' codes
    packed = torch.empty(4096 * bits // 8, dtype=torch.uint8)
    host.host_pack(_ptr(q), ctypes.c_longlong(q.numel()), bits, _ptr(packed))
    assert torch.equal(packed, pack(q, bits))
    raw = torch.randint(0, 256, (4096 * bits // 8,), dtype=torch.uint8, generator=gen)
    codes = unpack(raw, bits).float()
    assert set(codes.unique().tolist()) == set(range(-(1 << (bits - 1)), 1 << (bits - 1)))  # every code occurs
    for grid, want in (("symmetric", codes), ("midrise", codes + 0.5)):
        values = torch.empty(4096)
        host.host_unpack(_ptr(raw), ctypes.c_longlong(values.numel()), bits, GRIDS[grid], _ptr(values))
        assert torch.equal(values.view(torch.int32), want.view(torch.int32))  # bit for bit: +0.0 for code 0


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("bits", BITS)
def test_host_group_scale_is_the_ieee_quotient(host, bits, grid):
    """make_rule's scale (reciprocal_product by the divisor's split reciprocal for absmax >= 2^-100, division below) is
    fp32 absmax / divisor for random finite keys of every exponent, the subnormals and the ends of each range."""
    gen = torch.Generator().manual_seed(bits)
    edges = [0, 1, 2, 0x007FFFFF, 0x00800000, 0x0D7FFFFF, 0x0D800000, 0x0D800001, 0x3F800000, 0x7F7FFFFF]
    keys = torch.cat([torch.randint(0, 0x7F800000, (400_000,), generator=gen), torch.tensor(edges)])
    keys = torch.cat([keys + d for d in (-1, 0, 1)]).clamp(0, 0x7F7FFFFF).to(torch.int32)
    out = torch.empty(keys.numel())
    host.host_scales(_ptr(keys), ctypes.c_longlong(keys.numel()), bits, GRIDS[grid], _ptr(out))
    half = 2.0 ** (bits - 1)
    divisor = torch.tensor(half - 0.5 if grid == "midrise" else half - 1.0)
    want = keys.view(torch.float32) / divisor
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))


def test_fast_divisor_matches_integer_division(host):
    """loco::FastDivisor (the kernels' division of a (row, group) index by the groups per row, and of a slot by the
    node count) equals n // d for every n < 2^31: divisors 1 .. 4096, powers of two and their neighbours up to 2^30,
    and n at 0, around multiples of d and at 2^31 - 1."""
    host.host_divide.restype = ctypes.c_uint
    gen = torch.Generator().manual_seed(7)
    divisors = list(range(1, 4097)) + [p + e for p in (2 ** k for k in range(12, 31)) for e in (-1, 0, 1)]
    for d in divisors:
        ns = [0, d - 1, d, d + 1, 2 ** 31 - 1, (2 ** 31 - 1) // d * d, (2 ** 31 - 1) // d * d - 1]
        ns += torch.randint(0, 2 ** 31, (8,), generator=gen).tolist()
        for n in ns:
            n = max(0, min(n, 2 ** 31 - 1))
            assert host.host_divide(n, d) == n // d, (n, d)


def test_host_bf16_rounding_matches_torch(host):
    gen = torch.Generator().manual_seed(7)
    x = torch.cat([torch.randn(100000, generator=gen) * 10.0 ** torch.randint(-40, 38, (100000,), generator=gen),
                   torch.tensor([float("inf"), -float("inf"), 3.4e38, 1e-45, -0.0, 0.0])])
    out = torch.empty(x.numel(), dtype=torch.int16)
    host.host_to_bf16(_ptr(x), ctypes.c_longlong(x.numel()), _ptr(out))
    assert torch.equal(out, x.to(torch.bfloat16).view(torch.int16))


def test_host_hadamard_signs_match_the_reference(host):
    """The kernels' signs (fmix32, also the compile-time sign table) are the reference's for the largest group."""
    from deepspeed_loco.ops.hadamard import hadamard_signs
    out = torch.empty(4096)
    host.host_hadamard_signs(ctypes.c_longlong(4096), _ptr(out))
    signs = hadamard_signs(4096)
    assert torch.equal(out, signs) and 1500 < int((signs < 0).sum()) < 2600


def test_builder_finds_its_sources_and_strips_fast_math(monkeypatch):
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder

    from deepspeed_loco.ops.op_builder import LocoBuilder
    builder = LocoBuilder()
    assert (builder.NAME, builder.BUILD_VAR) == ("loco_ops", "DS_BUILD_LOCO")
    assert builder.absolute_name() == "deepspeed_loco.ops.loco_ops"
    sources = builder.sources()
    assert [s.rsplit("/", 1)[-1] for s in sources] == ["loco_kernels.cu", "loco_kernels_own.cu", "loco_binding.cpp"]
    for source in sources + builder.include_paths():
        assert source.startswith("/")
    folder = sources[0].rsplit("/", 1)[0]
    kernels = "".join(open(f"{folder}/{name}").read()
                      for name in ("loco_kernels.cu", "loco_kernels_own.cu", "loco_kernels.cuh", "loco_formats.h",
                                   "loco_limits.h"))
    assert "#include <torch" not in kernels and "ATen" not in kernels
    monkeypatch.setattr(CUDAOpBuilder, "nvcc_args", lambda self: ["-O3", "--use_fast_math", "-std=c++20"])
    args = builder.nvcc_args()
    assert "--use_fast_math" not in args and "-fmad=false" in args and "-ftz=false" in args


def test_dispatcher_uses_the_reference_on_cpu_and_logs_one_line(caplog):
    library._reset()
    with caplog.at_level(logging.INFO, logger="deepspeed_loco"):
        for _ in range(3):
            assert ops.kernels_for(torch.device("cpu")) is ops.REFERENCE  # the ops; off CUDA they run the reference
        assert ops.kernels_for("cpu", "cuda") is ops.REFERENCE
    lines = [r.getMessage() for r in caplog.records if r.name == "deepspeed_loco"]
    assert len(lines) == 1 and "reference" in lines[0] and "cpu" in lines[0], lines
    library._reset()


def test_dispatcher_environment_variable(monkeypatch, caplog):
    library._reset()
    monkeypatch.setenv("DS_LOCO_KERNELS", "reference")
    with caplog.at_level(logging.INFO, logger="deepspeed_loco"):
        assert ops.kernels_for(torch.device("cuda"), "cuda") is ops.REFERENCE  # no build attempted
    assert any("DS_LOCO_KERNELS=reference" in r.getMessage() for r in caplog.records)
    assert any("overrides zeropp_loco_param.kernels='cuda'" in r.getMessage() for r in caplog.records)
    library._reset()
    monkeypatch.setenv("DS_LOCO_KERNELS", "fastest")
    with pytest.raises(ValueError, match="DS_LOCO_KERNELS"):
        ops.kernels_for(torch.device("cuda"))
    library._reset()


def test_dispatcher_config_key(monkeypatch, caplog):
    """``zeropp_loco_param.kernels`` chooses without the environment variable: "reference" takes no build, an invalid
    mode names the key, and "cuda" without the extension is an error (the build fails on a machine without CUDA)."""
    monkeypatch.delenv("DS_LOCO_KERNELS", raising=False)
    library._reset()
    with caplog.at_level(logging.INFO, logger="deepspeed_loco"):
        assert ops.kernels_for(torch.device("cuda"), "reference") is ops.REFERENCE
    assert any("zeropp_loco_param.kernels=reference" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="zeropp_loco_param.kernels"):
        ops.kernels_for("cpu", "fastest")
    library._reset()
    monkeypatch.setattr(library, "_cuda_load_error", lambda: OSError("no nvcc"))
    with pytest.raises(RuntimeError, match="zeropp_loco_param.kernels=cuda"):
        ops.kernels_for(torch.device("cuda"), "cuda")
    with caplog.at_level(logging.INFO, logger="deepspeed_loco"):
        assert ops.kernels_for(torch.device("cuda"), "auto") is ops.REFERENCE
    assert any("did not build or load (OSError: no nvcc)" in r.getMessage() for r in caplog.records)
    library._reset()


@pytest.mark.parametrize("world", [1, 2, 4, 8, 16, 64, 1024, 2 ** 20, 2 ** 30])
def test_mean_by_a_power_of_two_world_is_the_product_by_its_reciprocal(world):
    """The final kernel divides by W = 2^j as a product by 2^-j (deepspeed_loco/csrc/quantization/README.md, "What limits each kernel"): both
    round the same real number once, so the bits agree on every input, subnormal results and signed zeros included."""
    gen = torch.Generator().manual_seed(world)
    bits = torch.randint(-2 ** 31, 2 ** 31, (400000,), generator=gen, dtype=torch.int64).to(torch.int32)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-45, -1e-45, 3.4e38, 1.1754942e-38,
                            2.0 ** -126 * 3, -(2.0 ** -140) * 5])
    x = torch.cat([bits.view(torch.float32), special])
    x = x[~x.isnan()]
    quotient = x / torch.full_like(x, float(world))
    product = x * (1.0 / world)
    assert torch.equal(quotient.view(torch.int32), product.view(torch.int32))
