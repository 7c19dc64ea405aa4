"""Identities of the step-time model: bytes, zero network cost on one node, overlap, monotonicity."""
import json

import pytest

from deepspeed_loco.layout.wire import wire_bytes_per_element
from deepspeed_loco.perf.model import (DEFAULT_KERNEL_MS, GPUS, METHODS, Cluster, Workload, collective_seconds,
                                       load_kernel_costs, predict)

WORKLOAD = Workload(7e9, 32, 4096, 4096, 4096)


def cluster(gpus=64, inter_gbps=400.0, **kw):
    return Cluster(gpus, 8, GPUS["h100"], 3600.0, inter_gbps, **kw)


def test_flops_formula():
    w = Workload(1e9, 10, 1000, 100, 50)
    assert w.flops_per_gpu() == 6 * 50 * (1e9 + 2 * 10 * 1000 * 100)
    assert Workload(1e9, 10, 1000, 100, 50, recompute=True).flops_per_gpu() == 8 / 6 * w.flops_per_gpu()


@pytest.mark.parametrize("method", list(METHODS))
def test_one_node_has_no_inter_node_cost(method):
    fast, slow = cluster(8, 400.0), cluster(8, 1e-3)
    assert collective_seconds(WORKLOAD, fast, METHODS[method]) == collective_seconds(WORKLOAD, slow, METHODS[method])
    assert collective_seconds(WORKLOAD, fast, METHODS[method]).get("inter_all_to_all_s", 0.0) == 0.0


def test_plain4_and_loco4_have_equal_wire_bytes_and_collectives():
    plain, loco = METHODS["plain4"], METHODS["loco4"]
    assert (plain.gather_bytes, plain.hpz, plain.grad_bits, plain.grad_group) == \
        (loco.gather_bytes, loco.hpz, loco.grad_bits, loco.grad_group)
    assert collective_seconds(WORKLOAD, cluster(), plain) == collective_seconds(WORKLOAD, cluster(), loco)
    for overlap in (True, False):  # the codec kernels are never hidden, so they are LoCo's whole extra cost
        p, q = (predict(WORKLOAD, cluster(inter_gbps=100.0), m, overlap=overlap) for m in (plain, loco))
        assert q.kernel_s > p.kernel_s
        assert q.step_s - p.step_s == pytest.approx(q.kernel_s - p.kernel_s)


def test_inter_hop_bytes_use_the_repo_wire_formula():
    c = Cluster(16, 8, GPUS["h100"], 3600.0, 100.0, inter_latency_us=0.0)
    per_layer = WORKLOAD.params / WORKLOAD.layers
    expected = WORKLOAD.layers * (1 / 2) * per_layer / 8 * wire_bytes_per_element(2, 256) / (100e9 / 8 * 0.9 / 8)
    assert collective_seconds(WORKLOAD, c, METHODS["loco8-2h"])["inter_all_to_all_s"] == pytest.approx(expected)


@pytest.mark.parametrize("method", list(METHODS))
def test_overlap_never_slower(method):
    for gbps in (25.0, 100.0, 400.0, 3200.0):
        c = cluster(inter_gbps=gbps)
        assert predict(WORKLOAD, c, METHODS[method], overlap=True).step_s <= \
            predict(WORKLOAD, c, METHODS[method], overlap=False).step_s


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("overlap", [True, False])
def test_monotonic_in_bandwidth(method, overlap):
    steps = [predict(WORKLOAD, cluster(inter_gbps=g), METHODS[method], overlap=overlap).step_s
             for g in (25.0, 100.0, 400.0, 1600.0)]
    assert steps == sorted(steps, reverse=True)


def test_tflops_override_and_rates():
    p = predict(WORKLOAD, cluster(tflops=100.0), METHODS["zero3"], overlap=False)
    assert p.compute_s == pytest.approx(WORKLOAD.flops_per_gpu() / 100e12)
    assert p.tokens_per_s == pytest.approx(4096 * 64 / p.step_s)
    assert p.tflops_per_gpu == pytest.approx(WORKLOAD.flops_per_gpu() / p.step_s / 1e12)


def test_cluster_errors_name_the_flags():
    with pytest.raises(ValueError, match="--gpus .* multiple of --gpus-per-node"):
        Cluster(12, 8, GPUS["h100"], 3600.0, 400.0)
    with pytest.raises(ValueError, match="--inter-gbps"):
        Cluster(16, 8, GPUS["h100"], 3600.0, 0.0)


def test_kernel_json_rows_replace_the_defaults(tmp_path):
    rows = [dict(kernel=k, config=c, shape=[4096, 4096], dtype="bf16", ms=2 * ms / 16) for (k, c), ms in
            DEFAULT_KERNEL_MS.items() if not k.startswith("deepspeed")]
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps(dict(device="test", copy_gbps=1.0, rows=rows, buckets=[])))
    costs = load_kernel_costs(str(path))
    h100 = GPUS["h100"]
    default = predict(WORKLOAD, cluster(), METHODS["loco4"])
    # measured times are used as they are (twice the H200 defaults here), not scaled to --gpu
    assert costs.seconds("loco 4/4", 1.0, h100) == pytest.approx(2 * default.kernel_s / WORKLOAD.params
                                                                 * h100.hbm_tbps / GPUS["h200"].hbm_tbps)
    assert "deepspeed" in costs.source


def test_shipped_kernel_times_are_the_raw_measurement_they_cite():
    import json
    from pathlib import Path
    from deepspeed_loco.perf.model import DEFAULT_KERNELS, KERNEL_ROWS, KERNEL_TIMES
    table = json.loads(KERNEL_TIMES.read_text())
    measured = load_kernel_costs(str(Path(__file__).resolve().parents[3] / table["raw"].split(" ")[0]))
    h200 = GPUS["h200"]
    assert table["hbm_tbps"] == h200.hbm_tbps and "H200" in table["device"]
    for name in KERNEL_ROWS:  # on the H200 both are unscaled; the shipped table rounds to 4 significant digits
        assert measured.seconds(name, 1.0, h200) == pytest.approx(DEFAULT_KERNELS.seconds(name, 1.0, h200), rel=5e-4)
