"""The live rho in a real DeepSpeed ZeRO-3 engine: 4 gloo processes, 2 nodes x 2 ranks, through ``csv_monitor``.

Each rank also observes its own reduces (a reduce observer: the gradients it fed in and the partitions it got back),
so the test recomputes the estimator's inputs independently, the full sums and, from the gathered gradients and means
at the coordinates the step samples, the communicated mean's error and the ranks' spread, and checks the engine's
sample against them, with gradient accumulation and with plain qgZ (``error_feedback: false``). The first layer's
weight (429 elements) is sampled, the other parameters are taken whole.
"""
import csv
import logging

import pytest
import torch

from deepspeed_loco.runtime.comm.error_sample import sample_indices

WORLD, STEPS, MICRO = 4, 4, 8


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5))


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _sampled_powers(first, step):
    """fp64 ``[error, noise, excess]`` of ``first`` (``{name: (gradient, partition)}``, each parameter's first
    reduce of optimizer step ``step``) at the coordinates :func:`sample_indices` picks, weighted: from the full
    gradients' sums over ranks and the gathered mean (one all-reduce per parameter, in name order on every rank)."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    powers = torch.zeros(3, dtype=torch.float64)
    for name in sorted(first):
        grad, partition = first[name]
        numel, width = grad.numel(), partition.numel()
        mean = torch.zeros(world * width, dtype=torch.float64)
        mean[rank * width:(rank + 1) * width] = partition
        rows = torch.stack([grad, grad * grad, mean[:numel]])
        torch.distributed.all_reduce(rows)
        g_sum, g_sq, mean = rows
        exact = g_sum / world
        terms = torch.stack([(mean - exact).pow(2), (g_sq - g_sum * exact) / (world * (world - 1)),
                             mean.pow(2) - exact.pow(2)])
        indices, weight = sample_indices(name, numel, step)
        powers += weight * terms[:, indices].sum(1)
    return powers


class _LandsAfterOnePoll:
    """A host copy like ``HostCopy`` that says it has landed from its second poll on, as on a GPU whose copy is still
    on its way at the step's end: the live rho then reads a measured step's totals one step later."""

    def __init__(self, tensor):
        self._host, self._polls = tensor.to("cpu", copy=True), 0

    def ready(self):
        self._polls += 1
        return self._polls > 1

    def result(self):
        return self._host


def train(out_dir, error_feedback, accum, rho_every, hpz=0, copy_lag=False):
    """``STEPS`` optimizer steps; returns per measured step the directly computed powers (all-reduced: sum
    ``||g||^2``, sum ``||partition||^2``, reduces, then :func:`_sampled_powers`) and the engine's sample, and the
    live-rho lines this rank logged. ``copy_lag``: the totals' host copies land a step late
    (:class:`_LandsAfterOnePoll`)."""
    import deepspeed_loco
    from deepspeed_loco.runtime.comm import noise_stats
    from deepspeed_loco.utils.logging import logger
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": accum,
        "optimizer": {"type": "Adam", "params": {"lr": 5e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 10_000, "zero_quantized_gradients": True,
                              "zeropp_loco_param": {"group_size": 32, "intra_node_bits": 4, "inter_node_bits": 2,
                                                    "error_feedback": error_feedback, "rho_every": rho_every,
                                                    "rho_log_every": 2},
                              "zero_hpz_partition_size": hpz},
        "csv_monitor": {"enabled": True, "output_path": str(out_dir), "job_name": "job"},
    }
    handler = _Lines()
    logger.addHandler(handler)
    real_copy = noise_stats.HostCopy
    noise_stats.HostCopy = _LandsAfterOnePoll if copy_lag else real_copy
    model = _model()
    engine, _, _, _ = deepspeed_loco.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    assert engine.zero_hpz_partition_size() in ((hpz, ) if hpz > 1 else (0, 1))  # hpZ on where asked
    hook = deepspeed_loco.loco_hook(engine)
    direct = torch.zeros(3, dtype=torch.float64)  # sum ||g||^2, sum ||partition||^2, reduces
    first = {}  # name: (gradient, partition) of the parameter's first reduce in the step, fp64

    def observe(names, grads, partitions):
        if hook.reducer.measuring:  # a measured step
            direct[0] += sum(float(g.double().pow(2).sum()) for g in grads)
            direct[1] += sum(float(p.double().pow(2).sum()) for p in partitions)
            direct[2] += 1
            for name, grad, partition in zip(names, grads, partitions):
                first.setdefault(name, (grad.double().reshape(-1), partition.double()))

    hook.add_reduce_observer(observe)
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    records = []
    try:
        for step in range(1, STEPS + 1):
            direct.zero_()
            for _ in range(accum):
                engine.backward(engine(torch.randn(MICRO, 13, generator=gen)).pow(2).mean())
                engine.step()
            totals = direct.clone()
            torch.distributed.all_reduce(totals)
            totals = torch.cat([totals, _sampled_powers(first, step)])
            first.clear()
            sample = hook.live_rho.estimator.samples[-1] if hook.live_rho.estimator.samples else None
            records.append((step, totals.tolist(), None if sample is None else
                            (sample.hop_error_sq, sample.noise_sq, sample.grad_sq)))
    finally:
        logger.removeHandler(handler)
        noise_stats.HostCopy = real_copy
    return records, [line for line in handler.lines if line.startswith("deepspeed-loco: live rho")]


def _read(folder, name):
    with open(folder / f"LoCo_{name}.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", name]
    return [(int(step), float(value)) for step, value in rows[1:]]


@pytest.mark.parametrize("error_feedback,accum,hpz", [(False, 2, 0), (True, 1, 0), (True, 1, 2)])
def test_engine_reports_rho_per_hop_and_noise_scale_through_the_monitor(process_pool, tmp_path, error_feedback,
                                                                        accum, hpz):
    """With plain qgZ and gradient accumulation, with LoCo, and with LoCo under hpZ (a secondary weight partition
    of 2 ranks, inside each node)."""
    results = process_pool(WORLD).run(train, tmp_path, error_feedback, accum, 1, hpz)
    records, lines = results[0]
    for step, (grad_sq, mean_sq, reduces, error, sampled_noise, excess), sample in records:
        hop_error, noise, signal = sample
        assert reduces > 0 and reduces % accum == 0  # every micro-step reduced, and was measured
        # the error is the sampled error of the first micro-step's mean; the noise lies between the full sums'
        # estimate, (mean_r ||g_r||^2 - ||exact mean||^2) / (W - 1) per micro-step, and the sampled spread
        assert sum(hop_error) == pytest.approx(error, rel=1e-4)
        exact_sq = mean_sq / accum - excess
        full = (grad_sq / (WORLD * accum) - exact_sq) / (WORLD - 1)
        slack = 1e-4 * max(abs(full), abs(sampled_noise))
        assert min(full, sampled_noise) - slack <= noise <= max(full, sampled_noise) + slack
        assert signal == pytest.approx(exact_sq - noise, rel=1e-4)
        assert all(e > 0 for e in hop_error) and noise > 0
    assert all(r[0] == records for r in results)  # every rank holds the same sample (one all-reduce)
    folder = tmp_path / "job"
    rho = _read(folder, "rho")
    assert [s for s, _ in rho] == list(range(1, STEPS + 1))
    per_hop = [_read(folder, f"rho_{hop}") for hop in ("intra_node", "inter_node")]
    for (step, total), (_, intra), (_, inter) in zip(rho, *per_hop):
        assert total == pytest.approx(intra + inter, rel=1e-9) and total > 0
    assert inter > intra  # the 2-bit hop's error exceeds the 4-bit hop's
    assert [s for s, _ in _read(folder, "rho_spread")] == list(range(2, STEPS + 1))
    assert len(lines) == STEPS // 2 and all(results[r][1] == [] for r in range(1, WORLD))  # rank 0, every 2 steps
    assert "4/2-bit quantization error" in lines[0] and "sampling noise" in lines[0]


def test_steps_not_measured_compute_nothing_and_write_no_rho(process_pool, tmp_path):
    results = process_pool(WORLD).run(train, tmp_path, False, 1, 3)
    records, _ = results[0]
    assert [totals[2] > 0 for _, totals, _ in records] == [False, False, True, False]  # only step 3 armed the reducer
    assert [s for s, _ in _read(tmp_path / "job", "rho")] == [3]


def test_a_copy_still_on_its_way_is_read_a_step_later_under_its_own_step(process_pool, tmp_path):
    """No host synchronization: where a measured step's totals have not landed at its end, its sample joins the
    estimate at the next step, and the monitor writes it with the measured step as x."""
    results = process_pool(WORLD).run(train, tmp_path, True, 1, 1, 0, True)
    records, _ = results[0]
    assert records[0][2] is None  # step 1's copy is still on its way after step 1
    for (_, totals, _), (_, _, sample) in zip(records, records[1:]):  # after step s: step s - 1's sample
        assert sum(sample[0]) == pytest.approx(totals[3], rel=1e-4)
    assert [s for s, _ in _read(tmp_path / "job", "rho")] == list(range(1, STEPS))

