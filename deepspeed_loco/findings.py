"""What the measurements say about LoCo, as data the library reads: the rows of ``findings.json`` (package data),
each matching a bit setting, grid, model size and global batch (the window measured, closed at both ends where it
was) to a reading, a few-word note and a summary, and the thresholds with their one-line reasons. :func:`read_map`
is the one reader; the start-up note (``runtime/zero/regime_note.py``) and ``advise`` use nothing else.

``python -m deepspeed_loco.findings`` prints the whole table (:func:`table_text`). The measurements change the JSON,
never this code; their evidence and narrative live with the source, not in the package (:data:`MAP_DOC` names the
narrative's page there).
"""
import argparse
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

LOCO_PAYS = "pays"  # LoCo - plain resolved below 0
LOCO_UNPROVEN = "unproven"  # no gain resolved, and runs that started behind
LOCO_IDLE = "idle"  # LoCo - plain within noise of 0, pooled: error buffers for nothing
READINGS = (LOCO_PAYS, LOCO_UNPROVEN, LOCO_IDLE)
GRIDS = (None, "midrise", "symmetric")


@dataclass(frozen=True)
class Finding:
    """One row. It matches a run whose hops send ``intra_bits`` and ``inter_bits`` (inclusive ``(low, high)``; a
    one-hop run's single hop must lie in both) with Hadamard ``hadamard`` (None: either) on the resolved ``grid``
    ("midrise", "symmetric"; None: either), training ``low < parameters <= high`` (``params``; high None: no bound)
    at ``low < tokens per step <= high`` (``tokens_per_step``, the global batch in tokens; ``(0, None)``: any batch,
    else the row is read only where the run's batch is known). ``reading``: one of :data:`READINGS`; ``summary``:
    what was measured, with its numbers; ``note``: the same in a few words with its window, for the start-up note;
    ``horizon_steps``: None, or the shortest schedule (optimizer steps) over which the reading was resolved; ``id``:
    the row's key in the evidence file. A row whose batch range starts above 0 is read only where the batch is
    known; one from 0 up to a bound is read also where it is unknown (its note names the bound). ``options``:
    ``(key, value)`` pairs of ``zeropp_loco_param`` the row holds for alone (e.g. ``error_feedback: "inter_node"``):
    such a row is read only for a run given with those values, and wins there over a row without options;
    ``action``: what the start-up note asks for (empty: the reading's own)."""
    id: str
    reading: str
    intra_bits: Tuple[int, int]
    inter_bits: Tuple[int, int]
    hadamard: Optional[bool]
    grid: Optional[str]
    params: Tuple[int, Optional[int]]
    summary: str
    note: str = ""
    tokens_per_step: Tuple[int, Optional[int]] = (0, None)
    horizon_steps: Optional[int] = None
    options: Tuple[Tuple[str, Any], ...] = ()
    action: str = ""

    @property
    def batch_bounded(self) -> bool:
        """Whether the row holds only for some global batches (then it is read only where the batch is known)."""
        return self.tokens_per_step != (0, None)

    def same_setting(self, bits: Sequence[int], hadamard: bool, grid: str) -> bool:
        """Whether a run of these hops (intra-node first), Hadamard and grid is this row's setting, at any size."""
        if not bits or len(bits) > 2:
            return False
        ranges = (self.intra_bits, self.inter_bits)
        if len(bits) == 1:
            hop_ok = all(low <= bits[0] <= high for low, high in ranges)
        else:
            hop_ok = all(low <= b <= high for b, (low, high) in zip(bits, ranges))
        return hop_ok and self.hadamard in (None, hadamard) and self.grid in (None, grid)

    def matches(self, bits: Sequence[int], hadamard: bool, grid: str, params: int,
                tokens_per_step: Optional[int], options: Optional[Mapping[str, Any]] = None) -> bool:
        """Whether a run of these hops (intra-node first), settings, size and ``zeropp_loco_param`` ``options``
        (None: not given) falls in this row (see the class)."""
        if tokens_per_step is None and self.tokens_per_step[0] > 0:
            return False
        if self.options and (options is None or not all(_same(options.get(key, _ABSENT), value)
                                                         for key, value in self.options)):
            return False
        return (self.same_setting(bits, hadamard, grid) and _within(params, self.params)
                and (tokens_per_step is None or _within(tokens_per_step, self.tokens_per_step)))


@dataclass(frozen=True)
class Threshold:
    """A line drawn on a statistic: ``value`` and, in one line, why there."""
    value: float
    reason: str


_ABSENT = object()


def _same(a: Any, b: Any) -> bool:
    """Equal and of one type (a JSON ``true`` is not the number 1)."""
    return type(a) is type(b) and a == b


def _within(value: int, bounds: Tuple[int, Optional[int]]) -> bool:
    low, high = bounds
    return value > low and (high is None or value <= high)


def _pair(row: Dict[str, Any], key: str) -> Tuple[Any, Any]:
    value = row[key]
    if not (isinstance(value, list) and len(value) == 2):
        raise ValueError(f"findings.json: row {row.get('id')!r}: {key} = {value!r} must be a [low, high] pair")
    return tuple(value)


def _finding(row: Dict[str, Any]) -> Finding:
    """A row of the JSON as a :class:`Finding`, its reading and grid checked."""
    options = row.get("options", {})
    if not isinstance(options, dict):
        raise ValueError(f"findings.json: row {row.get('id')!r}: options = {options!r} must be an object of "
                         f"zeropp_loco_param keys and values")
    finding = Finding(id=row["id"], reading=row["reading"], intra_bits=_pair(row, "intra_bits"),
                      inter_bits=_pair(row, "inter_bits"), hadamard=row["hadamard"], grid=row["grid"],
                      params=_pair(row, "params"), summary=row["summary"], note=row.get("note", ""),
                      tokens_per_step=_pair(row, "tokens_per_step"), horizon_steps=row.get("horizon_steps"),
                      options=tuple(sorted(options.items())), action=row.get("action", ""))
    if finding.reading not in READINGS or finding.grid not in GRIDS:
        raise ValueError(f"findings.json: row {finding.id!r}: reading {finding.reading!r} must be one of {READINGS} "
                         f"and grid {finding.grid!r} one of {GRIDS}")
    return finding


def load(text: Optional[str] = None) -> Tuple[str, Tuple[Finding, ...], Dict[str, Threshold]]:
    """``(doc, rows, thresholds)`` of the findings JSON ``text`` (default: the package's ``findings.json``)."""
    data = json.loads(text if text is not None else resources.files(__package__).joinpath("findings.json").read_text())
    thresholds = {name: Threshold(float(t["value"]), t["reason"]) for name, t in data["thresholds"].items()}
    return data["doc"], tuple(_finding(row) for row in data["rows"]), thresholds


MAP_DOC, MAP, THRESHOLDS = load()
UPDATE_BURST = THRESHOLDS["update_burst"]  # LoCo's update RMS over plain's, largest 10-step window of steps 1-100
UPDATE_BURST_WARNING = UPDATE_BURST.value


def read_map(bits: Sequence[int], hadamard: bool, grid: str, params: int, tokens_per_step: Optional[int] = None,
             table: Sequence[Finding] = MAP, options: Optional[Mapping[str, Any]] = None) -> Optional[Finding]:
    """The row of ``table`` (default: :data:`MAP`) for a run whose hops send ``bits`` (intra-node first; one entry
    for a one-hop run) with ``hadamard`` on the resolved ``grid`` for a model of ``params`` parameters at a global
    batch of ``tokens_per_step`` tokens (None: unknown, so rows bounded in batch are not read) with the
    ``zeropp_loco_param`` values ``options`` (None: not given, so rows holding for some options alone are not read),
    or None where nothing was measured or resolved for that setting. A row holding for the run's options wins over
    one without options, then a row bounded in batch over an unbounded one, where both match; two matching rows of
    one kind are an error of the table (ValueError)."""
    rows = [row for row in table if row.matches(list(bits), hadamard, grid, params, tokens_per_step, options)]
    rows = [row for row in rows if row.options] or rows
    bounded = [row for row in rows if row.batch_bounded]
    rows = bounded or rows
    if len(rows) > 1:
        raise ValueError(f"findings: {len(rows)} rows match bits {list(bits)}, hadamard {hadamard}, grid {grid}, "
                         f"{params} parameters, {tokens_per_step} tokens per step: the table's rows overlap")
    return rows[0] if rows else None


def measured_window(rows: Sequence[Finding]) -> str:
    """The largest model and global batch ``rows`` were measured at, in words ("up to 116M parameters, 262K tokens a
    step"); "any" where a row leaves its range open."""
    from deepspeed_loco.utils.sizes import parameter_count
    highs = [row.params[1] for row in rows]
    batches = [row.tokens_per_step[1] for row in rows]
    size = "any size" if None in highs else f"up to {parameter_count(max(highs))}"
    top = None if None in batches else max(batches)
    batch = "any batch" if top is None else f"{top / 1e6:.3g}M tokens a step" if top >= 1e6 else \
        f"{top / 1e3:.3g}K tokens a step"
    return f"{size}, {batch}"


def table_text(table: Sequence[Finding] = MAP) -> str:
    """The findings table as text: per row its setting, window (model size, tokens a step, steps), reading and
    summary."""
    def span(bounds):
        low, high = bounds
        return f"({low:,}, {'open' if high is None else f'{high:,}'}]"

    lines = ["deepspeed-loco findings: LoCo error feedback against plain qgZ, per setting and window measured",
             f"(the readings: {', '.join(READINGS)}; the measurements' narrative: {MAP_DOC} in the source repository)"]
    for row in table:
        hops = f"bits intra {row.intra_bits[0]}-{row.intra_bits[1]}, inter {row.inter_bits[0]}-{row.inter_bits[1]}"
        hadamard = {None: "either", True: "on", False: "off"}[row.hadamard]
        only = "".join(f", {key} {json.dumps(value)}" for key, value in row.options)
        lines += ["", f"[{row.id}] {row.reading}: {hops}, Hadamard {hadamard}, grid {row.grid or 'either'}{only}",
                  f"  window: parameters {span(row.params)}, tokens a step {span(row.tokens_per_step)}"
                  + (f", schedules of {row.horizon_steps}+ steps" if row.horizon_steps else "")]
        lines += [f"  in short: {row.note}"] * bool(row.note) + [f"  {row.summary}"]
        lines += [f"  so: {row.action}"] * bool(row.action)
    lines += ["", "Outside every window: not measured; measure your own model with deepspeed-loco-advise and watch "
              "the live rho (zeropp_loco_param.rho_every)."]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m deepspeed_loco.findings``: prints :func:`table_text` of the package's table."""
    argparse.ArgumentParser(prog="python -m deepspeed_loco.findings", description=table_text.__doc__).parse_args(argv)
    print(table_text(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
