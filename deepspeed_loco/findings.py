"""The regime map's conclusions as data: what LoCo did against plain qgZ at a bit setting, grid, model size and
(where a study resolved it) global batch, each row with its thresholds and where they were measured; one reader,
:func:`read_map`. The start-up note (``runtime/zero/regime_note.py``) and ``advise`` read the map only through it.

The lab changes this table, never the code that reads it. A row says what the map found for runs that match it;
:data:`UPDATE_BURST` is the map's warning line on LoCo's early update burst (``simulation/burst.py`` computes the
statistic). Every raw-runs path is relative to the repository root (``benchmarks/results/``, not in the wheel);
the map's tables and their reading are in ``docs/when_loco_pays.md``.
"""
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

MAP_DOC = "docs/when_loco_pays.md"
LOCO_PAYS = "pays"  # LoCo - plain resolved below 0
LOCO_UNPROVEN = "unproven"  # no gain resolved, and runs that started behind
LOCO_IDLE = "idle"  # LoCo - plain within noise of 0, pooled: error buffers for nothing
READINGS = (LOCO_PAYS, LOCO_UNPROVEN, LOCO_IDLE)
MAP_RUNS = "benchmarks/results/regime_map/runs.jsonl"  # every regime-map run (benchmarks/regime_map.py reads it)
MAP_DATE = "2026-12-06"  # the map's last regeneration


@dataclass(frozen=True)
class Provenance:
    """Where a row was measured: ``regime`` (the runs' tags and setting in words), ``runs`` (the raw-runs JSONL,
    relative to the repository root) and ``date`` (ISO, of the runs' last addition)."""
    regime: str
    runs: str
    date: str


@dataclass(frozen=True)
class Finding:
    """One row. It matches a run whose hops send ``intra_bits`` and ``inter_bits`` (inclusive ``(low, high)``; a
    one-hop run's single hop must lie in both) with Hadamard ``hadamard`` (None: either) on the resolved ``grid``
    ("midrise", "symmetric"; None: either), training ``low < parameters <= high`` (``params``; high None: no bound)
    at ``low < tokens per step <= high`` (``tokens_per_step``, the global batch in tokens; ``(0, None)``: any batch,
    else the row is read only where the run's batch is known). ``reading``: one of :data:`READINGS`; ``summary``:
    what the map found, a clause for a note; ``evidence``: its numbers (paired LoCo - plain, 95% intervals)."""
    reading: str
    intra_bits: Tuple[int, int]
    inter_bits: Tuple[int, int]
    hadamard: Optional[bool]
    grid: Optional[str]
    params: Tuple[int, Optional[int]]
    summary: str
    evidence: str
    provenance: Tuple[Provenance, ...]
    tokens_per_step: Tuple[int, Optional[int]] = (0, None)

    @property
    def batch_bounded(self) -> bool:
        """Whether the row holds only for some global batches (then it is read only where the batch is known)."""
        return self.tokens_per_step != (0, None)

    def matches(self, bits: Sequence[int], hadamard: bool, grid: str, params: int,
                tokens_per_step: Optional[int]) -> bool:
        """Whether a run of these hops (intra-node first), settings and size falls in this row (see the class)."""
        if not bits or len(bits) > 2:
            return False
        ranges = (self.intra_bits, self.inter_bits)
        if len(bits) == 1:
            hop_ok = all(low <= bits[0] <= high for low, high in ranges)
        else:
            hop_ok = all(low <= b <= high for b, (low, high) in zip(bits, ranges))
        if self.batch_bounded and tokens_per_step is None:
            return False
        return (hop_ok and self.hadamard in (None, hadamard) and self.grid in (None, grid)
                and _within(params, self.params) and (tokens_per_step is None or _within(tokens_per_step,
                                                                                          self.tokens_per_step)))


def _within(value: int, bounds: Tuple[int, Optional[int]]) -> bool:
    low, high = bounds
    return value > low and (high is None or value <= high)


_LOCO_2BIT = Provenance("tags maps_w4, maps_w4s1000cpu, maps_w4s2000cpu, maps_w16cpu, maps_w16s1000cpu, maps_w256 "
                        "(0.87M) and mapm_w4, mapm_w16, mapm_w16s1000, mapm_w64, mapm_w256s100 (10.8M): 2/2 on the "
                        "mid-rise grid, W = 4-256, a global batch of 64 sequences (256 at W = 256), 100-2000 steps",
                        MAP_RUNS, MAP_DATE)
_LOCO_116M = Provenance("tags map125m_w4, map125m_w16, map125m_w16s300, map125m_w16_wu100, map125m_w64 (116M): 2/2 "
                        "and 4/4, W = 4, 16 and 64, a global batch of 64 sequences of 256 tokens, 100-300 steps",
                        MAP_RUNS, MAP_DATE)
_LOCO_4BIT = Provenance("every 4/4 regime of the map (0.87M, 10.8M, 116M; W = 4-256; whole runs of 100-1000 steps "
                        "at 64 sequences a step)", MAP_RUNS, MAP_DATE)
_BATCH_AXIS = Provenance("tags ba16_b64, ba16_b256, ba16_b1024, ba16_b4096 (10.8M, W = 16 as 2 x 8): full, plain "
                         "4/4 and LoCo 4/4 at global batches of 64-4096 sequences of 256 tokens (16K to 1M tokens a "
                         "step), 60 steps, seeds 0-2, held-out text of the larger corpus",
                         "benchmarks/results/batch_axis/runs/stage1.jsonl", "2026-12-06")
_BATCH_AXIS_BRANCHED = Provenance("tag ba16br_b4096 (10.8M, W = 16 as 2 x 8, 4096 sequences of 256 tokens: 1M tokens "
                                  "a step): per seed a full-precision trunk of 140 steps saved after step 100, and "
                                  "plain and LoCo at 4/4 and 2/2 resumed from it for steps 101-140, seeds 0-2",
                                  "benchmarks/results/batch_axis/runs/stage2b.jsonl", "2026-12-06")
_BATCH_AXIS_STAGE3 = Provenance("tags ba64br_b4096 (W = 64 as 8 x 8: full, plain 4/4, LoCo 4/4) and ba16br_b4096 "
                                "(W = 16: a new trunk, and plain and LoCo at 8/2 + Hadamard), 4096 sequences of 256 "
                                "tokens, branches resumed after step 100 of a full-precision trunk for steps 101-140, "
                                "seeds 0-2",
                                "benchmarks/results/batch_axis/runs/stage3.jsonl", "2026-12-06")
_BATCH_AXIS_1024 = Provenance("tag ba16br_b1024 (10.8M, W = 16 as 2 x 8, 1024 sequences of 256 tokens): a full-"
                              "precision trunk of 140 steps per seed and plain and LoCo 4/4 resumed from it after step "
                              "100, seeds 0-2", "benchmarks/results/batch_axis/runs/stage3b.jsonl", "2026-12-06")
LARGEST_2BIT_MAP_BATCH = 256 * 256  # tokens a step: the largest global batch at which the map measured LoCo at 2/2
_LOCO_8_2H = Provenance("every 8/2 + Hadamard regime of the map (0.87M at W = 16 and at a global batch of 512; "
                        "10.8M at W = 4-256)", MAP_RUNS, MAP_DATE)

GAIN_RESOLVED_AT = 10_818_432  # parameters of the largest model whose 2/2 gain the map resolved (tags mapm_*)
GAIN_MAX_PARAMS = -(-GAIN_RESOLVED_AT // 1_000_000) * 1_000_000  # the rows' bound: that size up to a whole million
GAIN_RESOLVED_UP_TO = f"{GAIN_RESOLVED_AT / 1e6:.1f}M parameters"  # that size, in words

MAP = (
    Finding(LOCO_PAYS, (2, 2), (2, 2), False, "midrise", (0, GAIN_MAX_PARAMS),
            f"plain qgZ lost loss at 2 bits and LoCo won part of it back at models of up to {GAIN_RESOLVED_UP_TO} "
            "over whole runs of 1000 steps or more at global batches of up to 64K tokens a step (at 1M tokens a step, "
            "not within 40 late steps)",
            "LoCo - plain at 10.8M -0.0098 [-0.0153, -0.0043] over 1000 steps at W = 16 (7 seeds; BH-adjusted p "
            "0.053 among the map's 34 intervals), with seeds as blocks over its 5 regimes -0.0037 [-0.0271, "
            "+0.0196]; at 0.87M -0.0164 [-0.0272, -0.0057] over 1000 steps at W = 16 (a cost, +0.0079, after 100)",
            (_LOCO_2BIT,)),
    Finding(LOCO_UNPROVEN, (2, 2), (2, 2), False, "midrise", (0, GAIN_MAX_PARAMS),
            "LoCo's gain at 2 bits was measured at global batches of up to 64K tokens a step; at 1M tokens a step "
            "plain qgZ lost loss, and LoCo, switched on mid-run, was still behind plain 40 steps later",
            "at 4096 sequences (1M tokens a step, 10.8M, W = 16), 40 steps at the tail of a 140-step schedule "
            "branched from a shared state: plain - full +0.0238 [+0.0067, +0.0408], LoCo - plain +0.0086 [+0.0049, "
            "+0.0123] (3 seeds; neither survives its stage's planned correction, adjusted p 0.053)",
            (_BATCH_AXIS_BRANCHED,), tokens_per_step=(LARGEST_2BIT_MAP_BATCH, None)),
    Finding(LOCO_UNPROVEN, (2, 2), (2, 2), False, "midrise", (GAIN_MAX_PARAMS, None),
            f"LoCo's gain at 2 bits was resolved only up to {GAIN_RESOLVED_UP_TO}, and at 116M LoCo from step 1 "
            "started behind plain qgZ (an early burst of larger updates) and was still behind after 100 steps on 16 "
            "and 64 ranks, and after 300 on 16 (by less, not resolved: no gain)",
            "LoCo - plain at 116M +0.0408 [-0.0264, +0.1081] (5 regimes, 24 seeds); +0.1065 [+0.0613, +0.1516] at "
            "W = 16 over 100 steps, +0.0266 [-0.0413, +0.0944] over 300", (_LOCO_116M,)),
    Finding(LOCO_IDLE, (4, 8), (4, 8), None, None, (0, None),
            "LoCo did not lower the loss at 4 bits or more by an amount that matters in any window measured: whole "
            "runs of 100-1000 steps at 64 sequences (16K tokens) a step (at 4/4 it raised the 116M model's), and 40 "
            "steps at the tail of a 140-step schedule (learning rate 0.31-0.10 of peak) at 1024-4096 sequences "
            "(0.26M-1M tokens) a step on a 10.8M model, where plain 4/4 cost about 0.0014 nats and LoCo won back "
            "about half; whole runs at large batch are not yet measured",
            "LoCo - plain at 4/4, pooled: +0.0019 [-0.0008, +0.0046] (9 regimes, 33 seeds); at 116M +0.0246 "
            "[+0.0074, +0.0417] over 100 steps (2 regimes, 8 seeds), +0.0048 [+0.0014, +0.0083] over 300; at 1024 "
            "and 4096 sequences (10.8M, W = 16 and 64), 40 steps branched from a shared state, seeds as blocks over "
            "3 regimes: plain - full +0.0014 [+0.0001, +0.0027], LoCo - plain -0.0007 [-0.0011, -0.0004] (3 seeds; "
            "neither survives the correction of its family); 60-step runs at 64-4096 sequences resolved nothing "
            "(half-widths 0.030-0.236)",
            (_LOCO_4BIT, _LOCO_116M, _BATCH_AXIS, _BATCH_AXIS_BRANCHED, _BATCH_AXIS_STAGE3, _BATCH_AXIS_1024)),
    Finding(LOCO_IDLE, (8, 8), (2, 2), True, None, (0, None),
            "LoCo did not lower the loss at 8/2 + Hadamard, also where plain qgZ lost loss",
            "LoCo - plain at 8/2 + Hadamard, pooled: -0.0009 [-0.0040, +0.0023] (6 regimes, 23 seeds); at 4096 "
            "sequences (1M tokens a step, 10.8M, W = 16), 40 steps at the tail of a 140-step schedule branched from "
            "a shared state: plain - full +0.0071 [+0.0065, +0.0077], LoCo - plain +0.0016 [+0.0001, +0.0032] (3 "
            "seeds; LoCo worse, not surviving its stage's correction)",
            (_LOCO_8_2H, _BATCH_AXIS_STAGE3)),
)


@dataclass(frozen=True)
class Threshold:
    """A line the map drew on a statistic: ``value``, what it separated (``evidence``) and where (``provenance``)."""
    value: float
    evidence: str
    provenance: Tuple[Provenance, ...]


UPDATE_BURST = Threshold(
    1.3, "every LoCo run that lost more than 0.03 nats to plain qgZ had an update burst of 1.37-1.97 (16 of 130 "
    "runs); none of the 98 at or below 1.3 lost more than 0.021; 9 above it gained (a warning, not a verdict); out "
    "of sample, the 13 116M runs measured after it was drawn all sat above it and all lost",
    (Provenance("the map's LoCo runs (tag, arm, seed) the line was drawn on, beside their plain qgZ runs (same bits "
                "and seed); update burst: simulation.burst.update_burst over steps 1-100",
                "benchmarks/results/regime_map/burst_rule_sample.json", MAP_DATE),
     Provenance("every map run, those after the line was drawn included", MAP_RUNS, MAP_DATE)))
UPDATE_BURST_WARNING = UPDATE_BURST.value


def read_map(bits: Sequence[int], hadamard: bool, grid: str, params: int, tokens_per_step: Optional[int] = None,
             table: Sequence[Finding] = MAP) -> Optional[Finding]:
    """The row of ``table`` (default: the map, :data:`MAP`) for a run whose hops send ``bits`` (intra-node first;
    one entry for a one-hop run) with ``hadamard`` on the resolved ``grid`` for a model of ``params`` parameters at
    a global batch of ``tokens_per_step`` tokens (None: unknown, so rows bounded in batch are not read), or None
    where the map did not measure or resolve the setting. A row bounded in batch wins over an unbounded one where
    both match; two matching rows of one kind are an error of the table (ValueError)."""
    rows = [row for row in table if row.matches(list(bits), hadamard, grid, params, tokens_per_step)]
    bounded = [row for row in rows if row.batch_bounded]
    rows = bounded or rows
    if len(rows) > 1:
        raise ValueError(f"findings: {len(rows)} rows match bits {list(bits)}, hadamard {hadamard}, grid {grid}, "
                         f"{params} parameters, {tokens_per_step} tokens per step: the table's rows overlap")
    return rows[0] if rows else None

