"""LoCo's telemetry through DeepSpeed's own ``csv_monitor`` (4 gloo processes, 2 nodes x 2 ranks, 3 steps, the error
norm every 2nd step), and on a simulated cluster: the error buffers are read on the measured steps only."""
import csv
import math
from pathlib import Path

import pytest
import torch

WORLD, LOCAL, GROUP, STEPS, RESET_T, ERROR_NORM_EVERY = 4, 2, 32, 3, 2, 2
BITS = {"intra_node": 8, "inter_node": 4}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5))


def _engine(out_dir, error_feedback=True, monitor=True):
    """The model in DeepSpeed's ZeRO-3 engine with LoCo (the csv monitor writing under ``out_dir`` where
    ``monitor``)."""
    import deepspeed_loco
    cfg = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "Adam", "params": {"lr": 5e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 10_000, "zero_quantized_gradients": True,
                              "zeropp_loco_param": {"group_size": GROUP, "reset_T": RESET_T,
                                                    "intra_node_bits": BITS["intra_node"],
                                                    "inter_node_bits": BITS["inter_node"],
                                                    "error_feedback": error_feedback,
                                                    "error_norm_every": ERROR_NORM_EVERY,
                                                    "telemetry_every": 1}},
    }
    if monitor:
        cfg["csv_monitor"] = {"enabled": True, "output_path": str(out_dir), "job_name": "job"}
    model = _model()
    engine, _, _, _ = deepspeed_loco.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def train(out_dir, error_feedback=True, monitor=True):
    """Three optimizer steps; returns whether this rank holds a telemetry object."""
    import deepspeed_loco
    engine = _engine(out_dir, error_feedback, monitor)
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    for _ in range(STEPS):
        engine.backward(engine(torch.randn(8, 13, generator=gen)).pow(2).mean())
        engine.step()
    return deepspeed_loco.loco_hook(engine).telemetry is not None


def _read(folder: Path, name: str):
    with open(folder / f"LoCo_{name}.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", name]
    return [(int(step), float(value)) for step, value in rows[1:]]


def _wire_bytes_per_step(bits: int, rows: int) -> float:
    """The wire formula: per parameter ``roundup(ceil(N / W), group)`` columns at ``bits/8 + 4/group`` bytes each."""
    numels = [p.numel() for p in _model().parameters()]
    columns = sum(math.ceil(math.ceil(n / WORLD) / GROUP) * GROUP for n in numels)
    return rows * columns * (bits / 8 + 4 / GROUP)


@pytest.fixture(scope="module")
def csv_dir(process_pool, tmp_path_factory):
    out = tmp_path_factory.mktemp("monitor")
    has_telemetry = process_pool(WORLD).run(train, out)
    assert has_telemetry == [True, False, False, False]  # rank 0 only
    return out / "job"


def test_bytes_per_hop_are_what_the_wire_formula_gives(csv_dir):
    nodes = WORLD // LOCAL
    expected = {"intra_node": _wire_bytes_per_step(BITS["intra_node"], (LOCAL - 1) * nodes),
                "inter_node": _wire_bytes_per_step(BITS["inter_node"], nodes - 1)}
    for hop, value in expected.items():
        assert _read(csv_dir, f"{hop}_bytes") == [(step, value) for step in range(1, STEPS + 1)]
    full_precision = (WORLD - 1) / WORLD * sum(p.numel() for p in _model().parameters()) * 4  # fp32 gradients
    ratio = sum(expected.values()) / full_precision
    assert [s for s, _ in _read(csv_dir, "bytes_vs_full_precision")] == list(range(1, STEPS + 1))
    assert all(v == pytest.approx(ratio, rel=1e-12) for _, v in _read(csv_dir, "bytes_vs_full_precision"))


def test_loco_writes_through_deepspeeds_own_monitor(csv_dir):
    assert (csv_dir / "Train_Samples_lr.csv").is_file()  # DeepSpeed's own events, same folder, same writer


def test_resets_appear_at_the_reset_T_steps(csv_dir):
    assert _read(csv_dir, "reset") == [(step, float(step % RESET_T == 0)) for step in range(1, STEPS + 1)]


def test_error_norm_is_a_small_positive_fraction_of_the_gradient_on_its_steps_only(csv_dir):
    written = _read(csv_dir, "error_rel_norm")
    assert [step for step, _ in written] == [s for s in range(1, STEPS + 1) if s % ERROR_NORM_EVERY == 0]
    assert all(0.0 < v < 0.5 for _, v in written)  # 8-/4-bit errors of a fresh gradient


def test_without_a_monitor_no_rank_holds_telemetry_and_without_error_feedback_no_error_norm(process_pool, tmp_path):
    assert process_pool(WORLD).run(train, tmp_path, True, False) == [False] * WORLD
    assert process_pool(WORLD).run(train, tmp_path / "plain", False) == [True, False, False, False]
    written = sorted(p.name for p in (tmp_path / "plain" / "job").glob("LoCo_*"))
    assert written == ["LoCo_bytes_vs_full_precision.csv", "LoCo_inter_node_bytes.csv", "LoCo_intra_node_bytes.csv",
                       "LoCo_reset.csv"]


def _gradient_reads(_):
    """One step of the model in DeepSpeed's engine; per bucket reduce: the concatenations the gradients' squared sum
    dispatched, and that sum against the fp64 one."""
    import deepspeed_loco
    from deepspeed_loco.ops.squared_sums import squared_sum
    from tests.unit.ops.test_squared_sums import _KernelCount
    engine = _engine(None, monitor=False)
    reads = []

    def observe(names, grads, partitions):
        with _KernelCount() as counter:
            got = squared_sum(grads, "cpu")
        reads.append((counter.ops["aten.cat"], float(got), float(sum(g.double().square().sum() for g in grads))))

    deepspeed_loco.loco_hook(engine).add_reduce_observer(observe)
    engine.backward(engine(torch.randn(8, 13)).pow(2).mean())
    engine.step()
    return reads


def test_a_buckets_gradients_are_read_through_one_view_in_deepspeeds_engine(process_pool):
    """DeepSpeed's contiguous gradient buffer holds a bucket's gradients back to back (in backward's order): the
    telemetry's squared sum reads them without a copy."""
    for reads in process_pool(WORLD).run(_gradient_reads, None):
        assert reads
        for cats, got, expected in reads:
            assert cats == 0 and got == pytest.approx(expected, rel=1e-6)


class _Recorder:
    """A monitor that keeps what it is given."""

    def __init__(self):
        self.events = []

    def write_events(self, events):
        self.events += events


def test_the_error_buffers_are_read_on_measured_steps_only(monkeypatch):
    """``error_norm_every = 3`` from step 1: the reduces of steps 1 and 2 read no error buffer and write no error norm;
    step 3's read every buffer of its buckets and write ``||e|| / ||g||`` of its reduces exactly (fp64 sums)."""
    from deepspeed_loco.config import LocoConfig
    from deepspeed_loco.runtime.zero import telemetry as telemetry_module
    from deepspeed_loco.runtime.zero.telemetry import LocoTelemetry
    from deepspeed_loco.simulation import SimulatedCluster
    reads = []
    read = telemetry_module.error_squared_sum
    monkeypatch.setattr(telemetry_module, "error_squared_sum",
                        lambda buffers, device: reads.extend(buffers) or read(buffers, device))
    cluster = SimulatedCluster(LocoConfig(group_size=GROUP, intra_node_bits=4, inter_node_bits=4), 2, 2)
    monitor = _Recorder()
    telemetry = LocoTelemetry(monitor, cluster.reducers[0], WORLD, True, error_norm_every=3)
    gen = torch.Generator().manual_seed(0)
    try:
        for step in (1, 2, 3):
            grads = [[torch.randn(300, generator=gen), torch.randn(7, 9, generator=gen)] for _ in range(WORLD)]
            cluster.reduce_scatter(grads, ["a", "b"])
            reads.clear()
            telemetry.on_reduce(["a", "b"], grads[0], [])
            buffers = [b for name in "ab" for b in cluster.states[0].buffers_of(name).values()]
            assert [id(b) for b in reads] == ([id(b) for b in buffers] if step == 3 else [])
            telemetry.on_step(step, False)
        norms = [(value, s) for name, value, s in monitor.events if name == "LoCo/error_rel_norm"]
        error_sq = sum(float(b.dequantize().double().pow(2).sum()) for b in buffers)
        grad_sq = sum(float(g.double().pow(2).sum()) for g in grads[0])
        assert len(norms) == 1 and norms[0][1] == 3
        assert norms[0][0] == pytest.approx((error_sq / grad_sq)**0.5, rel=1e-6)
    finally:
        cluster.close()


def test_every_kth_step_writes_the_byte_counts_per_step_and_the_resets_since_the_last_write():
    """``every = 3`` over 7 steps (a reset at step 2, the error norm every 2nd step): the byte counts and resets at
    steps 3 and 6 only, per step over the 3 steps before; the error norm on its own steps; steps with nothing to
    write do not call the monitor."""
    from deepspeed_loco.config import LocoConfig
    from deepspeed_loco.runtime.zero.telemetry import LocoTelemetry, hop_bytes
    from deepspeed_loco.simulation import SimulatedCluster
    cluster = SimulatedCluster(LocoConfig(group_size=GROUP, intra_node_bits=4, inter_node_bits=4), 2, 2)
    calls = []
    monitor = _Recorder()
    monitor.write_events = lambda events: calls.append(list(events))
    telemetry = LocoTelemetry(monitor, cluster.reducers[0], WORLD, True, error_norm_every=2, every=3)
    gen = torch.Generator().manual_seed(0)
    sent = []
    try:
        for step in range(1, 8):
            grads = [[torch.randn(300, generator=gen)] for _ in range(WORLD)]
            cluster.reduce_scatter(grads, ["a"])
            telemetry.on_reduce(["a"], grads[0], [])
            sent.append(sum(hop_bytes(cluster.reducers[0]).values()))
            telemetry.on_step(step, step == 2)
    finally:
        cluster.close()
    steps = sorted({s for events in calls for _, _, s in events})
    assert steps == [2, 3, 4, 6]  # step 5 and 7: nothing due
    by_name = {}
    for events in calls:
        for name, value, s in events:
            by_name.setdefault(name, []).append((s, value))
    assert [s for s, _ in by_name["LoCo/error_rel_norm"]] == [2, 4, 6]
    assert by_name["LoCo/reset"] == [(3, 1.0), (6, 0.0)]
    per_step = sent[0]  # every step sends the same bytes
    assert sent == [per_step * k for k in range(1, 8)]
    totals = [value for name, values in by_name.items() if name.endswith("node_bytes") for value in values]
    assert sorted(s for s, _ in totals) == [3, 3, 6, 6]
    assert sum(v for _, v in totals) == pytest.approx(2 * per_step)  # per step, both hops, at steps 3 and 6
