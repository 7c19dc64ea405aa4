"""LoCo's error state allocated for a real model's parameter shapes (issue 56, goal a): a Llama-2-style model's
tensors (7B, 13B or 70B shapes) on ``W`` ranks, ``L`` per node, one rank's buffers created as the engine creates them
(``ErrorFeedbackState.buffers_for``) on a device, for each option asked. Prints the formula's bytes (exact, padding
included), the bytes the buffers hold, and what the process's memory grew by (CUDA: ``torch.cuda.memory_allocated``;
CPU: resident memory), per option, one option at a time.

    python3 benchmarks/error_memory.py --model 70b --world 512 --local 8 --options inter_node:4 inter_node:8
"""
import argparse
import gc
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepspeed_loco.config import LocoConfig  # noqa: E402
from deepspeed_loco.layout import plan_hops  # noqa: E402
from deepspeed_loco.runtime.comm.error_feedback import ErrorFeedbackState  # noqa: E402

# Llama-2 shapes: (layers, hidden, intermediate, key/value width, vocabulary)
MODELS = {"7b": (32, 4096, 11008, 4096, 32000), "13b": (40, 5120, 13824, 5120, 32000),
          "70b": (80, 8192, 28672, 1024, 32000)}


def tensor_numels(model: str):
    """Element counts of every parameter tensor of the model, in order."""
    layers, hidden, inter, kv, vocab = MODELS[model]
    per_layer = [hidden * hidden, hidden * kv, hidden * kv, hidden * hidden, hidden * inter, hidden * inter,
                 inter * hidden, hidden, hidden]
    return [vocab * hidden] + per_layer * layers + [hidden, vocab * hidden]


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def used_bytes(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else resident_bytes()


def measure(numels, world, local, feedback, bits, device):
    """``(formula bytes, bytes the buffers hold, growth of the process's memory)`` for one option."""
    config = LocoConfig(error_feedback=feedback, error_bits=bits)
    state = ErrorFeedbackState(config, plan_hops(world, local, config))
    formula = sum(state.planned_bytes(n) for n in numels)
    gc.collect()
    before = used_bytes(device)
    for i, numel in enumerate(numels):
        state.buffers_for(f"p{i}", numel, device)
    grown = used_bytes(device) - before
    held = state.memory_bytes()
    del state
    gc.collect()
    return formula, held, grown


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="70b")
    p.add_argument("--world", type=int, default=512)
    p.add_argument("--local", type=int, default=8)
    p.add_argument("--options", nargs="+", default=["inter_node:4", "inter_node:8"],
                   help="error_feedback:error_bits pairs (error_feedback true or inter_node)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    numels = tensor_numels(args.model)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{args.model}: {sum(numels) / 1e9:.2f}B parameters in {len(numels)} tensors; one rank of W = {args.world} "
          f"(L = {args.local}); device {name}; GB = 1e9 bytes")
    print("| option | formula | buffers hold | memory grew by | grew / formula |\n|---|---|---|---|---|")
    for option in args.options:
        feedback, bits = option.split(":")
        feedback = True if feedback == "true" else feedback
        formula, held, grown = measure(numels, args.world, args.local, feedback, int(bits), device)
        print(f"| error_feedback {feedback}, error_bits {bits} | {formula / 1e9:.3f} GB | {held / 1e9:.3f} GB | "
              f"{grown / 1e9:.3f} GB | {grown / formula:.4f} |", flush=True)


if __name__ == "__main__":
    main()
