"""The demo's arms on the simulated cluster: the bundled model and plays, trained in this process through
:func:`deepspeed_loco.simulation.simulate` (the library's own reducer, error state and kernels; only the
all-to-alls are in-process copies), once per arm and seed. Results are the library's report records (:func:`deepspeed_loco.simulation.records.record`), the format of the
DeepSpeed workers' too."""
import math
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from deepspeed_loco.simulation import SimulationSpec, TrainingSetup, simulate
from deepspeed_loco.simulation.records import record
from loco_lab.arms import RunSpec
from loco_lab.data import ByteCorpus, load_corpus
from loco_lab.model import ByteLlama


def run_simulated(spec: RunSpec, seeds: Sequence[int],
                  on_step: Optional[Callable[[str, int, int, float], None]] = None) -> List[dict]:
    """Every arm of ``spec`` for every seed; one result record per (seed, arm), seeds in order.

    ``on_step(label, seed, step, loss)`` reports progress."""
    corpus = load_corpus(spec.text, spec.model.seq_len)
    device = torch.device(spec.device)
    sizes = [p.numel() for p in ByteLlama(spec.model).parameters()]
    records = []
    for seed in seeds:
        setup = TrainingSetup(
            model_fn=lambda: ByteLlama(spec.model), data_fn=lambda: _batches(corpus, spec, seed), nodes=spec.nodes,
            local=spec.local, loco={"group_size": spec.group_size, "err_beta": spec.err_beta,
                                    "reset_T": spec.reset_T, "quant_grid": spec.quant_grid},
            optimizer_fn=lambda params: torch.optim.AdamW(params, lr=spec.lr, betas=(0.9, 0.95), eps=1e-8,
                                                          weight_decay=spec.weight_decay),
            scheduler_fn=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine(spec)),
            eval_fn=lambda model: validation_loss(model, corpus, spec, device), eval_every=spec.eval_every,
            device=device, grad_clip=spec.grad_clip, autocast_dtype=torch.bfloat16 if spec.dtype == "bf16" else None,
            grad_mode="vmap" if device.type == "cuda" else "loop")  # on CPU, vmap's attention fallback is slower
        results = simulate(SimulationSpec(setup, spec.arms, spec.steps, seed), on_step=(
            lambda result, step, loss: on_step(result.label, seed, step, loss)) if on_step else None)
        records += [record(result, sizes) for result in results]
    return records


def validation_loss(model: torch.nn.Module, corpus: ByteCorpus, spec: RunSpec, device: torch.device) -> float:
    """Mean next-byte cross-entropy over ``spec.eval_windows`` windows of the held-out plays."""
    total, count = 0.0, 0
    for x, y in corpus.validation_batches(spec.eval_windows, spec.model.seq_len, 0, 1, spec.eval_batch):
        total += float(model(x.to(device), y.to(device))) * x.shape[0]
        count += x.shape[0]
    return total / count


def _batches(corpus: ByteCorpus, spec: RunSpec, seed: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Step ``s``'s global batch: the windows the DeepSpeed workers of the same seed see, all ranks together."""
    step = 0
    while True:
        yield corpus.train_batch(step, seed, spec.global_batch, spec.model.seq_len, 0, 1)
        step += 1


def _warmup_cosine(spec: RunSpec) -> Callable[[int], float]:
    """Linear warm-up over ``spec.warmup`` steps, then cosine decay to ``spec.min_lr_ratio`` at the last step."""

    def factor(step: int) -> float:
        if step < spec.warmup:
            return (step + 1) / spec.warmup
        progress = min(1.0, (step - spec.warmup) / max(1, spec.steps - spec.warmup))
        return spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
