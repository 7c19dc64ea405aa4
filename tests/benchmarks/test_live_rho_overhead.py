"""benchmarks/live_rho_overhead.py on the CPU (tiny model, reference kernels): it times both reduces and the step,
and the vector it packs is the live rho's all-reduce: 2H + 1 sums and 3 values per sampled coordinate."""
import torch


def test_the_overhead_benchmark_times_the_reduces_and_packs_the_all_reduce(benchmark_module):
    overhead = benchmark_module("live_rho_overhead")
    threads = torch.get_num_threads()
    try:
        result = overhead.measure(overhead.parse_args(["--size", "tiny", "--micro-batch", "2", "--device", "cpu",
                                                       "--repeats", "1", "--nodes", "2", "--local", "2"]))
    finally:
        torch.set_num_threads(threads)
    from loco_lab.model import SIZES, ByteLlama
    numels = [p.numel() for p in ByteLlama(SIZES["tiny"]).parameters()]
    assert result["all_reduce_floats"] == 2 * 2 + 1 + 3 * sum(min(n, 256) for n in numels)
    assert result["params"] == sum(numels) and result["tensors"] == len(numels)
    assert min(result["train_step_ms"], result["reduce_ms"], result["reduce_measured_ms"]) > 0
    text = overhead.table(result)
    assert "rho_every = 10 (default)" in text and "2 x 2, 4/4 bits" in text
