"""Every row of the package's findings (and every threshold) has its evidence and provenance beside the runs, in
benchmarks/results/findings_evidence.json, naming raw-run files the checkout holds."""
import json
import os

from deepspeed_loco.findings import MAP, THRESHOLDS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EVIDENCE = os.path.join(ROOT, "benchmarks", "results", "findings_evidence.json")


def test_every_row_and_threshold_has_evidence_naming_raw_runs_the_checkout_holds():
    rows = json.load(open(EVIDENCE))["rows"]
    assert set(rows) == {row.id for row in MAP} | set(THRESHOLDS)
    for key, entry in rows.items():
        assert entry["evidence"] and entry["provenance"], key
        for provenance in entry["provenance"]:
            assert provenance["runs"].startswith("benchmarks/results/"), key
            assert os.path.isfile(os.path.join(ROOT, provenance["runs"])), (key, provenance["runs"])
            assert len(provenance["date"]) == 10 and provenance["regime"], key
