"""Step time of a real DeepSpeed ZeRO-3 engine with each way of reducing gradients (issue 23, deliverable 3).

Trains the bundled Llama-style byte model (``loco_lab.model.ByteLlama``) on random tokens under ZeRO-3, one arm
after another in the same processes, each from the same initial weights and on the same batches:

``zero3``
    ZeRO-3 with DeepSpeed's reduce-scatter in the communication dtype (``--dtype``, default bf16), no qgZ.
``dsqgz``
    DeepSpeed's own ZeRO++ qgZ (``zero_quantized_gradients: true``, without this package). DeepSpeed takes its
    quantized all-to-all path only when it counts more than one node (``world_size // device_count() > 1``, in
    ``stage3.py``'s ``__avg_scatter_grads``); otherwise, e.g. on one GPU or on one 8-GPU node, it falls back to
    the same reduce-scatter as ``zero3``. Which path ran is read from the profile (all-to-alls or not) and
    reported beside the one DeepSpeed's rule predicts. Its kernels read every gradient as fp16 whatever its dtype
    (``benchmarks/kernels.py``), so with bf16 its qgZ path is expected to fail the gradient check below.
``plain``
    Ours: ``deepspeed_loco.initialize`` with ``zeropp_loco_param`` and ``error_feedback: false`` (``--bits``).
``loco``
    Ours with LoCo error feedback (int8 error buffers).
``loco_rho`` (only when named in ``--arms``)
    ``loco`` with the live rho measured every ``--rho-every`` optimizer steps (default 1: every step, the worst
    case; ``zeropp_loco_param.rho_every`` defaults to 10). ``plain`` and ``loco`` run with the live rho off
    (``rho_every: 0``), so ``loco_rho``'s step time over ``loco``'s is its overhead.

Per arm (every time the maximum over ranks): the median step time in seconds over the timed steps (of every round
with ``--rounds R``: the arms run R times, each round in an order rotated by one, and each round's median is
reported too, so that a machine that drifts during the run shows as a spread instead of biasing one arm), tokens per
second, peak memory (``torch.cuda.max_memory_allocated`` on CUDA, reset per arm; on CPU the process's peak RSS
from ``resource``, which is never reset, so compare CPU arms' memory with care), and from ``torch.profiler``
over ``--profile-steps`` further steps the seconds per step of each collective (all_to_all, reduce_scatter,
all_gather, all_reduce: the NCCL kernels on CUDA, the host time of the ``c10d::`` calls on CPU) and of each range
of our reduce (``deepspeed_loco.<hop>.<kernel>``, the kernel entry points of ``deepspeed_loco/ops/library.py``
and ``loco_reference.py`` and each hop's all-to-all; see ``LocoReducer``). With one rank our reduce has no hop at
all, so those ranges are absent: the kernels' own times are ``benchmarks/kernels.py``'s. The profile also splits
the host's side of a step (on CUDA): the GPU's busy time, the host's time waiting in CUDA synchronizations and the
kernel launches per step, beside the profiled steps' wall time, so that a host-bound step's host work (the wall
time less the waits) can be fitted per arm and per launch.

Gradient check: the first step's gradient partitions of every arm are compared with the ``zero3`` arm's (same
seed, same batch). Per parameter the bound is the one ``tests/unit/simulation/test_train.py``
(``test_plain_mean_is_within_the_two_hops_half_steps``) proves for two quantized hops, ``A/(2 q1) + A (1 + 1/(2
q1))/(2 q2)`` with ``q = 2^(bits-1) - 1`` and ``A`` the largest magnitude of the parameter's gradient on any rank
(measured by a gradient hook in that step), plus ``W`` roundings of the communication dtype, ``W eps A``
(``torch.finfo(dtype).eps``) for the reference's own reduce-scatter and our output. LoCo's error buffers are zero at
the first step, so LoCo is held to plain's bound. With one rank nothing is quantized or reduced and every arm's
gradients must be bit-identical to ``zero3``'s (bound 0).

Launch it like any DeepSpeed script; it runs unchanged on one process (no RANK/WORLD_SIZE: it starts a world of 1
itself), on N GPUs and on several nodes (NCCL), and on CPU with gloo and our PyTorch reference kernels:

    python3 benchmarks/gpu_e2e.py --size 125m --out results.json                  # one GPU, world size 1
    torchrun --nproc_per_node 8 benchmarks/gpu_e2e.py --size 1b --out results.json
    deepspeed --num_nodes 2 --num_gpus 8 benchmarks/gpu_e2e.py --size 1b --out results.json
    DS_ACCELERATOR=cpu LOCAL_SIZE=4 torchrun --nproc_per_node 4 benchmarks/gpu_e2e.py --size tiny --steps 3 \\
        --local-world-size 2          # CPU: ours as 2 nodes x 2; DeepSpeed counts one node (LOCAL_SIZE) and
                                      # reduce-scatters (its qgZ kernels are CUDA-only)

On the device (one H200, torch 2.11 CUDA, DeepSpeed's wheel carried in ``.whl/``, built by
``benchmarks/device_wheelhouse.sh``), one call: ``OUT=$OUT bash benchmarks/device_gpu_e2e.sh --steps 20``, which runs

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0                    # DeepSpeed 0.19.8 cannot parse 9.0a
    python3 -c "from deepspeed_loco.ops import loco_cuda; loco_cuda.load()"      # build our kernels once
    python3 benchmarks/gpu_e2e.py --size 125m --micro-batch 16 --steps 20 \\
        --out $OUT/results_125m.json --table $OUT/table_125m.txt
    python3 benchmarks/gpu_e2e.py --size 1b --micro-batch 8 --steps 20 \\
        --out $OUT/results_1b.json --table $OUT/table_1b.txt
"""
import argparse
import contextlib
import dataclasses
import gc
import json
import os
import platform
import resource
import statistics
import sys
import time
import weakref
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch.autograd import DeviceType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deepspeed_loco.runtime.comm.loco_reduce import RANGE_PREFIX  # noqa: E402
from loco_lab.model import SIZES, VOCAB, ByteLlama, ModelConfig, count_parameters  # noqa: E402

ARMS = ("zero3", "dsqgz", "plain", "loco", "loco_rho")  # run in this order: zero3 first, the gradient check's reference
DEFAULT_ARMS = ARMS[:4]  # loco_rho runs when named
OURS = ("plain", "loco", "loco_rho")  # the arms that run deepspeed_loco
CONFIGS = {
    **SIZES,  # tiny ... 125m (116.4M parameters, context 256)
    "350m": ModelConfig(layers=28, dim=1024, heads=16, seq_len=1024),  # 354.7M parameters
    "1b": ModelConfig(layers=20, dim=2048, heads=16, seq_len=1024),  # 1009.1M
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BITS = (2, 3, 4, 8)
# a collective's kind from its event name (lower case, underscores dropped): NCCL kernels on CUDA (all-to-all runs
# as SendRecv kernels), c10d calls on CPU
COLLECTIVES = {"all_to_all": ("alltoall", "sendrecv"), "reduce_scatter": ("reducescatter", ),
               "all_gather": ("allgather", ), "all_reduce": ("allreduce", )}
# CUDA runtime calls in which the host waits for the GPU to catch up (``.item()`` and D2H copies synchronize), and
# those that launch a kernel: the host-side split of a step that the cluster model's host term is fitted from
HOST_WAIT_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
KERNEL_LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
PROFILE_SECONDS = ("gpu_busy_s", "host_wait_s", "profiled_step_s")  # a profile's per-step times besides its tables
ENGINES = weakref.WeakSet()  # every engine built here: an arm starts with none of the earlier arms' still alive


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The command line, validated; a bad value is an error naming the flag and what is valid."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="125m", choices=sorted(CONFIGS), help="named model size (default 125m)")
    parser.add_argument("--layers", type=int, help="override the size's number of layers")
    parser.add_argument("--dim", type=int, help="override the size's hidden size")
    parser.add_argument("--heads", type=int, help="override the size's attention heads (must divide --dim)")
    parser.add_argument("--seq-len", type=int, help="override the size's sequence length (tokens per sample)")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                        help=f"comma-separated subset of {','.join(ARMS)} (default {','.join(DEFAULT_ARMS)})")
    parser.add_argument("--micro-batch", type=int, default=8, help="samples per rank per step (default 8)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per arm (default 10)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps per arm before the timed ones, the first checks gradients (default 2)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every arm this many times, round r in the arm order rotated by r, so that a drift "
                             "of the machine over the run spreads over every arm (default 1)")
    parser.add_argument("--profile-steps", type=int, default=2,
                        help="steps per arm under torch.profiler after the timed ones (default 2)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="training dtype (default bf16)")
    parser.add_argument("--bits", default="4/4", help="ours: intra/inter-node gradient bits, each of "
                        f"{', '.join(map(str, BITS))} (default 4/4, DeepSpeed's)")
    parser.add_argument("--group-size", type=int, default=256, help="ours: elements per quantization group")
    parser.add_argument("--rho-every", type=int, default=1,
                        help="loco_rho: measure the live rho every this many optimizer steps (default 1)")
    parser.add_argument("--local-world-size", type=int,
                        help="ours: ranks per node (default: the launcher's); set it to simulate nodes")
    parser.add_argument("--overlap-comm", default="on", choices=("on", "off"),
                        help="ZeRO's overlap_comm: reduce on a side stream while backward runs (default on, ZeRO-3's)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the results as JSON to this path (rank 0)")
    parser.add_argument("--table", help="also write the printed report to this path (rank 0)")
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # the deepspeed launcher's
    args = parser.parse_args(argv)
    args.arms = _parse_arms(parser, args.arms)
    args.bits = _parse_bits(parser, args.bits)
    for flag in ("layers", "dim", "heads", "seq_len", "micro_batch", "steps", "warmup", "rounds", "local_world_size",
                 "rho_every"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} {value} is invalid: it must be an integer >= 1")
    if args.profile_steps < 0:
        parser.error(f"--profile-steps {args.profile_steps} is invalid: it must be an integer >= 0")
    args.model = model_config(parser, args)
    return args


def _parse_arms(parser: argparse.ArgumentParser, text: str) -> List[str]:
    """``--arms`` as a list in :data:`ARMS` order."""
    names = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in names if a not in ARMS]
    if unknown or not names:
        parser.error(f"--arms {text!r} is invalid: give a comma-separated subset of {', '.join(ARMS)}")
    return [a for a in ARMS if a in names]


def _parse_bits(parser: argparse.ArgumentParser, text: str) -> tuple:
    """``--bits "8/2"`` -> ``(8, 2)``."""
    try:
        intra, inter = (int(b) for b in text.split("/"))
    except ValueError:
        intra = inter = None
    if intra not in BITS or inter not in BITS:
        parser.error(f"--bits {text!r} is invalid: it must be INTRA/INTER with each of {', '.join(map(str, BITS))}")
    return intra, inter


def model_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ModelConfig:
    """The named ``--size`` with the ``--layers/--dim/--heads/--seq-len`` overrides applied."""
    overrides = {field: getattr(args, field) for field in ("layers", "dim", "heads", "seq_len")
                 if getattr(args, field) is not None}
    cfg = dataclasses.replace(CONFIGS[args.size], **overrides)
    if cfg.dim % cfg.heads or (cfg.dim // cfg.heads) % 2:
        parser.error(f"--dim {cfg.dim} / --heads {cfg.heads} is invalid: the head size dim/heads must be an even "
                     f"integer")
    return cfg


def init_world() -> torch.device:
    """Joins the launcher's process group (``RANK``/``WORLD_SIZE`` set by torchrun or deepspeed), or starts a world
    of 1 on this machine if they are unset; the backend is the accelerator's (NCCL on CUDA, gloo on CPU). Returns
    this rank's device."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from torch.distributed.elastic.utils.distributed import get_free_port

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(get_free_port()))
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        # DeepSpeed's CPU backend JIT-builds a shared-memory all-reduce op only its inference path uses (minutes)
        import deepspeed.ops
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    else:
        accelerator.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(auto_mpi_discovery=False, verbose=False)
    return torch.device(accelerator.current_device_name())


def ds_qgz_expected() -> bool:
    """Whether DeepSpeed's ``zero_quantized_gradients`` takes its quantized all-to-all path in this world: its own
    rule, more than one node counting ``device_count()`` ranks per node (``LOCAL_SIZE`` on CPU)."""
    from deepspeed.accelerator import get_accelerator
    return dist.get_world_size() // get_accelerator().device_count() > 1


def ds_config(arm: str, args: argparse.Namespace) -> dict:
    """The DeepSpeed config of ``arm``: ZeRO-3 (``--overlap-comm``), torch's AdamW, ``--dtype``; qgZ for dsqgz,
    plain and loco, and our ``zeropp_loco_param`` block for plain (no error feedback), loco and loco_rho (the live
    rho every ``--rho-every`` steps; off in the other two)."""
    zero = {"stage": 3, "overlap_comm": args.overlap_comm == "on", "contiguous_gradients": True}
    if arm != "zero3":
        zero["zero_quantized_gradients"] = True
    if arm in OURS:
        zero["zeropp_loco_param"] = {"error_feedback": arm != "plain", "intra_node_bits": args.bits[0],
                                     "inter_node_bits": args.bits[1], "group_size": args.group_size,
                                     "local_world_size": args.local_world_size,
                                     "rho_every": args.rho_every if arm == "loco_rho" else 0, "rho_log_every": 0}
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "torch_adam": True}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    if args.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif args.dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 16}
    return config


def random_batch(args: argparse.Namespace, step: int, device: torch.device):
    """``(x, y)`` random bytes for this rank at ``step``: the same in every arm (seeded by seed, step and rank)."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 4099 + dist.get_rank())
    tokens = torch.randint(0, VOCAB, (args.micro_batch, args.model.seq_len + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def build_engine(arm: str, args: argparse.Namespace) -> tuple:
    """``(engine, parameters)``: a fresh model (seeded: the same weights in every arm) under a ZeRO-3 engine for
    ``arm``, and its number of parameters."""
    import deepspeed
    import deepspeed_loco
    torch.manual_seed(args.seed)
    model = ByteLlama(args.model)
    parameters = count_parameters(model)
    initialize = deepspeed_loco.initialize if arm in OURS else deepspeed.initialize
    engine, _, _, _ = initialize(model=model, model_parameters=model.parameters(), config=ds_config(arm, args))
    if arm in OURS and deepspeed_loco.loco_hook(engine) is None:
        raise RuntimeError(f"arm {arm}: deepspeed_loco.initialize returned an engine without a LoCo hook")
    ENGINES.add(engine)
    return engine, parameters


def release_engine(engine) -> None:
    """Lets ``engine`` (parameters, optimizer states, hooks) be freed once the caller drops it. DeepSpeed's
    ZeRO-3 (0.19.8) keeps two references that ``destroy()`` leaves: each engine's module in
    ``parameter_offload.FWD_MODULE_STACK``, a module-level list, and, from the second step on, its parameter
    coordinator and modules as keys of the class-level ``functools.lru_cache`` of
    ``PartitionedParameterCoordinator.__params_to_release``. Without clearing both, every engine stayed alive for
    the rest of the process, so later arms ran beside earlier arms' memory (a second round at 1b ran out of an
    H100's) and a larger heap for the garbage collector to walk."""
    from deepspeed.runtime.zero import parameter_offload, partitioned_param_coordinator
    module = engine.module
    if hasattr(engine, "destroy"):
        engine.destroy()
    stack = getattr(parameter_offload, "FWD_MODULE_STACK", [])
    stack[:] = [m for m in stack if m is not module]
    method = getattr(partitioned_param_coordinator.PartitionedParameterCoordinator,
                     "_PartitionedParameterCoordinator__params_to_release", None)
    # the cache itself, or the function DeepSpeed's nvtx wrapper closes over
    for candidate in [method] + [cell.cell_contents for cell in getattr(method, "__closure__", None) or ()]:
        if hasattr(candidate, "cache_clear"):
            candidate.cache_clear()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(engine, batch) -> None:
    loss = engine(*batch)
    engine.backward(loss)
    engine.step()


@contextlib.contextmanager
def deterministic_kernels():
    """Deterministic kernels inside the block, the previous settings after it: two identical steps must give
    bit-identical gradients. Strict (``warn_only=False``): attention's backward (flash, cuDNN) accumulates with
    atomics unless determinism is required outright, and cuDNN's then picks a deterministic algorithm; with
    ``warn_only=True`` the 1b model (sequence 1024) gave zero3 two different gradients in two runs on the H200. An op
    with no deterministic kernel raises, naming itself. New tensors stay uninitialized, as in the timed steps."""
    from torch.utils import deterministic
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        deterministic.fill_uninitialized_memory = fill


def first_step_gradients(engine, batch) -> tuple:
    """Runs one step (with :func:`deterministic_kernels`); returns ``(partitions, absmax)`` per parameter name: this
    rank's fp32 partition of the reduced (mean) gradient before the optimizer step (on the CPU), and the largest
    magnitude of the parameter's local gradient on any rank (a float)."""
    from deepspeed.utils import safe_get_local_grad
    named = list(engine.module.named_parameters())
    absmax = {}
    handles = [param.register_hook(lambda grad, name=name: absmax.__setitem__(name, grad.abs().max().item()))
               for name, param in named]
    with deterministic_kernels():
        loss = engine(*batch)
        engine.backward(loss)
    for handle in handles:
        handle.remove()
    partitions = {name: safe_get_local_grad(param).detach().float().cpu() for name, param in named}
    engine.step()
    tops = [None] * dist.get_world_size()
    dist.all_gather_object(tops, absmax)
    return partitions, {name: max(top[name] for top in tops) for name, _ in named}


def gradient_bound(absmax: float, world: int, bits: tuple, dtype: torch.dtype, quantized: bool) -> float:
    """The largest difference allowed between an arm's and zero3's first-step mean gradient of a parameter whose
    local gradients reach magnitude ``absmax``, in the gradient's units: 0 with one rank; else the two hops' half
    steps (``bits`` intra/inter, when the arm ``quantized``) plus ``world`` roundings of ``dtype`` (module
    docstring)."""
    if world == 1:
        return 0.0
    bound = world * torch.finfo(dtype).eps * absmax
    if quantized:
        q1, q2 = (2**(b - 1) - 1 for b in bits)
        bound += absmax / (2 * q1) + absmax * (1 + 1 / (2 * q1)) / (2 * q2)
    return bound


def compare_gradients(arm: str, got: Dict[str, torch.Tensor], reference: Dict[str, torch.Tensor],
                      absmax: Dict[str, float], args: argparse.Namespace, quantized: bool) -> dict:
    """``arm``'s first-step gradient partitions against zero3's, over all ranks: the largest difference, the largest
    ratio of a parameter's difference to its bound, and whether every parameter is within its bound."""
    world = dist.get_world_size()
    bits = (4, 4) if arm == "dsqgz" else args.bits
    worst = {"max_abs_diff": 0.0, "max_diff_over_bound": 0.0, "worst_parameter": None, "passed": True}
    for name, reference_grad in reference.items():
        diff = float((got[name] - reference_grad).abs().max()) if reference_grad.numel() else 0.0
        bound = gradient_bound(absmax[name], world, bits, DTYPES[args.dtype], quantized)
        ratio = diff / bound if bound > 0 else (0.0 if diff == 0 else float("inf"))
        worst["passed"] &= diff <= bound
        worst["max_abs_diff"] = max(worst["max_abs_diff"], diff)
        if ratio >= worst["max_diff_over_bound"]:
            worst["max_diff_over_bound"], worst["worst_parameter"] = ratio, name
    ranks = [None] * world
    dist.all_gather_object(ranks, worst)
    merged = max(ranks, key=lambda r: r["max_diff_over_bound"])
    return dict(merged, passed=all(r["passed"] for r in ranks), bits=list(bits) if quantized else None,
                rule="bit-identical (one rank: nothing is quantized or reduced)" if world == 1 else
                "|diff| <= A/(2 q1) + A (1 + 1/(2 q1))/(2 q2) + W eps A" if quantized else "|diff| <= W eps A")


def collective_kind(name: str) -> Optional[str]:
    """The collective an event of this name belongs to (a key of :data:`COLLECTIVES`), or None."""
    flat = name.lower().replace("_", "")
    return next((kind for kind, marks in COLLECTIVES.items() if any(m in flat for m in marks)), None)


def profile_seconds(prof, steps: int, on_cuda: bool) -> dict:
    """Seconds per step from a ``torch.profiler`` run over ``steps`` steps: ``collectives`` (time and calls per
    kind: NCCL kernels' device time on CUDA, ``c10d::`` calls' host time on CPU) and ``loco`` (per range of our
    reduce, the name after ``deepspeed_loco.``: its kernels' device time on CUDA, its host time on CPU) and
    ``gpu_busy_s``: the device time of every kernel (on CUDA; None on CPU), which beside the step time says whether
    the step waits for the GPU or for the host (kernels on concurrent streams count each); on CUDA also
    ``host_wait_s``, the host's seconds per step inside :data:`HOST_WAIT_CALLS`, and ``kernel_launches`` per step
    (None on CPU)."""
    collectives = {kind: {"s": 0.0, "calls": 0} for kind in COLLECTIVES}
    loco = {}
    busy_micros = wait_micros = launches = 0.0
    for event in prof.key_averages():
        name = event.key
        if on_cuda and event.device_type != DeviceType.CPU:
            busy_micros += event.self_device_time_total
        if on_cuda and name in HOST_WAIT_CALLS:
            wait_micros += event.cpu_time_total
        if on_cuda and name in KERNEL_LAUNCH_CALLS:
            launches += event.count
        if name.startswith(RANGE_PREFIX) and event.device_type == DeviceType.CPU:
            micros = event.device_time_total if on_cuda else event.cpu_time_total
            loco[name[len(RANGE_PREFIX):]] = micros * 1e-6 / steps
            continue
        if on_cuda:  # the kernels themselves, not the host-side "nccl:..." records around their launch
            is_kernel = event.device_type != DeviceType.CPU and name.lower().startswith("nccl")
            micros = event.self_device_time_total if is_kernel else None
        else:
            micros = event.cpu_time_total if name.startswith("c10d::") else None
        kind = collective_kind(name) if micros is not None else None
        if kind is not None:
            collectives[kind]["s"] += micros * 1e-6 / steps
            collectives[kind]["calls"] += event.count
    return {"collectives": collectives, "loco": dict(sorted(loco.items())),
            "gpu_busy_s": busy_micros * 1e-6 / steps if on_cuda else None,
            "host_wait_s": wait_micros * 1e-6 / steps if on_cuda else None,
            "kernel_launches": launches / steps if on_cuda else None}


def profile_steps(engine, args: argparse.Namespace, first_step: int, device: torch.device) -> dict:
    """Runs ``--profile-steps`` steps under ``torch.profiler``; :func:`profile_seconds` of them ({} for none),
    with ``profiled_step_s``: their wall seconds per step, the profiler's own host overhead included."""
    if args.profile_steps == 0:
        return {}
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        synchronize(device)
        start = time.perf_counter()
        for step in range(first_step, first_step + args.profile_steps):
            train_step(engine, random_batch(args, step, device))
        synchronize(device)
        profiled_step_s = (time.perf_counter() - start) / args.profile_steps
    return {**profile_seconds(prof, args.profile_steps, device.type == "cuda"), "profiled_step_s": profiled_step_s}


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank in bytes: allocated CUDA memory since the last reset, or on CPU the process's peak
    resident set (Linux reports it in KiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def max_over_ranks(values: List[float]) -> List[float]:
    """Element-wise maximum of ``values`` over all ranks."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, list(values))
    return [max(column) for column in zip(*gathered)]


def merge_profiles(profile: dict) -> dict:
    """The maximum over ranks of every time in a :func:`profile_steps` result (calls and launches: rank 0's)."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, profile)
    if not profile:
        return {}
    merged = json.loads(json.dumps(profile))
    for other in gathered:
        for kind, entry in other["collectives"].items():
            merged["collectives"][kind]["s"] = max(merged["collectives"][kind]["s"], entry["s"])
        for name, seconds in other["loco"].items():
            merged["loco"][name] = max(merged["loco"].get(name, 0.0), seconds)
        for key in PROFILE_SECONDS:
            if other[key] is not None:
                merged[key] = max(merged[key], other[key])
    return merged


def run_arm(arm: str, args: argparse.Namespace, device: torch.device, reference: Optional[dict]) -> tuple:
    """Trains ``arm``; returns ``(result, gradients)``: the arm's measurements (complete on every rank) and its
    first-step ``(partitions, absmax)`` (:func:`first_step_gradients`), zero3's being the check's reference."""
    from deepspeed_loco.ops import kernels_for
    engines_alive = len(ENGINES)  # earlier arms' engines not freed (expected 0: release_engine)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    engine, parameters = build_engine(arm, args)
    gradients = first_step_gradients(engine, random_batch(args, 0, device))
    for step in range(1, args.warmup):
        train_step(engine, random_batch(args, step, device))
    times = []
    for step in range(args.warmup, args.warmup + args.steps):
        batch = random_batch(args, step, device)
        synchronize(device)
        start = time.perf_counter()
        train_step(engine, batch)
        synchronize(device)
        times.append(time.perf_counter() - start)
    profile = merge_profiles(profile_steps(engine, args, args.warmup + args.steps, device))
    times = max_over_ranks(times)  # a step takes as long as its slowest rank
    peak, = max_over_ranks([peak_memory_bytes(device)])
    step_s = statistics.median(times)
    world = dist.get_world_size()
    result = {
        "arm": arm,
        "parameters": parameters,
        "step_s": step_s,
        "step_times_s": times,
        "tokens_per_s": args.micro_batch * args.model.seq_len * world / step_s,
        "peak_memory_bytes": int(peak),
        "communication_dtype": str(engine.communication_data_type).replace("torch.", ""),
        "profile": profile,
        "engines_alive_at_start": engines_alive,
    }
    if arm in OURS:
        result["loco_kernels"] = kernels_for(device).name
    quantized = world > 1 and arm in OURS
    if arm == "dsqgz":
        result["ds_path"] = ds_path(profile)
        quantized = world > 1 and "qgz" in (result["ds_path"]["ran"], result["ds_path"]["expected"])
    if reference is not None:
        result["gradient_check"] = compare_gradients(arm, gradients[0], reference[0], gradients[1], args, quantized)
    release_engine(engine)
    del engine
    gc.collect()  # the next arm's peak memory starts from what this one leaves
    return result, gradients


def rotated(arms: List[str], round_index: int) -> List[str]:
    """``arms`` in the order of round ``round_index``: rotated left by it (round 0: as given, zero3 first)."""
    shift = round_index % len(arms)
    return arms[shift:] + arms[:shift]


def merge_rounds(rounds: List[dict]) -> dict:
    """One arm's :func:`run_arm` results of every round as one: all timed steps and their median, each round's
    median (``round_step_s``: how far the machine drifted between rounds), the largest peak memory and count of
    earlier engines alive at an arm's start, the first round's profile, and the first failing gradient check
    (else the first; zero3's later rounds are checked against its first, so zero3 has one from the second round
    on)."""
    merged = dict(rounds[0])
    times = [t for r in rounds for t in r["step_times_s"]]
    step_s = statistics.median(times)
    merged.update(step_times_s=times, step_s=step_s, round_step_s=[r["step_s"] for r in rounds],
                  tokens_per_s=rounds[0]["tokens_per_s"] * rounds[0]["step_s"] / step_s,
                  peak_memory_bytes=max(r["peak_memory_bytes"] for r in rounds),
                  engines_alive_at_start=max(r["engines_alive_at_start"] for r in rounds))
    checks = [r["gradient_check"] for r in rounds if "gradient_check" in r]
    if checks:
        merged["gradient_check"] = next((c for c in checks if not c["passed"]), checks[0])
    return merged


def ds_path(profile: dict) -> dict:
    """Which reduce DeepSpeed's qgZ arm took: ``expected`` by DeepSpeed's rule (:func:`ds_qgz_expected`) and ``ran``
    as the profile shows (all-to-alls: ``qgz``, none: ``reduce_scatter``; ``unknown`` without a profile)."""
    if profile:
        ran = "qgz" if profile["collectives"]["all_to_all"]["calls"] > 0 else "reduce_scatter"
    else:
        ran = "unknown (no profile: --profile-steps 0)"
    return {"expected": "qgz" if ds_qgz_expected() else "reduce_scatter", "ran": ran}


def check_ds_qgz_runs(args: argparse.Namespace, device: torch.device) -> None:
    """Refuses dsqgz where DeepSpeed would take its qgZ path without its kernels: they are CUDA-only."""
    if "dsqgz" in args.arms and device.type != "cuda" and ds_qgz_expected():
        raise SystemExit(f"--arms dsqgz: DeepSpeed counts {dist.get_world_size()} ranks as several nodes here and "
                         f"would run its qgZ kernels, which exist only on CUDA; on {device.type} set LOCAL_SIZE to "
                         f"the world size (DeepSpeed then reduce-scatters) or leave dsqgz out of --arms")


def environment(device: torch.device) -> dict:
    """Machine name, device, world and versions, for the report."""
    import deepspeed
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"machine": platform.node(), "device": name, "device_type": device.type,
            "world_size": dist.get_world_size(), "backend": dist.get_backend(), "torch": torch.__version__,
            "deepspeed": deepspeed.__version__, "cuda": torch.version.cuda}


def add_ratios(results: List[dict]) -> None:
    """Adds each arm's step time, tokens/s and peak memory over zero3's (measured in the same run)."""
    base = next((r for r in results if r["arm"] == "zero3"), None)
    for r in results:
        r["vs_zero3"] = None if base is None else {
            "step_s": r["step_s"] / base["step_s"], "tokens_per_s": r["tokens_per_s"] / base["tokens_per_s"],
            "peak_memory_bytes": r["peak_memory_bytes"] / base["peak_memory_bytes"]}


def format_report(report: dict) -> str:
    """The printed tables: one line per arm, then the profile's seconds per step."""
    env, model = report["environment"], report["model"]
    lines = [f"{env['machine']}: {env['device']} ({env['device_type']}), world {env['world_size']} "
             f"({env['backend']}), torch {env['torch']}, DeepSpeed {env['deepspeed']}",
             f"model {report['size']}: {model['parameters'] / 1e6:.1f}M parameters, {model['layers']} layers, dim "
             f"{model['dim']}, {model['heads']} heads, seq {model['seq_len']}; micro-batch {report['micro_batch']}, "
             f"{report['dtype']}, overlap_comm {report['overlap_comm']}, bits (ours) {report['bits']}",
             "", f"{'arm':<6} {'step ms':>9} {'x zero3':>8} {'tokens/s':>11} {'x zero3':>8} {'peak MiB':>9} "
             f"{'grad check':>28}"]
    for r in report["arms"]:
        ratio = r["vs_zero3"] or {}
        check = r.get("gradient_check")
        text = "reference" if r["arm"] == "zero3" else "n/a (no zero3 arm)" if check is None else (
            f"{'pass' if check['passed'] else 'FAIL'} "
            + ("(bit-identical)" if check["passed"] and env["world_size"] == 1 else
               f"(max {check['max_abs_diff']:.2e}, {check['max_diff_over_bound']:.2f}x bound)"))
        step_ratio, tokens_ratio = (f"{ratio[key]:.3f}" if ratio else "-" for key in ("step_s", "tokens_per_s"))
        lines.append(f"{r['arm']:<6} {r['step_s'] * 1e3:>9.2f} {step_ratio:>8} {r['tokens_per_s']:>11.0f} "
                     f"{tokens_ratio:>8} {r['peak_memory_bytes'] / 2**20:>9.0f} {text:>28}")
    if report["rounds"] > 1:
        lines += ["", f"median step of each of {report['rounds']} rounds (arm order rotated each round), ms:"]
        lines += [f"  {r['arm']:<6} " + ", ".join(f"{t * 1e3:.1f}" for t in r["round_step_s"]) for r in report["arms"]]
    if any(r["profile"] for r in report["arms"]):
        lines += ["", "profile, ms per step (" + ("NCCL kernels, our kernels' device time"
                                                 if env["device_type"] == "cuda" else "host time") + "):"]
    for r in report["arms"]:
        if not r["profile"]:
            continue
        parts = [f"{kind} {entry['s'] * 1e3:.2f}" for kind, entry in r["profile"]["collectives"].items()]
        parts += [f"{name} {seconds * 1e3:.3f}" for name, seconds in r["profile"]["loco"].items()]
        if r["profile"].get("gpu_busy_s") is not None:
            parts.append(f"GPU busy {r['profile']['gpu_busy_s'] * 1e3:.1f} of {r['step_s'] * 1e3:.1f}")
        if r["profile"].get("host_wait_s") is not None:
            parts.append(f"host waits {r['profile']['host_wait_s'] * 1e3:.1f} of the profiled "
                         f"{r['profile']['profiled_step_s'] * 1e3:.1f}, {r['profile']['kernel_launches']:.0f} launches")
        lines.append(f"  {r['arm']:<6} " + ", ".join(parts))
    for r in report["arms"]:
        if "ds_path" in r:
            lines.append(f"dsqgz: DeepSpeed's rule predicts {r['ds_path']['expected']}, the profile shows "
                         f"{r['ds_path']['ran']} (qgZ needs world_size // device_count() > 1)")
    leaked = [r["arm"] for r in report["arms"] if r["engines_alive_at_start"]]
    if leaked:
        lines.append(f"WARNING: {', '.join(leaked)} started beside earlier arms' engines still alive (memory and "
                     f"host time not those of a fresh process; see release_engine)")
    if env["world_size"] == 1:
        lines.append("one rank: nothing is quantized or communicated; every arm's gradients must equal zero3's "
                     "bit for bit, and LoCo's reduce runs no kernel")
    return "\n".join(lines)


def build_report(args: argparse.Namespace, device: torch.device, per_arm: Dict[str, List[dict]]) -> dict:
    """The report of the rounds every arm has finished (``rounds``: how many), each arm's rounds merged."""
    rounds = min(len(results) for results in per_arm.values())
    results = [merge_rounds(per_arm[arm][:rounds]) for arm in args.arms]
    add_ratios(results)
    model = dict(args.model.to_dict(), parameters=results[0]["parameters"])
    return {"environment": environment(device), "size": args.size, "model": model, "micro_batch": args.micro_batch,
            "steps": args.steps, "warmup": args.warmup, "rounds": rounds, "rounds_asked": args.rounds,
            "profile_steps": args.profile_steps, "dtype": args.dtype, "overlap_comm": args.overlap_comm,
            "bits": "/".join(map(str, args.bits)), "group_size": args.group_size, "arms": results,
            "gradient_check_passed": all(r.get("gradient_check", {"passed": True})["passed"] for r in results)}


def save_report(args: argparse.Namespace, report: dict) -> str:
    """Writes ``--out`` (JSON) and ``--table`` (the printed tables) on rank 0; returns the tables."""
    text = format_report(report)
    if dist.get_rank() == 0:
        if args.table:
            Path(args.table).write_text(text + "\n")
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))
    return text


def main(argv: Optional[List[str]] = None) -> int:
    """Runs every arm of ``--arms`` ``--rounds`` times; after each round rank 0 rewrites ``--out`` and ``--table``
    with the rounds finished so far (a run stopped by a timeout keeps them), and at the end prints the report.
    Returns 0, or 1 when a gradient check failed."""
    args = parse_args(argv)
    # cuBLAS's deterministic workspace setting, which strict deterministic mode (the gradient check's step,
    # deterministic_kernels) requires on CUDA; read when the first cuBLAS handle is made, so set before any matmul
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = init_world()
    check_ds_qgz_runs(args, device)
    per_arm, reference = {arm: [] for arm in args.arms}, None
    for round_index in range(args.rounds):
        for arm in rotated(args.arms, round_index):
            result, gradients = run_arm(arm, args, device, reference)
            if arm == "zero3" and reference is None:
                reference = gradients
            per_arm[arm].append(result)
            dist.barrier()
        report = build_report(args, device, per_arm)
        text = save_report(args, report)
        if dist.get_rank() == 0 and round_index + 1 < args.rounds:
            print(f"round {round_index + 1} of {args.rounds} saved", flush=True)
    if dist.get_rank() == 0:
        print(text, flush=True)
    dist.destroy_process_group()
    return 0 if report["gradient_check_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
