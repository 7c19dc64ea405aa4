"""``python -m deepspeed_loco.perf predict ...`` prints one JSON object for one method and cluster (with
``--calibration``, the JSON that ``benchmarks/calibrate.py`` fits to ``gpu_e2e.py`` runs on one GPU)."""
import argparse
import json
from dataclasses import asdict
from typing import Optional, Sequence

from deepspeed_loco.layout.wire import wire_bytes_per_element
from deepspeed_loco.config import LocoConfig
from deepspeed_loco.perf.calibration import Calibration
from deepspeed_loco.perf.memory import memory_table
from deepspeed_loco.runtime.comm.error_feedback import error_bytes_per_parameter
from deepspeed_loco.perf.model import (DEFAULT_KERNELS, GPUS, INTER_LATENCY_US, INTRA_LATENCY_US, METHODS, Cluster,
                                       Workload, load_kernel_costs, predict)

DESCRIPTION = ("The performance model of ZeRO++ with LoCo. predict prints one JSON object for one method and "
               "cluster; --calibration takes the engine's host time per step and the GPU's measured rate that "
               "benchmarks/calibrate.py fits to gpu_e2e.py runs on one GPU.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m deepspeed_loco.perf", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("predict", help="step time, tokens/s, TFLOPS per GPU and per-collective seconds (JSON)")
    p.add_argument("--params", type=float, required=True, help="parameters, e.g. 18e9")
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--seq", type=int, required=True, help="sequence length (tokens)")
    p.add_argument("--tokens-per-gpu", type=int, required=True, help="tokens per GPU per step")
    p.add_argument("--recompute", action="store_true", help="activation checkpointing: the forward runs twice")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--gpu", choices=sorted(GPUS), required=True)
    p.add_argument("--tflops", type=float, default=None, help="sustained TFLOPS per GPU (overrides the GPU table)")
    p.add_argument("--intra-gbps", type=float, required=True, help="one GPU's NVLink, one direction, Gbit/s")
    p.add_argument("--inter-gbps", type=float, required=True, help="one node's NICs together, one direction, Gbit/s")
    p.add_argument("--intra-latency-us", type=float, default=INTRA_LATENCY_US, help="per NVLink hop")
    p.add_argument("--inter-latency-us", type=float, default=INTER_LATENCY_US, help="per network hop")
    p.add_argument("--method", choices=list(METHODS), required=True)
    p.add_argument("--kernels", default=None, help="JSON written by benchmarks/kernels.py --json")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=False,
                   help="assume communication fully overlaps compute, a lower bound on the step (default: off, the "
                        "variant that reproduces the published ZeRO++ gains, benchmarks/published.py)")
    p.add_argument("--error-feedback", dest="error_feedback", choices=("true", "inter_node"), default="true",
                   help="LoCo methods: which hops keep error (zeropp_loco_param.error_feedback), for the error state "
                        "per GPU the prediction reports")
    p.add_argument("--error-bits", dest="error_bits", type=int, choices=(4, 8, 32), default=8,
                   help="LoCo methods: zeropp_loco_param.error_bits, for the error state per GPU")
    p.add_argument("--calibration", default=None,
                   help="JSON written by 'benchmarks/calibrate.py --out': the engine's host seconds per step, and "
                        "the GPU's measured rate, which stands for --tflops when that is not given")
    m = commands.add_parser("memory", help="LoCo's error state per GPU for each option, beside ZeRO-3's own model "
                                           "states (a markdown table)")
    m.add_argument("--params", type=float, nargs="+", default=[7e9, 13e9, 70e9], help="model sizes, e.g. 7e9 70e9")
    m.add_argument("--gpus", type=int, nargs="+", default=[64, 512], help="data-parallel GPUs (W), each a multiple "
                                                                           "of --gpus-per-node")
    m.add_argument("--gpus-per-node", type=int, default=8)
    return parser


def run_predict(args, parser) -> dict:
    """The prediction for ``args`` as a JSON-ready dict; a bad flag combination exits through ``parser.error``."""
    for flag in ("params", "layers", "hidden", "seq", "tokens_per_gpu"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    calibration = Calibration(0.0, 0)
    if args.calibration:
        try:
            with open(args.calibration) as f:
                calibration = Calibration(**json.load(f))
        except (OSError, ValueError, TypeError) as exc:
            parser.error(f"--calibration: {exc} (expected the JSON of 'benchmarks/calibrate.py --out')")
    tflops = args.tflops or (calibration.gpu_flops / 1e12 if calibration.gpu_flops else None)
    try:
        cluster = Cluster(args.gpus, args.gpus_per_node, GPUS[args.gpu], args.intra_gbps, args.inter_gbps,
                          args.intra_latency_us, args.inter_latency_us, tflops)
    except ValueError as exc:
        parser.error(str(exc))
    workload = Workload(args.params, args.layers, args.hidden, args.seq, args.tokens_per_gpu, args.recompute)
    try:
        kernels = load_kernel_costs(args.kernels) if args.kernels else DEFAULT_KERNELS
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        parser.error(f"--kernels: {exc}")
    method = METHODS[args.method]
    gpu_fixed_s = calibration.gpu_fixed_s(args.params / args.gpus)  # ZeRO-3: this GPU's partition
    result = asdict(predict(workload, cluster, method, kernels, args.overlap, calibration.engine_s, gpu_fixed_s))
    result.update(result.pop("collectives"))
    if method.grad_bits:
        group = method.grad_group or args.hidden
        result["wire_bytes_per_element"] = [wire_bytes_per_element(bits, group) for bits in method.grad_bits]
    result["kernels_source"] = kernels.source if method.kernels else None
    if method.name.startswith("loco"):  # LoCo's error state per GPU: it does not shrink with the GPUs
        config = LocoConfig(intra_node_bits=method.grad_bits[0], inter_node_bits=method.grad_bits[1],
                            error_feedback=True if args.error_feedback == "true" else args.error_feedback,
                            error_bits=args.error_bits)
        result["error_state_bytes_per_gpu"] = args.params * error_bytes_per_parameter(
            args.gpus, args.gpus_per_node, config)
    return result


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "memory":
        bad = [w for w in args.gpus if w < 1 or w % args.gpus_per_node] if args.gpus_per_node >= 1 else args.gpus
        if bad or any(n <= 0 for n in args.params):
            parser.error(f"--gpus must be multiples of --gpus-per-node ({args.gpus_per_node}), got {bad}; --params "
                         f"must be > 0")
        print(memory_table(args.params, args.gpus, args.gpus_per_node))
        return
    print(json.dumps(run_predict(args, parser), indent=1))
