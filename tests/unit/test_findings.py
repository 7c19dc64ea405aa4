"""The findings as data: the one reader's rule at and around each row's thresholds, rows that never overlap, a row
bounded in global batch read only where the batch is known, and a table that refuses a malformed row."""
import dataclasses
import itertools
import json

import pytest

from deepspeed_loco.findings import LOCO_IDLE, LOCO_PAYS, LOCO_UNPROVEN, MAP, READINGS, UPDATE_BURST, load, read_map

SMALL, LARGE = 10_818_432, 116_430_720  # the map's 10.8M and 116M models
GAIN_MAX_PARAMS = max(row.params[1] for row in MAP if row.reading == LOCO_PAYS and row.intra_bits == (2, 2)
                      and not row.options)  # the largest size the 2/2 gain holds for
LARGEST_2BIT_MAP_BATCH = next(row for row in MAP if row.intra_bits == (2, 2) and row.tokens_per_step[0] > 0
                              ).tokens_per_step[0]


def _reading(*args, **kwargs):
    row = read_map(*args, **kwargs)
    return row.reading if row else None


@pytest.mark.parametrize("bits,hadamard,grid,params,reading", [
    ([2, 2], False, "midrise", SMALL, LOCO_PAYS), ([2], False, "midrise", SMALL, LOCO_PAYS),
    ([2, 2], False, "midrise", GAIN_MAX_PARAMS, LOCO_PAYS),
    ([2, 2], False, "midrise", LARGE, LOCO_PAYS), ([2], False, "midrise", LARGE, LOCO_PAYS),
    ([2, 2], False, "midrise", GAIN_MAX_PARAMS + 1, None),  # 2/2 was not measured above 116M
    ([4, 4], False, "symmetric", SMALL, LOCO_IDLE), ([4, 4], False, "symmetric", LARGE, LOCO_IDLE),
    ([4, 4], True, "symmetric", SMALL, LOCO_IDLE), ([8], False, "symmetric", SMALL, LOCO_IDLE),
    ([8, 4], False, "symmetric", SMALL, LOCO_IDLE), ([8, 2], True, "midrise", SMALL, LOCO_IDLE),
    ([8, 2], True, "midrise", LARGE, None),  # 8/2 + Hadamard was not measured at 116M
    ([2, 2], False, "symmetric", SMALL, None), ([2, 2], True, "midrise", LARGE, None),
    ([8], True, "midrise", SMALL, LOCO_IDLE),  # every hop at 4 bits or more, Hadamard or not
    ([8, 2], False, "midrise", SMALL, None), ([2, 8], True, "midrise", SMALL, None),
    ([4, 2], False, "midrise", SMALL, None), ([3, 3], False, "symmetric", SMALL, None),
    ([], False, "symmetric", SMALL, None),
])
def test_read_map_at_and_around_each_rows_thresholds(bits, hadamard, grid, params, reading):
    assert _reading(bits, hadamard, grid, params) == reading
    assert _reading(bits, hadamard, grid, params, tokens_per_step=16384) == reading  # the map's own batch


def test_rows_never_overlap_over_every_setting():
    hops = [[b] for b in (2, 3, 4, 8)] + [list(p) for p in itertools.product((2, 3, 4, 8), repeat=2)]
    sizes = (1, SMALL, GAIN_MAX_PARAMS, GAIN_MAX_PARAMS + 1, LARGE)
    batches = (None, 16384, LARGEST_2BIT_MAP_BATCH, LARGEST_2BIT_MAP_BATCH + 1, 1 << 20)
    settings = itertools.product(hops, (False, True), ("midrise", "symmetric"), sizes, batches)
    options = [None] + [{"error_feedback": f, "error_bits": b} for f in (True, False, "inter_node") for b in (4, 8, 32)]
    for (bits, hadamard, grid, params, tokens), given in itertools.product(settings, options):
        read_map(bits, hadamard, grid, params, tokens, options=given)  # raises where two rows match


def test_loco_at_2_bits_is_unproven_above_the_largest_batch_the_map_measured_it_at():
    """The batch axis at 1M tokens a step: plain 2/2 lost loss and LoCo, switched on mid-run, stayed behind (the
    10.8M row's sizes; at 116M the gain was measured at 16K tokens a step only, and nothing above)."""
    assert _reading([2, 2], False, "midrise", LARGE, 16384) == LOCO_PAYS
    assert _reading([2, 2], False, "midrise", LARGE, 16385) is None
    for params in (SMALL, read_map([2, 2], False, "midrise", SMALL).params[1]):
        assert _reading([2, 2], False, "midrise", params) == LOCO_PAYS  # batch unknown: the map's rows
        assert _reading([2, 2], False, "midrise", params, LARGEST_2BIT_MAP_BATCH) == LOCO_PAYS
        row = read_map([2, 2], False, "midrise", params, LARGEST_2BIT_MAP_BATCH + 1)
        assert row.reading == LOCO_UNPROVEN and "1M tokens a step" in row.summary
    assert _reading([2, 2], False, "midrise", SMALL, 1 << 20) == LOCO_UNPROVEN
    assert _reading([4, 4], False, "symmetric", SMALL, 1 << 18) == LOCO_IDLE


def test_a_row_bounded_in_global_batch_is_read_only_where_the_batch_is_known_and_wins_there():
    idle = read_map([4, 4], False, "symmetric", SMALL)
    top = idle.tokens_per_step[1]
    large_batch = dataclasses.replace(idle, reading=LOCO_PAYS, tokens_per_step=(top, None))
    table = MAP + (large_batch,)
    assert read_map([4, 4], False, "symmetric", SMALL, table=table) is idle  # batch unknown: rows from 0 only
    assert read_map([4, 4], False, "symmetric", SMALL, top, table=table) is idle  # bound is exclusive below
    assert read_map([4, 4], False, "symmetric", SMALL, top + 1, table=table) is large_batch
    with pytest.raises(ValueError, match="rows overlap"):
        read_map([4, 4], False, "symmetric", SMALL, table=MAP + (idle,))


def test_every_row_and_threshold_says_what_it_means():
    assert len({row.id for row in MAP}) == len(MAP)
    for row in MAP:
        assert row.reading in READINGS and row.summary and row.id and 0 < len(row.note) <= 110


def test_every_row_closes_its_window_to_what_was_measured():
    """No row reads beyond the largest model and global batch it was measured at: outside, "not measured"."""
    for row in MAP:
        assert row.params[1] is not None and row.tokens_per_step[1] is not None, row.id
        setting = ([row.intra_bits[0], row.inter_bits[0]], bool(row.hadamard), row.grid or "symmetric")
        options = dict(row.options) or None
        assert read_map(*setting, row.params[1], row.tokens_per_step[1], options=options) is row
        assert read_map(*setting, row.params[1] + 1, row.tokens_per_step[1], options=options) is not row


def test_the_table_prints_every_row_with_its_window_from_the_installed_package():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "deepspeed_loco.findings"], capture_output=True, text=True,
                         check=True).stdout
    for row in MAP:
        assert f"[{row.id}] {row.reading}:" in out and row.summary in out and row.note in out
        assert f"parameters ({row.params[0]:,}, {row.params[1]:,}]" in out
    assert "not measured" in out and "deepspeed-loco-advise" in out
    assert UPDATE_BURST.value > 1 and UPDATE_BURST.reason


def test_a_malformed_row_is_refused_naming_it():
    good = {"id": "x", "reading": "idle", "intra_bits": [4, 8], "inter_bits": [4, 8], "hadamard": None,
            "grid": None, "params": [0, None], "tokens_per_step": [0, None], "summary": "s"}

    def table(**row):
        return json.dumps({"doc": "d", "rows": [dict(good, **row)], "thresholds": {}})

    assert load(table())[1][0].reading == LOCO_IDLE
    with pytest.raises(ValueError, match="row 'x': reading 'great' must be one of"):
        load(table(reading="great"))
    with pytest.raises(ValueError, match="row 'x': params = \\[0\\] must be a \\[low, high\\] pair"):
        load(table(params=[0]))
    with pytest.raises(ValueError, match="row 'x': options = \\['inter_node'\\] must be an object"):
        load(table(options=["inter_node"]))


def test_a_row_for_some_options_is_read_only_for_runs_given_with_them_and_wins_there():
    """The lean-error-state rows: ``error_feedback: "inter_node"`` (any storage) and 4-bit errors on both hops; a
    run whose options are not given, or differ (the JSON's true is not 1), reads the setting's general row."""
    general = read_map([2, 2], False, "midrise", SMALL)
    inter = read_map([2, 2], False, "midrise", SMALL, options={"error_feedback": "inter_node", "error_bits": 8})
    int4 = read_map([2, 2], False, "midrise", SMALL, options={"error_feedback": True, "error_bits": 4})
    assert general.reading == LOCO_PAYS and not general.options
    assert inter.reading == LOCO_UNPROVEN and dict(inter.options) == {"error_feedback": "inter_node"} and inter.action
    assert int4.reading == LOCO_PAYS and dict(int4.options) == {"error_feedback": True, "error_bits": 4}
    for options in ({"error_feedback": True, "error_bits": 8}, {"error_feedback": 1, "error_bits": 4},
                    {"error_feedback": False, "error_bits": 4}):
        assert read_map([2, 2], False, "midrise", SMALL, options=options) is general
    # beyond the study's batch the general row again
    assert read_map([2, 2], False, "midrise", SMALL, 32768, options={"error_feedback": "inter_node"}) is general
