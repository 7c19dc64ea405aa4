"""Runs the demo: launches the workers with a progress bar, then writes results.json, table.md and the PNG."""
import json
import os
import sys
import time
from typing import List, Optional

from loco_lab.arms import RunSpec
from loco_lab.data import TRAIN_PLAYS, VALIDATION_PLAYS
from loco_lab.launcher import gpu_count, gpu_sharing_line, launch
from loco_lab.model import ByteLlama, count_parameters
from loco_lab.report import format_table, plot, summary_lines, table_rows


def describe(spec: RunSpec) -> str:
    """The model, world, data and, when ranks share GPUs, a line saying so."""
    m = spec.model
    params = count_parameters(ByteLlama(m))
    where = f"{'NCCL' if spec.backend == 'nccl' else 'gloo'} on {'CUDA' if spec.device == 'cuda' else 'CPU'}"
    sharing = gpu_sharing_line(spec, gpu_count())
    return (f"model: Llama-style byte LM, {m.layers} layers x {m.dim} wide, {m.heads} heads, context {m.seq_len} "
            f"({params / 1e6:.2f}M parameters, {spec.dtype})\n"
            f"world: {spec.world_size} ranks = {spec.nodes} nodes x {spec.local} ranks per node (simulated on this "
            f"machine, {where}); ZeRO-3, AdamW lr {spec.lr:g}, global batch {spec.global_batch} x {m.seq_len} bytes, "
            f"{spec.steps} steps per arm\n"
            f"data: train on {', '.join(TRAIN_PLAYS)}; validate on held-out {', '.join(VALIDATION_PLAYS)}"
            + (f"\n{sharing}" if sharing else ""))


class _Progress:
    """tqdm bar over all arms' steps in the launcher process, plus LoCo's own log lines (each once)."""

    def __init__(self, spec: RunSpec, enabled: bool = True):
        self.spec = spec
        self.seen = set()
        self.bar = None
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=len(spec.arms) * spec.steps, unit="step", dynamic_ncols=True,
                            desc="starting workers", file=sys.stdout)
        self.current = -1

    def __call__(self, message) -> None:
        kind = message[0]
        if kind == "log":
            text = message[1]
            if text.startswith("[Rank 0] "):
                text = text[len("[Rank 0] "):]
            if text not in self.seen:
                self.seen.add(text)
                self.write(text)
        elif kind == "step" and self.bar is not None:
            index, step, loss = message[1:]
            if index != self.current:
                self.current = index
                self.bar.set_description(f"[{index + 1}/{len(self.spec.arms)}] {self.spec.arms[index].label}")
            self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            self.bar.update(1)
        elif kind == "arm":
            r = message[2]
            self.write(f"{r['label']}: train loss {r['train_loss']:.4f}, validation loss {r['val_loss']:.4f}")

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_demo(spec: RunSpec, progress: bool = True, title: Optional[str] = None) -> List[dict]:
    """Trains every arm; prints the table; writes ``results.json``, ``table.md`` and ``loss_curves.png``."""
    os.makedirs(spec.out_dir, exist_ok=True)
    print(describe(spec), flush=True)
    started = time.monotonic()
    bar = _Progress(spec, progress)
    try:
        results = launch(spec, on_message=bar)
    finally:
        bar.close()
    wall = time.monotonic() - started
    rows = table_rows(results)
    lines = summary_lines(results)
    print()
    print(format_table(rows))
    print()
    for line in lines:
        print(line)
    png_path = os.path.join(spec.out_dir, "loss_curves.png")
    m = spec.model
    title = title or (f"LoCo demo: {m.layers}x{m.dim} byte LM, {spec.nodes}x{spec.local} ranks, {spec.steps} steps")
    with open(png_path, "wb") as f:
        f.write(plot(results, title=title))
    with open(os.path.join(spec.out_dir, "table.md"), "w") as f:
        f.write(describe(spec) + "\n\n" + format_table(rows, markdown=True) + "\n\n" + "\n".join(lines) + "\n")
    with open(os.path.join(spec.out_dir, "results.json"), "w") as f:
        json.dump({"spec": _spec_dict(spec), "wall_s": wall, "arms": results}, f, indent=1)
    print(f"\nwrote {png_path}, table.md, results.json (worker logs in {os.path.join(spec.out_dir, 'logs')}); "
          f"{wall:.0f} s", flush=True)
    return results


def _spec_dict(spec: RunSpec) -> dict:
    out = {k: v for k, v in vars(spec).items() if k not in ("model", "arms")}
    out["model"] = spec.model.to_dict()
    out["arms"] = [a.to_dict() for a in spec.arms]
    return out
