"""Runs the demo: every arm for every seed, on the simulated cluster (default) or through real DeepSpeed ZeRO-3
worker processes, with a progress bar; then prints and writes the table, what it says, results.json and the PNG."""
import os
import time
from dataclasses import replace
from typing import List, Optional, Sequence

from deepspeed_loco.simulation.report import report_text, write_report
from loco_lab.arms import RunSpec
from loco_lab.data import TRAIN_PLAYS, VALIDATION_PLAYS, load_corpus
from loco_lab.launcher import gpu_count, gpu_sharing_line, launch
from loco_lab.model import ByteLlama, count_parameters
from loco_lab.progress_bar import ProgressBar

LOSS = "next-byte cross-entropy"  # what the demo's validation loss is


def describe(spec: RunSpec, engine: str = "deepspeed") -> str:
    """The model, world, data and, when ranks share GPUs, a line saying so."""
    m = spec.model
    params = count_parameters(ByteLlama(m))
    device = "CUDA" if spec.device == "cuda" else "CPU"
    if engine == "simulated":
        where = f"simulated in one process on {device}: the library's reducer, all-to-alls copied in process"
    else:
        where = f"DeepSpeed worker processes, {'NCCL' if spec.backend == 'nccl' else 'gloo'} on {device}"
    sharing = gpu_sharing_line(spec, gpu_count()) if engine == "deepspeed" else None
    return (f"model: Llama-style byte LM, {m.layers} layers x {m.dim} wide, {m.heads} heads, context {m.seq_len} "
            f"({params / 1e6:.2f}M parameters, {spec.dtype})\n"
            f"world: {spec.world_size} ranks = {spec.nodes} nodes x {spec.local} ranks per node ({where}); "
            f"AdamW lr {spec.lr:g}, global batch {spec.global_batch} x {m.seq_len} bytes, {spec.steps} steps per arm\n"
            f"data: {_data_line(spec)}"
            + (f"\n{sharing}" if sharing else ""))


def _data_line(spec: RunSpec) -> str:
    if spec.text is None:
        return f"train on {', '.join(TRAIN_PLAYS)}; validate on held-out {', '.join(VALIDATION_PLAYS)}"
    corpus = load_corpus(spec.text, spec.model.seq_len)
    sizes = corpus.sizes()
    return (f"{spec.text}: train on {len(corpus.train_plays)} text(s), {sizes['train_bytes'] / 1e6:.2f} MB; validate "
            f"on held-out {', '.join(corpus.validation_plays)}, {sizes['validation_bytes'] / 1e6:.2f} MB")


def _held_out(spec: RunSpec) -> str:
    """The validation text in words: "the held-out plays", "the held-out mine.txt (last 10%)"."""
    if spec.text is None:
        return "the held-out plays"
    return "the held-out " + ", ".join(load_corpus(spec.text, spec.model.seq_len).validation_plays)


class _Progress(ProgressBar):
    """The bar over all arms' steps, fed by the launcher's messages (DeepSpeed workers) or by the
    simulation, plus LoCo's own log lines from the workers (each once)."""

    def __init__(self, spec: RunSpec, runs: int, enabled: bool = True):
        super().__init__(runs * spec.steps, enabled)
        self.spec = spec
        self.seen = set()
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

    def simulated_step(self, label: str, seed: int, step: int, loss: float) -> None:
        """Progress of one simulated run."""
        self.step(f"seed {seed}: {label}", loss)


def run_demo(spec: RunSpec, seeds: Sequence[int] = (0, ), engine: str = "simulated", progress: bool = True,
             title: Optional[str] = None) -> List[dict]:
    """Trains every arm for every seed (``engine``: "simulated" in this process, or "deepspeed" worker processes);
    prints the table and what it says; writes ``results.json``, ``table.md`` and ``loss_curves.png``."""
    os.makedirs(spec.out_dir, exist_ok=True)
    print(describe(spec, engine) + f"\nseeds: {', '.join(map(str, seeds))}", flush=True)
    started = time.monotonic()
    bar = _Progress(spec, len(spec.arms) * len(seeds), progress)
    try:
        if engine == "simulated":
            from loco_lab.simulated import run_simulated
            results = run_simulated(spec, seeds, on_step=bar.simulated_step)
        else:
            arms = [replace(arm, seed=seed) for seed in seeds for arm in spec.arms]
            results = launch(spec.with_arms(arms), on_message=bar)
    finally:
        bar.close()
    wall = time.monotonic() - started
    held_out = _held_out(spec)
    print()
    print(report_text(results, held_out, engine, LOSS))
    m = spec.model
    title = title or (f"LoCo demo: {m.layers}x{m.dim} byte LM, {spec.nodes}x{spec.local} ranks, {spec.steps} steps, "
                      f"{len(seeds)} seed(s)")
    paths = write_report(results, spec.out_dir, title, header=describe(spec, engine), held_out=held_out,
                         engine=engine, loss=LOSS,
                         extra={"spec": _spec_dict(spec), "engine": engine, "seeds": list(seeds), "wall_s": wall})
    print(f"\nwrote {', '.join(os.path.basename(p) for p in paths)} in {spec.out_dir}; {wall:.0f} s", flush=True)
    return results


def _spec_dict(spec: RunSpec) -> dict:
    out = {k: v for k, v in vars(spec).items() if k not in ("model", "arms")}
    out["model"] = spec.model.to_dict()
    out["arms"] = [a.to_dict() for a in spec.arms]
    return out
