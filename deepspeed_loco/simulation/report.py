"""A report of simulated (or real) runs, written and printed: :func:`report_text` (the table with every column
explained and what it says with 95% intervals), :func:`write_report` (``table.md``, ``results.json``,
``loss_curves.png``) and ``deepspeed-loco-report results.json --out DIR`` (:func:`main`), which renders a saved
``results.json`` again; the demo app (``loco_lab``) prints the same.

Input: result records (:mod:`~deepspeed_loco.simulation.records`). The parts: the table
(:mod:`~deepspeed_loco.simulation.results_table`), the claims (:mod:`~deepspeed_loco.simulation.seed_claims`), the
PNG (:mod:`~deepspeed_loco.simulation.loss_chart`, needs matplotlib: ``pip install "deepspeed-loco[report]"``).
"""
import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from deepspeed_loco.simulation.loss_chart import plot
from deepspeed_loco.simulation.results_table import column_notes, format_table, table_rows
from deepspeed_loco.simulation.seed_claims import summary_lines
from deepspeed_loco.utils.logging import logger

DESCRIPTION = ("deepspeed-loco-report RESULTS_JSON --out DIR: the table, notes and summary of a saved results.json "
               "(written by write_report, or a JSON list of records) printed again and written under --out, with "
               "the loss-curve PNG where matplotlib is installed.")

def report_text(records: Sequence[dict], held_out: Optional[str] = None, engine: str = "simulated",
                loss: str = "the validation loss (eval_fn)", markdown: bool = False) -> str:
    """The table (markdown with ``markdown``), the notes on its columns and what it says (:func:`summary_lines`);
    ``held_out`` names the validation data in the notes (None: not named)."""
    notes = column_notes(held_out, engine, loss)
    return "\n".join([format_table(table_rows(records), markdown), "", "columns:", *notes, "", *summary_lines(records)])


def write_report(records: Sequence[dict], out_dir: str, title: str = "", header: str = "",
                 held_out: Optional[str] = None, engine: str = "simulated",
                 loss: str = "the validation loss (eval_fn)", extra: Optional[Dict[str, Any]] = None) -> List[str]:
    """Writes ``table.md`` (``header``, the table, its notes, what it says), ``results.json`` (``extra`` and the
    records under ``"arms"``) and ``loss_curves.png`` (titled ``title``, ``held_out`` naming the validation data in
    the notes and the panels, None: not named; skipped, with a warning naming the
    ``report`` extra, where matplotlib is missing) under ``out_dir``; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, name) for name in ("table.md", "results.json", "loss_curves.png")]
    with open(paths[0], "w") as f:
        f.write((header + "\n\n" if header else "") + report_text(records, held_out, engine, loss, markdown=True)
                + "\n")
    with open(paths[1], "w") as f:
        json.dump({**(extra or {}), "arms": list(records)}, f, indent=1)
    try:
        png = plot(records, title=title, held_out=held_out)
    except ImportError:
        logger.warning('deepspeed-loco report: no loss_curves.png: matplotlib is missing '
                       '(pip install "deepspeed-loco[report]")')
        return paths[:2]
    with open(paths[2], "wb") as f:
        f.write(png)
    return paths


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The console script deepspeed-loco-report (:data:`DESCRIPTION`)."""
    parser = argparse.ArgumentParser(prog="deepspeed-loco-report", description=DESCRIPTION)
    parser.add_argument("results", help="a results.json of write_report (or the demo), or a JSON list of records")
    parser.add_argument("--out", required=True, help="folder for table.md, results.json and loss_curves.png")
    parser.add_argument("--title", default="", help="the PNG's title")
    parser.add_argument("--held-out", help="what the validation loss was measured on, e.g. 'the last 10%% of mine.txt' "
                                           "(named in the notes and the PNG)")
    args = parser.parse_args(argv)
    try:
        with open(args.results) as f:
            saved = json.load(f)
        records = saved.get("arms") if isinstance(saved, dict) else saved
        if not isinstance(records, list) or not records or not all(isinstance(r, dict) and "key" in r
                                                                     for r in records):
            raise ValueError("it holds no result records (a list of objects with 'key', or {'arms': [...]})")
        extra = {k: v for k, v in saved.items() if k != "arms"} if isinstance(saved, dict) else {}
        write_report(records, args.out, title=args.title, held_out=args.held_out, extra=extra)
    except (OSError, ValueError, KeyError) as err:
        print(f"deepspeed-loco-report: error: {args.results}: {err}", file=sys.stderr)
        return 2
    print(report_text(records, args.held_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
