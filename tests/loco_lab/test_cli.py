"""The demo CLI's bad flags: one line on stderr, ``<prog> demo: error: <flag and what is valid>``, exit code 2,
no traceback, and nothing run (run_demo never called)."""
import pytest

from loco_lab import cli

PREFIX = "python3 -m loco_lab.cli demo: error: "


@pytest.fixture
def demo(monkeypatch, capsys, gpus):
    """``demo(*flags)``: ``(exit code, stderr, run_demo calls)`` of ``cli.main(["demo", *flags])`` on a host
    without GPUs; run_demo is replaced by a recorder, so nothing trains."""

    def run(*flags):
        gpus(0)
        calls = []
        monkeypatch.setattr("loco_lab.run.run_demo", lambda spec, **kw: calls.append((spec, kw)))
        code = cli.main(["demo", *flags])
        return code, capsys.readouterr().err, calls

    return run


BAD = [  # (flags, message after the prefix)
    (["--steps", "0"], "--steps 0 is invalid: it must be an integer >= 1"),
    (["--micro-batch", "-2"], "--micro-batch -2 is invalid: it must be an integer >= 1"),
    (["--nodes", "0"], "--nodes 0 is invalid: it must be an integer >= 1"),
    (["--local", "-1"], "--local -1 is invalid: it must be an integer >= 1"),
    (["--heads", "0"], "--heads 0 is invalid: it must be an integer >= 1"),
    (["--seq-len", "0"], "--seq-len 0 is invalid: it must be an integer >= 1"),
    (["--eval-every", "0"], "--eval-every 0 is invalid: it must be an integer >= 1"),
    (["--eval-windows", "0"], "--eval-windows 0 is invalid: it must be an integer >= 1"),
    (["--lr", "0"], "--lr 0.0 is invalid: it must be a number > 0"),
    (["--lr", "nan"], "--lr nan is invalid: it must be a number > 0"),
    (["--group-size", "0"], "--group-size: zeropp_loco_param.group_size = 0 is invalid: it must be a power of two "
                            "from 32 to 4096"),
    (["--err-beta", "2.0"], "--err-beta: zeropp_loco_param.err_beta = 2.0 is invalid: it must be a float with "
                            "0 <= err_beta < 1"),
    (["--seeds", "0", "-1"], "--seeds 0 -1 is invalid: seeds must be integers >= 0, each given once"),
    (["--seeds", "1", "1"], "--seeds 1 1 is invalid: seeds must be integers >= 0, each given once"),
    (["--dim", "30", "--heads", "4"], "--dim 30 must be a multiple of --heads 4 with an even head size"),
    (["--arms", ""], "--arms: no arm given; arms are 'full'"),
    (["--arms", "full,loco,loco4"], "--arms: arm(s) loco4 given more than once"),
    (["--arms", "full,loco9"], "--arms: arm 'loco9' is invalid"),
    (["--dtype", "fp16"], "--dtype fp16 is invalid with --engine simulated"),
    (["--device", "cuda"], "--device cuda: no CUDA GPU on this host (use --device cpu)"),
    (["--backend", "nccl", "--device", "cpu"], "--backend nccl needs CUDA tensors"),
]


@pytest.mark.parametrize("flags, message", BAD, ids=[" ".join(f) or "empty" for f, _ in BAD])
def test_a_bad_flag_is_one_line_and_exit_code_2(demo, flags, message):
    code, err, calls = demo(*flags)
    assert code == 2 and calls == []
    assert err.endswith("\n") and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(PREFIX + message), err


@pytest.mark.parametrize("size", [0, 200])
def test_a_text_too_short_says_how_many_bytes_it_needs(demo, tmp_path, size):
    """200 bytes used to end in an IndexError at validation, an empty file in numpy's "buffer length (0)"."""
    text = tmp_path / "mine.txt"
    text.write_bytes(b"y" * size)
    code, err, calls = demo("--text", str(text))  # small: a context of 128 bytes
    assert code == 2 and calls == [] and err.count("\n") == 1
    assert err.startswith(f"{PREFIX}--text {text}: {size} bytes is too short for a context of 128 bytes: a file "
                          f"needs at least 1281 bytes"), err


def test_missing_text_and_out_that_is_a_file(demo, tmp_path):
    code, err, calls = demo("--text", str(tmp_path / "nope"))
    assert (code, calls) == (2, []) and err == f"{PREFIX}--text {tmp_path / 'nope'}: no such file or folder\n"
    (tmp_path / "out").write_text("a file")
    code, err, calls = demo("--out", str(tmp_path / "out"))
    assert (code, calls) == (2, []) and err.startswith(f"{PREFIX}--out {tmp_path / 'out'} is a file: it must be a "
                                                       f"directory")


def test_good_flags_reach_run_demo(demo, tmp_path):
    text = tmp_path / "mine.txt"
    text.write_bytes(b"z" * 1281)
    code, err, calls = demo("--text", str(text), "--seeds", "3", "--eval-every", "500", "--no-progress")
    assert (code, err) == (0, "") and len(calls) == 1
    spec, kw = calls[0]
    assert spec.text == str(text) and spec.eval_every == spec.steps and kw["seeds"] == [3] and not kw["progress"]
