"""LoCo's error memory in a real DeepSpeed ZeRO-3 engine, per option, against the formula (issue 56, item 4).

Trains the demo's model (``loco_lab``: DeepSpeed worker processes, ``--nodes x --local`` ranks on this machine; on
one GPU they share it through gloo) for ``--steps`` steps with plain 2-bit qgZ, then with LoCo 2/2 under each
``--options`` entry (``FEEDBACK:BITS``: ``error_feedback`` true or inter_node, ``error_bits`` 4, 8 or 32), one launch
per option. Per option it prints the formula (the plan's exact bytes for the model's parameter tensors, padding
included, and the per-parameter rate of ``python -m deepspeed_loco.perf memory``), the bytes the engine's error
buffers hold, and on CUDA what training left allocated and its peak, each over what the engine held when ready
(the error buffers are created by the first step) and less the plain arm's: the memory LoCo itself adds. Every
number is the largest over ranks, in MB (1e6 bytes).

    python3 benchmarks/engine_error_memory.py                        # on one GPU: 8 ranks share it, the 116M model
    python3 benchmarks/engine_error_memory.py --device cpu --size tiny --nodes 2 --local 2 --steps 2   # anywhere
"""
import argparse
import dataclasses
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing

from deepspeed_loco.config import INTER_NODE_ONLY, LocoConfig  # noqa: E402
from deepspeed_loco.layout import plan_hops  # noqa: E402
from deepspeed_loco.runtime.comm.error_feedback import ErrorFeedbackState, error_bytes_per_parameter  # noqa: E402
from loco_lab.arms import RunSpec, parse_arm  # noqa: E402
from loco_lab.model import SIZES, ByteLlama  # noqa: E402

FEEDBACK = {"true": True, "inter_node": INTER_NODE_ONLY}
LABEL = {True: "true", INTER_NODE_ONLY: INTER_NODE_ONLY}
MB = 1e6


def parse_option(text: str) -> tuple:
    """``"FEEDBACK:BITS"`` -> ``(error_feedback, error_bits)``, e.g. ``"inter_node:4"`` -> ``("inter_node", 4)``."""
    feedback, _, bits = text.partition(":")
    if feedback not in FEEDBACK or bits not in ("4", "8", "32"):
        raise argparse.ArgumentTypeError(f"option {text!r}: must be FEEDBACK:BITS with FEEDBACK one of "
                                         f"{sorted(FEEDBACK)} and BITS 4, 8 or 32")
    return FEEDBACK[feedback], int(bits)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--options", nargs="+", type=parse_option,
                   default=[parse_option(o) for o in ("true:8", "true:4", "inter_node:8", "inter_node:4")])
    p.add_argument("--size", default=None, choices=sorted(SIZES), help="model (default: 125m on CUDA, tiny on CPU)")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--local", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--micro-batch", dest="micro_batch", type=int, default=2)
    p.add_argument("--group-size", dest="group_size", type=int, default=256)
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when there is a GPU")
    p.add_argument("--table", help="also write the table to this file")
    return p.parse_args(argv)


def tensor_numels(model_size: str) -> list:
    """Element counts of the demo model's parameter tensors, in order."""
    return [p.numel() for p in ByteLlama(SIZES[model_size]).parameters()]


def formula_bytes(numels, world: int, local: int, config: LocoConfig) -> tuple:
    """``(exact, rate)``: the plan's error bytes on one rank for parameter tensors of ``numels`` elements (padding
    included), and the per-parameter rate (bytes per parameter, no padding)."""
    state = ErrorFeedbackState(config, plan_hops(world, local, config))
    return sum(state.planned_bytes(n) for n in numels), error_bytes_per_parameter(world, local, config)


def grown(result: dict) -> tuple:
    """``(trained - ready, peak - ready)`` of an arm's CUDA memory in bytes; ``(None, None)`` off CUDA."""
    memory = result.get("cuda_memory_bytes")
    if memory is None:
        return None, None
    return memory["trained"] - memory["ready"], memory["peak"] - memory["ready"]


def table(size: str, numels: list, spec: RunSpec, plain: dict, rows: list) -> str:
    """The report: one row per ``(option, result)`` of ``rows`` against the ``plain`` arm's result; ``numels``: the
    model's parameter tensors' element counts (:func:`tensor_numels`)."""
    plain_trained, plain_peak = grown(plain)
    mb = lambda v: "n/a" if v is None else f"{v / MB:.2f}"  # noqa: E731
    lines = [f"model {size} ({plain['parameters'] / 1e6:.2f}M parameters), W = {spec.world_size} "
             f"({spec.nodes} x {spec.local}), {spec.device}, {spec.steps} steps of {spec.micro_batch} sequences a rank; "
             f"LoCo 2/2 per option, MB per rank (largest over ranks); added = LoCo arm - plain arm", "",
             "| option | B/param | formula, exact | rate x params | buffers held | held - exact (bytes) | trained, added "
             "| peak, added | trained added / formula |", "|---|---|---|---|---|---|---|---|---|"]
    for (feedback, bits), result in rows:
        config = LocoConfig(error_feedback=feedback, error_bits=bits, group_size=spec.group_size)
        exact, rate = formula_bytes(numels, spec.world_size, spec.local, config)
        trained, peak = grown(result)
        added = None if trained is None else trained - plain_trained
        added_peak = None if peak is None else peak - plain_peak
        ratio = "n/a" if added is None else f"{added / exact:.4f}"
        held = result["error_buffer_bytes"]
        lines.append(f"| {LABEL[feedback]}:{bits} | {rate:.4f} | {mb(exact)} | {mb(rate * sum(numels))} | {mb(held)} | "
                     f"{held - exact} | {mb(added)} | {mb(added_peak)} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    import torch
    from loco_lab.launcher import launch
    args = parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    size = args.size or ("125m" if device == "cuda" else "tiny")
    out = tempfile.mkdtemp(prefix="engine_error_memory_")
    spec = RunSpec(model=SIZES[size], arms=(), steps=args.steps, micro_batch=args.micro_batch, warmup=1,
                   group_size=args.group_size, nodes=args.nodes, local=args.local, device=device, backend="gloo",
                   dtype="bf16" if device == "cuda" else "fp32", eval_every=10**9, eval_windows=args.nodes * args.local,
                   out_dir=out, fidelity=False)
    numels = tensor_numels(size)
    plain, = launch(spec.with_arms([parse_arm("plain2")]))
    rows = []
    for feedback, bits in args.options:  # the table so far after each option: a run cut short keeps what it measured
        option_spec = dataclasses.replace(spec, loco_settings=(("error_feedback", feedback), ("error_bits", bits)))
        result, = launch(option_spec.with_arms([parse_arm("loco2")]))
        rows.append(((feedback, bits), result))
        report = table(size, numels, spec, plain, rows)
        print(report if len(rows) == 1 else report.splitlines()[-1], flush=True)
        if args.table:
            with open(args.table, "w") as f:
                f.write(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
