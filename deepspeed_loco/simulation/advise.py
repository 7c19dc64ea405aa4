"""Which ``zeropp_loco_param`` to use on a given cluster shape, answered by short simulations: :func:`advise`.

:func:`advise` first measures ``rho`` of each candidate setting in a short probe (a few steps of plain qgZ): the
power of plain qgZ's quantization error in the communicated mean gradient over the power of the gradient's own
sampling noise at the step's batch. A candidate with ``rho < 1`` (its error hides in that noise) is judged by
``rho`` alone; the rest of the budget trains the candidates with ``rho >= 1`` side by side (full precision, plain
qgZ, qgZ + LoCo, several seeds). It recommends the setting with the fewest inter-node bits whose best arm is within
noise of full precision, with LoCo on where it measurably beat plain qgZ, or where the comparison leaves LoCo -
plain open and the findings table (:func:`~deepspeed_loco.findings.read_map`, :func:`arm_map_finding`) reads
"pays" for the setting and model, unless the comparison's mean LoCo - plain lies above 0; the verdict then says
that the table, not this comparison, decided. The measurements behind the table: ``docs/when_loco_pays.md``.
"""
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from deepspeed_loco.config import INTER_NODE_ONLY, LocoConfig
from deepspeed_loco.findings import LOCO_PAYS, LOCO_UNPROVEN, MAP_DOC, UPDATE_BURST, UPDATE_BURST_WARNING, read_map
from deepspeed_loco.layout import resolve_grid, wire_bytes_per_element
from deepspeed_loco.simulation.arms import parse_arm, zeropp_loco_param
from deepspeed_loco.simulation.burst import update_burst, window_means
from deepspeed_loco.simulation.differences import Difference
from deepspeed_loco.simulation.side_by_side import Finished, Job, SideBySide, Task
from deepspeed_loco.simulation.spec import TrainingSetup
from deepspeed_loco.runtime.comm.error_feedback import error_bytes_per_parameter
from deepspeed_loco.simulation.train import check_loss_call, gradient_noise_scale
from deepspeed_loco.utils.logging import logger
from deepspeed_loco.utils.sizes import parameter_count
from deepspeed_loco.utils.stats import noise_ratio, t_interval

CANDIDATES = ("plain2", "plain8-2h", "plain4")  # fewest inter-node bits first
RHO_THRESHOLD = 1.0  # quantization error power equal to the sampling noise power
PROBE_STEPS = 20
MIN_STEPS = 50  # a comparison shorter than this says nothing about a real run
CALIBRATION_STEPS = 2  # the timing run that sizes the probe before the budget is committed
MIN_SEEDS = 3  # the fewest seeds a comparison runs (a 95% interval needs at least 2)


class AdviseInputError(ValueError):
    """An input of :func:`advise` is invalid (a number out of range, a setup whose loss cannot be computed on one
    micro-batch): raised before the probe, with one line naming the input and what would be valid."""


class BudgetTooSmall(AdviseInputError):
    """The budget cannot pay for the probe; ``needed_minutes``: the smallest budget that can answer."""

    def __init__(self, message: str, needed_minutes: float):
        super().__init__(message)
        self.needed_minutes = needed_minutes


@dataclass(frozen=True)
class NoiseScale:
    """The gradient noise scale ``B`` (samples) of the model on the data at the layout's batch, estimated once from
    every probe run (each run's exact gradients, which no quantizer touches): the mean over ``runs`` estimates and
    its 95% t-interval (None below two runs)."""
    mean: float
    low: Optional[float]
    high: Optional[float]
    runs: int

    @classmethod
    def of(cls, estimates: Sequence[float]) -> Optional["NoiseScale"]:
        """From the runs' estimates (None: the run's noise swamped its signal, left out); None if none is left."""
        known = [e for e in estimates if e]
        if not known:
            return None
        interval = t_interval(known)
        return cls(*(interval or (known[0], None, None)), len(known))

    def __str__(self) -> str:
        return f"{self.mean:.3g}" + (f" [{self.low:.3g}, {self.high:.3g}]" if self.low is not None else "")


@dataclass
class Probe:
    """One candidate's probe, each a mean over the probe's seeds: ``rho`` (None without a noise scale), plain qgZ's
    per-step error of the communicated mean, the seconds one training step took (beside the probe's other runs) and
    the seconds a run costs besides its steps (model, cluster and evaluation set-up)."""
    candidate: str
    rho: Optional[float]
    step_error: float
    seconds_per_step: float
    seconds_per_run: float = 0.0


@dataclass
class Comparison:
    """Training comparison of one candidate: final losses per arm key and seed, the paired differences plain - full,
    LoCo - plain and LoCo - full (:class:`~deepspeed_loco.simulation.differences.Difference`) and LoCo's early
    update burst over plain per seed (``simulation.burst.update_burst``)."""
    candidate: str
    steps: int
    losses: Dict[str, Dict[int, float]] = field(default_factory=dict)
    plain_minus_full: Optional[Difference] = None
    loco_minus_plain: Optional[Difference] = None
    loco_minus_full: Optional[Difference] = None
    update_bursts: Dict[int, float] = field(default_factory=dict)


@dataclass
class Advice:
    """What :func:`advise` found: the recommended ``zeropp_loco_param`` block, the probes, the noise scale they
    shared, the comparisons, the reasons, what it could not resolve within the budget (plain sentences), how many runs
    went side by side and ``finished``: False while :func:`advise` still runs (what ``on_update`` gets)."""
    config: Dict[str, Any]
    recommended: str
    probes: List[Probe]
    comparisons: List[Comparison]
    reasons: List[str]
    unresolved: List[str]
    budget_s: float
    spent_s: float
    group_size: int
    parallel: int = 1
    noise_scale: Optional[NoiseScale] = None
    finished: bool = True
    error_memory: List[str] = field(default_factory=list)  # what the block's error state costs per GPU (sentences)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        """A markdown table, one row per candidate, every column explained below it."""
        compared = {c.candidate: c for c in self.comparisons}
        lines = ["| setting | wire B/elem intra / inter | rho | plain step err | plain - full | LoCo - plain | "
                 "LoCo - full | LoCo update burst |", "|---|---|---|---|---|---|---|---|"]
        for probe in self.probes:
            arm, c = parse_arm(probe.candidate), compared.get(probe.candidate)
            cells = [_value(getattr(c, name) if c else None)
                     for name in ("plain_minus_full", "loco_minus_plain", "loco_minus_full")]
            rho = f"{probe.rho:.2f}" if probe.rho is not None else "-"
            burst = f"{max(c.update_bursts.values()):.2f}" if c and c.update_bursts else "-"
            lines.append(f"| {arm.variant} | {_bytes(arm, self.group_size)} | {rho} | {probe.step_error:.3f} | "
                         + " | ".join(cells) + f" | {burst} |")
        lines += [
            "", "rho: power of plain qgZ's quantization error in the communicated mean gradient over the power of the "
            "gradient's sampling noise at the step's batch (from the probe); below 1 the quantization hides in the "
            "noise SGD already has. plain step err: ||g_sent - g_exact|| / ||g_exact||, mean over the probe's steps. "
            "Differences: final loss (validation if given, else the mean training loss of the last tenth of the "
            "steps), paired over seeds, mean [95% t-interval]; '-': not compared (rho below 1, or no budget left). "
            "LoCo update burst: the largest over seeds and over 10-step windows of the first 100 steps of LoCo's "
            f"update RMS over plain qgZ's; above {UPDATE_BURST_WARNING}: {UPDATE_BURST.reason}."
        ]
        return "\n".join(lines)

    def summary(self) -> str:
        """The recommendation and its evidence in plain sentences."""
        lines = [f"Recommended: {self.recommended}" + ("" if self.finished else " (so far; advise still runs)"),
                 '  "zeropp_loco_param": ' + json.dumps(self.config)]  # JSON: pastes into "zero_optimization"
        lines += ["  " + r for r in self.reasons]
        lines += ["  " + m for m in self.error_memory]
        lines += ["Not resolved within the budget: " + u for u in self.unresolved]
        lines.append(f"Spent {self.spent_s / 60:.1f} of {self.budget_s / 60:.1f} minutes, "
                     f"{self.parallel} run{'s' if self.parallel > 1 else ''} at a time.")
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        """A PNG: per compared candidate, each arm's final loss over seeds (points) and mean; needs matplotlib."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        fig = Figure(figsize=(4 + 3 * max(1, len(self.comparisons)), 4.5))
        FigureCanvasAgg(fig)
        for i, comparison in enumerate(self.comparisons or [None]):
            ax = fig.add_subplot(1, max(1, len(self.comparisons)), i + 1)
            if comparison is None:
                ax.text(0.5, 0.5, "no training comparison was needed or affordable", ha="center", va="center")
                continue
            for x, (key, by_seed) in enumerate(comparison.losses.items()):
                values = list(by_seed.values())
                ax.plot([x] * len(values), values, "o", alpha=0.5)
                ax.plot([x - 0.2, x + 0.2], [statistics.fmean(values)] * 2, color="black")
            ax.set_xticks(range(len(comparison.losses)))
            ax.set_xticklabels([parse_arm(k).label for k in comparison.losses], fontsize=7, rotation=20)
            ax.set_title(f"{parse_arm(comparison.candidate).variant}, {comparison.steps} steps", fontsize=9)
            ax.set_ylabel("final loss")
            ax.grid(alpha=0.3)
        fig.suptitle(f"advise: {self.recommended}", fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=90)


def advise(setup: TrainingSetup, budget_minutes: float, candidates: Sequence[str] = CANDIDATES,
           seeds: int = MIN_SEEDS, steps: Optional[int] = None, max_steps: int = 2000,
           probe_steps: int = PROBE_STEPS, on_progress: Optional[Callable[[str, int, int], None]] = None,
           parallel: int = 1, max_seeds: Optional[int] = None,
           on_update: Optional[Callable[["Advice"], None]] = None, tokens_per_step: Optional[int] = None) -> Advice:
    """Recommends a ``zeropp_loco_param`` for ``setup``'s ``nodes x local`` ranks, spending about
    ``budget_minutes`` of this device's time, the probe included, on
    :func:`~deepspeed_loco.simulation.simulate` runs of ``setup`` (its ``loco`` keys are carried into the
    recommendation; its ``eval_fn``, a held-out loss, is recommended: without it the comparison uses the training
    loss).

    First a :data:`CALIBRATION_STEPS`-step run times a step; if the budget cannot pay for the probe it raises
    :class:`BudgetTooSmall` naming the smallest budget that can answer. ``candidates``: plain arm tokens of the bit
    settings to weigh (default 2/2, 8/2 + Hadamard, 4/4). ``seeds``: seeds per arm in a comparison (>= 2).
    ``steps``: steps per comparison run (default: what the budget allows, at most ``max_steps``).
    ``on_progress(stage, done, total)``: progress of the current stage. ``parallel``: runs side by side on the
    device, in spawned processes (:mod:`~deepspeed_loco.simulation.side_by_side`; the setup must then pickle); with
    ``parallel > 1`` each candidate is probed over ``max(1, parallel // len(candidates))`` seeds, so the probes load
    the device as the comparisons will. ``max_seeds`` (default ``seeds``): where a comparison leaves a question open
    (the verdict's ``unresolved``) and the budget still buys a round of the same runs, more seeds are added, a round
    of ``max(1, parallel // 3)`` at a time, up to ``max_seeds``, and the candidate is judged again. ``on_update``:
    gets the advice so far (``finished`` False) after the probe and after each comparison, so that what finished can
    be written before the budget runs out. ``setup.model_fn`` is also called once here, to count the model's
    parameters (the map's prior depends on them). ``tokens_per_step``: the global batch in tokens, when the data are
    token sequences (None: unknown); the map's prior then also depends on it (LoCo's 2/2 gain was measured at up to
    64K tokens a step).

    Before anything runs it checks every number, then builds the model and computes the loss of one micro-batch as
    training will (:func:`~deepspeed_loco.simulation.train.check_loss_call`). Raises :class:`AdviseInputError` (a
    ValueError) for a bad candidate, ``seeds < 2``, ``max_seeds < seeds``, a budget that is not a finite positive
    number, ``probe_steps < 2``, ``steps`` or ``max_steps`` below 1, a ``parallel`` that is not a positive integer,
    a bad ``tokens_per_step``, a setup whose model, data or loss fail on that micro-batch (or whose loss is not a
    scalar), or, with ``parallel > 1``, a setup that does not pickle; :class:`BudgetTooSmall` as above.
    """
    arms = _check_arguments(candidates, budget_minutes, seeds, max_seeds, steps, max_steps, probe_steps, parallel,
                            tokens_per_step)
    max_seeds = seeds if max_seeds is None else max_seeds
    params = _parameters_after_one_loss(setup)  # the map's prior depends on the model's size
    budget_s, started = budget_minutes * 60.0, time.monotonic()
    quant_grid = setup.loco.get("quant_grid", "auto")
    probe_seeds = max(1, parallel // len(arms))
    with _side_by_side(setup, parallel) as runner:
        _check_budget(runner, arms[0].key, probe_steps, len(arms) * probe_seeds, parallel, budget_s, started)
        probes, noise = _probe(runner, [a.key for a in arms], probe_steps, probe_seeds, on_progress)
        comparisons, reasons, unresolved = [], [], []

        def advice(config, label, finished=True):
            return Advice(config, label, probes, comparisons, reasons, unresolved, budget_s,
                          time.monotonic() - started, LocoConfig.from_dict(config).group_size, parallel, noise,
                          finished, error_memory_lines(config, params, setup.nodes, setup.local))

        fallback = parse_arm("plain4")
        if on_update:
            on_update(advice(_answer(fallback, False, setup.loco), fallback.label, False))
        for probe in probes:  # fewest inter-node bits first: the first acceptable candidate is the answer
            left = budget_s - (time.monotonic() - started)
            affordable = _affordable_steps(probe, left, seeds, max_steps, parallel) if steps is None else steps
            comparison = None
            if affordable >= MIN_STEPS:
                compare_started = time.monotonic()
                comparison = _compare(runner, probe.candidate, affordable, range(seeds), on_progress)
                comparisons.append(comparison)
                round_s = (time.monotonic() - compare_started) / math.ceil(3 * seeds / parallel)  # side by side
                _add_seeds(runner, probe, comparison, (params, quant_grid, tokens_per_step), max_seeds, parallel,
                           round_s, lambda: budget_s - (time.monotonic() - started), on_progress)
            elif probe.rho is None or probe.rho >= RHO_THRESHOLD:
                unresolved.append(f"{parse_arm(probe.candidate).variant} (rho {_fmt(probe.rho)}) was not trained: "
                                  f"{left / 60:.1f} minutes left buy {max(affordable, 0)} steps per run, fewer "
                                  f"than {MIN_STEPS}.")
            verdict = judge(probe, comparison, params, quant_grid, tokens_per_step)
            reasons.append(verdict.reason + (_burst_warning(comparison) if verdict.error_feedback else ""))
            unresolved += verdict.unresolved
            if verdict.accepted:
                arm = parse_arm(probe.candidate)
                label = arm.label + (" + LoCo" if verdict.error_feedback else "")
                return advice(_answer(arm, verdict.error_feedback, setup.loco), label)
            if on_update and comparison is not None:
                on_update(advice(_answer(fallback, False, setup.loco), fallback.label, False))
        reasons.append("No candidate was shown safe within the budget: DeepSpeed's qgZ default, 4/4 without LoCo.")
        return advice(_answer(fallback, False, setup.loco), fallback.label)


@dataclass
class Verdict:
    """Whether a candidate is acceptable, with LoCo or without, why, what stayed unresolved, and ``basis``: what
    decided: ``"measured"`` (the comparison's intervals), ``"map"`` (the regime map's prior, the comparison leaving
    LoCo - plain open) or ``"rho"`` (no comparison: the probe's rho alone)."""
    accepted: bool
    error_feedback: bool
    reason: str
    unresolved: List[str] = field(default_factory=list)
    basis: str = "measured"


def judge(probe: Probe, comparison: Optional[Comparison], params: int, quant_grid: str = "auto",
          tokens_per_step: Optional[int] = None) -> Verdict:
    """The decision rule; every sentence states the differences through
    :meth:`~deepspeed_loco.simulation.differences.Difference.said`, from the same interval the rule reads.

    With a comparison: acceptable with LoCo if LoCo - full is not worse (its interval includes 0 or lies below) and
    either LoCo - plain lies below 0 or plain - full lies above 0; else, if plain - full is not worse, acceptable
    with plain qgZ where LoCo - plain lies above 0, with LoCo where the regime map's prior holds
    (:func:`arm_map_finding` is ``LOCO_PAYS`` for ``quant_grid``, the block's ``quant_grid``, a model of
    ``params`` parameters and ``tokens_per_step``), LoCo - full is not worse and LoCo - plain's mean is not above 0
    (the comparison does not lean against the prior), else with plain qgZ (the question whether LoCo helps stays
    open unless LoCo - plain excludes 0); else not. Without one: acceptable with plain qgZ by the regime map's
    prediction if ``rho < 1``; else not."""
    arm = parse_arm(probe.candidate)
    head = f"{arm.variant}: rho {_fmt(probe.rho)}"
    if comparison is None:
        if probe.rho is not None and probe.rho < RHO_THRESHOLD:
            return Verdict(True, False, f"{head} < 1: its quantization error hides in the gradient's sampling noise; "
                           f"plain qgZ is expected within noise of full precision and LoCo to change nothing "
                           f"(regime map; not trained: no budget left).", basis="rho")
        return Verdict(False, False, f"{head} >= 1 and not trained.", basis="rho")
    plain_full, loco_plain, loco_full = (comparison.plain_minus_full, comparison.loco_minus_plain,
                                         comparison.loco_minus_full)
    if loco_plain.better and loco_full.not_worse:
        return Verdict(True, True, f"{head}; {loco_plain.said()} and {loco_full.said()}: LoCo pays here.")
    if loco_full.not_worse and plain_full.worse:
        return Verdict(True, True, f"{head}; plain qgZ lost loss ({plain_full.said()}) while LoCo did not "
                       f"({loco_full.said()}).",
                       [f"{arm.variant}: {loco_plain.said()}: LoCo is recommended as the arm not worse than full "
                        f"precision, not by a resolved gain."])
    if plain_full.not_worse:
        reason = (f"{head}; plain qgZ not worse than full precision in {comparison.steps}-step runs "
                  f"({plain_full.said()})")
        if loco_plain.worse:
            return Verdict(True, False, f"{reason}, and LoCo cost loss ({loco_plain.said()}).")
        if loco_plain.better:
            return Verdict(True, False, f"{reason}; LoCo gained ({loco_plain.said()}) but {loco_full.said()}.")
        unresolved = (f"{arm.variant}: {loco_plain.said()}: whether LoCo helps was not resolved in "
                      f"{comparison.steps}-step runs; ")
        finding = arm_map_finding(arm, quant_grid, params, tokens_per_step)
        reading = finding.reading if finding else None
        horizon = finding.horizon_steps if finding else None
        short = (f" The measurements resolved LoCo's gain at this setting only over schedules of {horizon} steps: a "
                 f"larger budget may resolve it here." if horizon and comparison.steps < horizon else "")
        prior = reading == LOCO_PAYS
        leans_against = loco_plain.mean > 0  # the mean, whatever the interval says
        if prior and not leans_against and loco_full.not_worse:
            return Verdict(True, True, f"{reason}; LoCo is on by the regime map's prior: {finding.summary} "
                           f"({MAP_DOC}).",
                           [unresolved + "LoCo is recommended by the regime map, not by a gain measured here."
                            + short], basis="map")
        against = " Its mean lies above 0, against the map's prior." if prior and leans_against else ""
        unproven = (f" In the regime map {finding.summary} (this model: {parameter_count(params)}"
                    f"{f', {tokens_per_step} tokens a step' if tokens_per_step else ''})."
                    if reading == LOCO_UNPROVEN else "")
        return Verdict(True, False, reason + ".", [unresolved + "plain qgZ is recommended (no error buffers)."
                                                   + against + unproven + short])
    return Verdict(False, False, f"{head}; {plain_full.said()} and {loco_full.said()}: neither shown not worse than "
                   f"full precision in {comparison.steps}-step runs.")


def arm_map_finding(arm, quant_grid: str, params: int, tokens_per_step: Optional[int] = None):
    """What the regime map says about LoCo for this plain ``arm``'s two hops on ``quant_grid``
    (``zeropp_loco_param.quant_grid``) at a model of ``params`` parameters and a global batch of ``tokens_per_step``
    tokens (None: unknown): :func:`deepspeed_loco.findings.read_map`'s row, the start-up note's (its prior for LoCo
    holds where the reading is ``LOCO_PAYS``), or None where the map has no row."""
    bits = (arm.intra_bits, arm.inter_bits)
    return read_map(bits, arm.hadamard, resolve_grid(quant_grid, bits), params, tokens_per_step)


def _check_arguments(candidates: Sequence[str], budget_minutes: float, seeds: int, max_seeds: Optional[int],
                     steps: Optional[int], max_steps: int, probe_steps: int, parallel: int,
                     tokens_per_step: Optional[int]) -> list:
    """:func:`advise`'s numbers and candidates checked; returns the candidates parsed. Raises
    :class:`AdviseInputError` naming the first bad one and what would be valid."""
    try:
        arms = [parse_arm(c) for c in candidates]
    except ValueError as err:
        raise AdviseInputError(f"advise: candidates: {err}") from None
    if any(a.kind != "plain" for a in arms) or not arms:
        raise AdviseInputError(f"advise: candidates {list(candidates)!r} must be plain qgZ arms such as 'plain2', "
                               f"'plain8-2h', 'plain4' (LoCo is weighed for each)")
    if not (isinstance(budget_minutes, (int, float)) and math.isfinite(budget_minutes) and budget_minutes > 0):
        raise AdviseInputError(f"advise: budget_minutes = {budget_minutes!r} is invalid: it must be a finite number "
                               f"> 0 (device minutes, the probe included)")
    _at_least("seeds", seeds, 2, "a paired 95% interval needs 2; 3 recommended")
    _at_least("max_seeds", seeds if max_seeds is None else max_seeds, seeds, f"at least seeds ({seeds})")
    if steps is not None:
        _at_least("steps", steps, 1, "steps per comparison run, or None for what the budget allows")
    _at_least("max_steps", max_steps, 1, "the cap on the steps the budget may buy")
    _at_least("probe_steps", probe_steps, 2, "steps of each probe run")
    _at_least("parallel", parallel, 1, "runs side by side on the device")
    if tokens_per_step is not None:
        _at_least("tokens_per_step", tokens_per_step, 1, "the global batch in tokens, or None")
    return arms


def _at_least(name: str, value: Any, minimum: int, meaning: str) -> None:
    """AdviseInputError unless ``value`` is an integer (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise AdviseInputError(f"advise: {name} = {value!r} is invalid: it must be an integer >= {minimum} ({meaning})")


def _parameters_after_one_loss(setup: TrainingSetup) -> int:
    """The model's parameter count, once the model, its optimizer and the loss of one micro-batch were computed as
    training will (:func:`~deepspeed_loco.simulation.train.check_loss_call`); AdviseInputError, in one line, where
    they fail (the error it came from chained)."""
    try:
        model = check_loss_call(setup)
    except Exception as err:  # the caller's model, data and loss: whatever they raise is an input error here
        raise AdviseInputError(f"advise: one micro-batch before the probe: {' '.join(str(err).split())}") from err
    return sum(p.numel() for p in model.parameters())


def _side_by_side(setup: TrainingSetup, parallel: int) -> SideBySide:
    """The runner of ``setup``'s jobs, ``parallel`` at a time; AdviseInputError where the setup must pickle (parallel
    > 1) and does not."""
    try:
        return SideBySide(Task(setup), parallel)
    except ValueError as err:
        raise AdviseInputError(f"advise: {err}") from err


def _check_budget(runner: SideBySide, candidate: str, probe_steps: int, probe_runs: int, parallel: int,
                  budget_s: float, started: float) -> None:
    """Times a :data:`CALIBRATION_STEPS`-step run of ``candidate``, logs the smallest budget that can answer (this
    run and the probe's ``probe_runs`` runs of ``probe_steps``, ``parallel`` at a time) and raises
    :class:`BudgetTooSmall` if ``budget_s`` (counted from ``started``) is smaller."""
    (timed, ) = runner.run([Job(candidate, CALIBRATION_STEPS, 0, False)])
    per_step = timed.result.wall_s / CALIBRATION_STEPS
    probe_s = math.ceil(probe_runs / parallel) * (timed.overhead_s + probe_steps * per_step)
    needed_s = time.monotonic() - started + probe_s
    comparison_s = math.ceil(3 * MIN_SEEDS / parallel) * (timed.overhead_s + 1.2 * MIN_STEPS * per_step)
    logger.info(f"advise: the smallest budget that can answer is {needed_s / 60:.3g} minutes (a {CALIBRATION_STEPS}"
                f"-step timing run and the probe, {probe_runs} runs of {probe_steps} steps); a training comparison of "
                f"{MIN_STEPS} steps over {MIN_SEEDS} seeds adds about {comparison_s / 60:.3g}; the budget is "
                f"{budget_s / 60:.3g}")
    if budget_s < needed_s:
        raise BudgetTooSmall(f"advise: budget_minutes = {budget_s / 60:.3g} is too small: the probe alone needs about "
                             f"{needed_s / 60:.3g} minutes on this device ({per_step * 1000:.0f} ms per simulated "
                             f"step); give at least that (a training comparison adds about "
                             f"{comparison_s / 60:.3g})", needed_s / 60)


def _probe(runner: SideBySide, candidates: Sequence[str], steps: int, seeds: int,
           on_progress) -> Tuple[List[Probe], Optional[NoiseScale]]:
    """Each candidate's probe (``steps`` of plain qgZ over ``seeds`` seeds, all side by side) and the noise scale
    estimated once from all of the runs, which every candidate's ``rho`` shares."""
    jobs = [Job(candidate, steps, seed, False) for candidate in candidates for seed in range(seeds)]
    report = (lambda done, total: on_progress("probe", done, total)) if on_progress else None
    if on_progress:
        on_progress("probe", 0, len(jobs))
    finished = runner.run(jobs, report)
    noise = NoiseScale.of([gradient_noise_scale(f.result, first_step=2) for f in finished])
    probes = []
    for i, candidate in enumerate(candidates):
        runs = finished[i * seeds:(i + 1) * seeds]
        errors = [statistics.fmean(f.result.grad_rel_errors) for f in runs]
        probes.append(Probe(candidate, _rho(statistics.fmean(errors), noise, runs[0]), statistics.fmean(errors),
                            statistics.fmean(f.result.wall_s / steps for f in runs),  # training only
                            statistics.fmean(f.overhead_s for f in runs)))
    return probes, noise


def _rho(error: float, noise: Optional[NoiseScale], run: Finished) -> Optional[float]:
    """Plain qgZ's error power over the sampling-noise power at the step's batch (None without a noise scale)."""
    if noise is None:
        return None
    return noise_ratio(error, noise.mean, run.result.rank_batch * run.result.world_size)


def _affordable_steps(probe: Probe, seconds: float, seeds: int, max_steps: int, parallel: int = 1) -> int:
    """Steps per run that a comparison (full, plain, LoCo over ``seeds`` seeds, ``parallel`` side by side) can
    take within ``seconds``, at the probe's cost per run and per step (LoCo's buffers and the evaluation counted
    as 20% more per step)."""
    waves = math.ceil(3 * seeds / parallel)
    per_run = seconds / waves - probe.seconds_per_run
    return min(max_steps, int(per_run / (1.2 * probe.seconds_per_step))) if per_run > 0 else 0


def _compare(runner: SideBySide, candidate: str, steps: int, seeds: Iterable[int], on_progress,
             comparison: Optional[Comparison] = None) -> Comparison:
    """Full precision, plain qgZ and qgZ + LoCo of ``candidate`` for ``seeds``, side by side, added to
    ``comparison`` (a new one if None); the paired differences are taken over every seed it then holds."""
    plain, seeds = parse_arm(candidate), list(seeds)  # iterated twice: the jobs, then the bursts
    keys = ["full", plain.key, plain.key.replace("plain", "loco", 1)]
    comparison = comparison or Comparison(candidate, steps, {key: {} for key in keys})
    jobs = [Job(key, steps, seed, True) for seed in seeds for key in keys]
    stage = f"compare {plain.variant}"
    if on_progress:
        on_progress(stage, 0, len(jobs))
    update_rms = {}
    for done in runner.run(jobs, (lambda d, total: on_progress(stage, d, total)) if on_progress else None):
        comparison.losses[done.job.arm][done.job.seed] = _final_loss(done.result)
        update_rms[done.job.arm, done.job.seed] = window_means(done.result.update_rms)
    full, plain_key, loco_key = keys
    for seed in seeds:
        comparison.update_bursts[seed] = update_burst(update_rms[loco_key, seed], update_rms[plain_key, seed])
    losses = comparison.losses
    comparison.plain_minus_full = Difference.paired("plain - full", losses[plain_key], losses[full])
    comparison.loco_minus_plain = Difference.paired("LoCo - plain", losses[loco_key], losses[plain_key])
    comparison.loco_minus_full = Difference.paired("LoCo - full", losses[loco_key], losses[full])
    return comparison


def _add_seeds(runner: SideBySide, probe: Probe, comparison: Comparison, setting: Tuple[int, str, Optional[int]],
               max_seeds: int, parallel: int, round_s: float, seconds_left: Callable[[], float],
               on_progress) -> None:
    """More seeds for ``comparison`` while its verdict (:func:`judge` at ``setting``: parameters, grid, tokens per
    step) leaves a question open, fewer than ``max_seeds`` ran and the budget buys their rounds (``round_s``: the
    measured seconds of one round of ``parallel`` runs side by side)."""
    while judge(probe, comparison, *setting).unresolved:
        have = len(comparison.losses["full"])
        extra = min(max(1, parallel // 3), max_seeds - have)
        if extra < 1 or seconds_left() < math.ceil(3 * extra / parallel) * round_s:
            return
        _compare(runner, comparison.candidate, comparison.steps, range(have, have + extra), on_progress, comparison)


def _burst_warning(comparison: Optional[Comparison]) -> str:
    """A sentence for a verdict that turns LoCo on where a seed's update burst exceeds ``UPDATE_BURST_WARNING``;
    else ""."""
    bursts = comparison.update_bursts if comparison else {}
    high = {seed: burst for seed, burst in bursts.items() if burst > UPDATE_BURST_WARNING}
    if not high:
        return ""
    seeds = ", ".join(f"{seed} ({burst:.2f}x)" for seed, burst in sorted(high.items()))
    return (f" Warning: LoCo's updates in the first 100 steps were larger than plain qgZ's by more than "
            f"{UPDATE_BURST_WARNING}x on seed {seeds} ({UPDATE_BURST.reason}): watch LoCo's first steps in a "
            f"real run.")


def error_memory_lines(block: Dict[str, Any], params: int, nodes: int, local: int) -> List[str]:
    """What the recommended ``block``'s error state costs per GPU for a model of ``params`` parameters on ``nodes`` x
    ``local`` ranks (large tensors: the padding of partitions to whole groups left out), and the leanest option's; none
    without error feedback."""
    config = LocoConfig.from_dict(block)
    if config.error_feedback is False:
        return []
    world = nodes * local
    lean = LocoConfig.from_dict({**block, "error_feedback": INTER_NODE_ONLY, "error_bits": 4})
    mine, leanest = (error_bytes_per_parameter(world, local, c) * params for c in (config, lean))
    return [f"LoCo's error state with this block: {mine / 2**20:.1f} MiB per GPU for this model at {nodes} x {local} "
            f"ranks ({mine / params:.3f} B per parameter; it does not shrink with more GPUs); error_feedback: "
            f'"inter_node", error_bits: 4 would hold {leanest / 2**20:.1f} MiB (every option and size: python -m '
            f"deepspeed_loco.perf memory)"]


def _final_loss(result) -> float:
    """The held-out loss after the last step, else the mean training loss of the last tenth of the steps."""
    if result.final_val_loss is not None:
        return result.final_val_loss
    tail = result.train_losses[-max(1, len(result.train_losses) // 10):]
    return statistics.fmean(tail)


def _answer(arm, error_feedback: bool, loco: Dict[str, Any]) -> Dict[str, Any]:
    """The recommended block: ``arm``'s bits, ``error_feedback`` and the setup's other keys. No ``local_world_size``:
    a real job takes its ranks per node from the launcher, so the block pastes into any layout."""
    block = zeropp_loco_param(arm, **loco)
    block["error_feedback"] = error_feedback
    block.setdefault("quant_grid", "auto")
    return block


def _bytes(arm, group_size: int) -> str:
    return " / ".join(f"{wire_bytes_per_element(bits, group_size):.3f}" for bits in (arm.intra_bits, arm.inter_bits))


def _fmt(value: Optional[float]) -> str:
    return "unknown" if value is None or math.isnan(value) else f"{value:.2f}"


def _value(difference: Optional[Difference]) -> str:
    return "-" if difference is None else difference.value()
