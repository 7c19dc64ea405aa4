"""The live rho (``deepspeed_loco.runtime.comm.noise_stats``) against the exact rho on the simulated cluster (issue 39).

Every regime trains the bundled byte-level model (``loco_lab``, size ``tiny`` by default) on the bundled plays with
:func:`deepspeed_loco.simulation.simulate`, measuring every step (``rho_every: 1``). Per run:

* exact rho: the mean over steps of ``||communicated mean - exact mean||^2`` over the mean over steps of the exact
  sampling-noise power of the mean, ``sum_r ||g_r - exact mean||^2 / (W (W - 1))``, both from the simulator, which
  knows every rank's gradient (``ArmResult``'s ``grad_rel_errors``, ``rank_grad_sq``, ``mean_grad_sq``);
* live rho: the same ratio from the ranks' sums and shared sample alone, as a real run computes it
  (``ArmResult.live_*``; numerator and denominator averaged over the steps before dividing).

Every arm compares like with like: the live numerator is the communicated mean's own error, estimated on a shared
sample of coordinates (``deepspeed_loco.runtime.comm.error_sample``), so for a LoCo arm it includes the remembered
error as the exact rho does. (The earlier live numerator, the quantizers' error on the compensated values, left the
remembered error out; the ``(1 - err_beta) / (1 + err_beta)`` excess once expected of LoCo arms no longer applies.)

    python3 benchmarks/live_rho_check.py              # the default regimes, a few minutes on 2 CPU cores
    python3 benchmarks/live_rho_check.py --steps 20 --arms plain4 --layouts 2x2
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing


def exact_rho(result) -> float:
    """Mean over steps of the communicated mean's error power over the mean of the exact noise power of the mean."""
    world = result.world_size
    error = [rel * rel * exact for rel, exact in zip(result.grad_rel_errors, result.mean_grad_sq)]
    noise = [(rank - exact) / (world - 1) for rank, exact in zip(result.rank_grad_sq, result.mean_grad_sq)]
    return sum(error) / sum(noise)


def live_rho(result) -> float:
    """The live estimate over every measured step of ``result`` (``RhoEstimator`` with a window of all of them)."""
    from deepspeed_loco.runtime.comm.noise_stats import NoiseSample, RhoEstimator

    hops = len(result.live_hop_error_sq[0])
    estimator = RhoEstimator([f"hop{h + 1}" for h in range(hops)], result.world_size, result.rank_batch,
                             window=len(result.live_noise_sq))
    for errors, noise, grad in zip(result.live_hop_error_sq, result.live_noise_sq, result.live_grad_sq):
        estimator.add(NoiseSample(tuple(errors), noise, grad))
    return estimator.estimate().rho


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arms", default="plain4,plain2,plain8-2h", help="comma list of qgZ arms")
    parser.add_argument("--loco-arms", default="loco4", help="LoCo arms, run at the first layout and batch only")
    parser.add_argument("--layouts", default="2x2,2x8", help="comma list of NODESxLOCAL")
    parser.add_argument("--micro-batches", default="1,4", help="sequences per rank (global batch = W x this)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--size", default="tiny", help="loco_lab model size")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch

    from deepspeed_loco.simulation import SimulationSpec, TrainingSetup, simulate
    from loco_lab.data import load_corpus
    from loco_lab.model import SIZES, ByteLlama

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    cfg = SIZES[args.size]
    corpus = load_corpus(None, cfg.seq_len)
    layouts = [tuple(int(x) for x in layout.split("x")) for layout in args.layouts.split(",")]
    micro_batches = [int(b) for b in args.micro_batches.split(",")]
    print(f"model {args.size}, {args.steps} steps, seed {args.seed}, every step measured; global batch in sequences "
          f"of {cfg.seq_len} bytes")
    print("| arm | W | global batch | exact rho | live rho | live / exact |")
    print("|---|---|---|---|---|---|")
    started = time.monotonic()
    for index, ((nodes, local), micro) in enumerate((l, b) for l in layouts for b in micro_batches):
        world = nodes * local
        arms = args.arms.split(",") + (args.loco_arms.split(",") if index == 0 and args.loco_arms else [])

        def batches(global_batch=world * micro):
            for step in range(args.steps):
                yield corpus.train_batch(step, args.seed, global_batch, cfg.seq_len, 0, 1)

        setup = TrainingSetup(lambda: ByteLlama(cfg), batches, nodes=nodes, local=local, loco={"rho_every": 1},
                              loss_fn=lambda model, batch: model(*batch), grad_clip=1.0,
                              optimizer_fn=lambda params: torch.optim.AdamW(params, lr=3e-3))
        results = simulate(SimulationSpec(setup, arms, args.steps, args.seed))
        for result in results:
            exact, live = exact_rho(result), live_rho(result)
            print(f"| {result.key} | {nodes}x{local} | {world * micro} | {exact:.4g} | {live:.4g} | "
                  f"{live / exact:.3f} |", flush=True)
    print(f"({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
