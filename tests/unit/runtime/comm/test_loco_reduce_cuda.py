"""The LoCo reduce with CUDA tensors and the fused kernels against the CPU reference, in real processes.

Several processes share one GPU here (gloo carries the all-to-alls), so this runs on a one-GPU machine. With several
GPUs under NCCL, benchmarks/gpu_e2e.py runs the reduce inside real ZeRO-3 engines and checks its first-step gradients
against DeepSpeed's reduce-scatter within the quantizer's bound (not bit for bit against this reference). Skipped
without CUDA.
"""
import pytest
import torch

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.runtime.comm import noise_stats
from deepspeed_loco.runtime.comm.loco_reduce import LocoReducer
from deepspeed_loco.runtime.comm.topology import LocoTopology
from tests.unit.process_pool import ProcessPool

pytestmark = pytest.mark.gpu

SHAPES = [(7, ), (33, 5), (1000, 3), (256, 384)]
CASES = [  # dtype, intra bits, inter bits, hadamard, error_bits, exact_own_block
    (torch.bfloat16, 4, 4, False, 8, False),
    (torch.float16, 4, 4, False, 8, False),
    (torch.float32, 8, 2, False, 8, False),
    (torch.bfloat16, 3, 3, False, 32, False),
    (torch.bfloat16, 4, 4, True, 8, False),
    (torch.bfloat16, 2, 2, False, 4, False),
    (torch.float16, 8, 2, True, 4, False),
    (torch.bfloat16, 4, 4, False, 8, True),
    (torch.float16, 8, 2, True, 4, True),
]


def check_cuda_matches_cpu_reference(local_size, steps=3):
    """Returns (kernel module used for CUDA tensors, failures). The live rho's sums and sampled values (measured on
    the last step) of the fused kernels agree with the reference's to fp32 summation order (rtol 1e-5)."""
    from deepspeed_loco.ops import kernels_for
    torch.cuda.set_device(0)
    topo = LocoTopology.build(local_size=local_size)
    failures = []
    for dtype, intra, inter, hadamard, error_bits, own in CASES:
        cfg = LocoConfig(group_size=64, intra_node_bits=intra, inter_node_bits=inter, hadamard=hadamard,
                         error_bits=error_bits, exact_own_block=own)
        gen = torch.Generator().manual_seed(topo.rank)
        cpu_reducer, gpu_reducer = LocoReducer.for_topology(cfg, topo), LocoReducer.for_topology(cfg, topo)
        names = [f"p{i}" for i in range(len(SHAPES))]
        for step in range(steps):
            grads = [torch.randn(shape, generator=gen).to(dtype) for shape in SHAPES]
            if step == steps - 1:
                noise_stats.begin_measured_step(cpu_reducer, step)
                noise_stats.begin_measured_step(gpu_reducer, step)
            want = cpu_reducer.reduce_scatter(names, grads)
            got = gpu_reducer.reduce_scatter(names, [g.cuda() for g in grads])
            for shape, w, g in zip(SHAPES, want, got):
                if not torch.equal(w, g.cpu()):
                    failures.append(f"{dtype} {intra}/{inter} hadamard={hadamard} error_bits={error_bits} own={own} "
                                    f"step {step} {shape}: max diff {float((w.float() - g.cpu().float()).abs().max())}")
        sums = (noise_stats.end_measured_step(cpu_reducer, "cpu"),
                noise_stats.end_measured_step(gpu_reducer, "cuda").cpu())
        if not torch.allclose(sums[1], sums[0], rtol=1e-5, atol=0):
            failures.append(f"{dtype} {intra}/{inter} hadamard={hadamard} own={own}: noise sums {sums[1]} vs {sums[0]}")
    return kernels_for(torch.device("cuda")).name, failures


@pytest.fixture(scope="module")
def gpu_pool():
    pool = ProcessPool(4, extra_env={"DS_ACCELERATOR": "cuda"})
    yield pool
    pool.close()


@pytest.mark.parametrize("local", [2, 4, 1])
def test_cuda_reduce_is_bit_identical_to_the_cpu_reference(gpu_pool, local):
    results = gpu_pool.run(check_cuda_matches_cpu_reference, local)
    assert all(name.endswith("loco_cuda") for name, _ in results), [name for name, _ in results]
    assert [f for _, fails in results for f in fails] == []
