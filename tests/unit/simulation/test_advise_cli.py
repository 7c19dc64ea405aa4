"""deepspeed-loco-advise: a user's module:function model and data end to end on the CPU, --text, the budget
refusal, and the arguments it refuses."""
import json
import sys
import textwrap

import pytest

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.simulation.advise_cli import load_callable, main, parse_args

USER_MODULE = textwrap.dedent('''
    import torch

    def make_model():
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def batches():
        gen = torch.Generator().manual_seed(3)
        teacher = torch.randn(8, 1, generator=gen)
        while True:
            x = torch.randn(16, 8, generator=gen)
            yield x, torch.sin(x @ teacher)

    def loss(model, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    class ByteModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.out = torch.nn.Embedding(256, 8), torch.nn.Linear(8, 256)

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(self.out(self.embed(x)).flatten(0, 1), y.flatten())

    def byte_model():
        return ByteModel()

    def logits_model():  # forward(x) returns the logits: the default loss, model(x, y), cannot call it
        return torch.nn.Linear(8, 1)
''')
SHAPE = ["--nodes", "2", "--gpus-per-node", "2", "--device", "cpu", "--no-progress"]


@pytest.fixture
def user_module(tmp_path, monkeypatch, request):
    """A module of the user's in the current folder, named after the test (imports are cached by name)."""
    name = "user_" + request.node.name.replace("[", "_").replace("]", "").replace("-", "_")
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    return name


@pytest.mark.slow
def test_a_users_model_and_data_give_a_valid_block_and_the_files(user_module, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["--model", f"{user_module}:make_model", "--data", f"{user_module}:batches", "--loss",
                 f"{user_module}:loss", "--budget-minutes", "5", "--probe-steps", "3", "--steps", "50", "--seeds",
                 "2", "--max-seeds", "2", "--out", str(out), *SHAPE])
    assert code == 0
    advice = json.loads((out / "advise.json").read_text())
    LocoConfig.from_dict(advice["config"])
    assert advice["finished"] and "local_world_size" not in advice["config"]  # safe to paste into any layout
    assert [p["candidate"] for p in advice["probes"]] == ["plain2", "plain8-2h", "plain4"]
    assert advice["comparisons"] and advice["comparisons"][0]["steps"] == 50
    assert advice["noise_scale"]["runs"] == 3  # one estimate from the three candidates' probe runs
    printed = capsys.readouterr().out
    assert (out / "table.md").read_text().startswith("| setting |") and f"Recommended: {advice['recommended']}" in \
        printed
    # the block as JSON, ready to paste into a ds_config's "zero_optimization"
    block = next(line for line in printed.splitlines() if line.startswith('  "zeropp_loco_param": '))
    assert json.loads("{" + block + "}") == {"zeropp_loco_param": advice["config"]}


def test_with_the_progress_bar_on_a_refused_input_is_one_line_of_its_own(user_module, tmp_path, capsys):
    shape = [flag for flag in SHAPE if flag != "--no-progress"]
    code = _exit_code(["--model", f"{user_module}:make_model", "--data", f"{user_module}:batches", "--loss",
                       f"{user_module}:loss", "--out", str(tmp_path / "out"), *shape, "--budget-minutes", "-1"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("deepspeed-loco-advise: error: advise: budget_minutes = -1.0") and \
        err.count("\n") == 1, err


def test_a_bar_on_the_screen_ends_its_line_when_closed(capsys):
    pytest.importorskip("tqdm")
    from deepspeed_loco.simulation.advise_cli import _Progress
    bar = _Progress(enabled=True)
    bar("probe", 1, 3)
    bar.close()
    bar.close()  # a second close prints nothing more
    err = capsys.readouterr().err
    assert "probe" in err and err.endswith("\n") and err.count("\n") == 1


@pytest.mark.slow
def test_text_gives_byte_windows_and_a_held_out_loss(user_module, tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("to be or not to be, that is the question. " * 40)
    out = tmp_path / "out"
    code = main(["--model", f"{user_module}:byte_model", "--text", str(text), "--seq-len", "16", "--budget-minutes",
                 "5", "--probe-steps", "3", "--steps", "50", "--seeds", "2", "--max-seeds", "2", "--out", str(out),
                 *SHAPE])
    assert code == 0
    advice = json.loads((out / "advise.json").read_text())
    first = advice["comparisons"][0]["losses"]
    assert set(first) == {"full", "plain2", "loco2"} and all(0 < v < 6 for v in first["full"].values())  # < ln 256


def test_a_budget_that_cannot_pay_for_the_probe_stops_before_it_and_says_what_would(user_module, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["--model", f"{user_module}:make_model", "--data", f"{user_module}:batches", "--loss",
                 f"{user_module}:loss", "--budget-minutes", "0.0001", "--out", str(out), *SHAPE])
    err = capsys.readouterr().err
    assert code == 2 and "deepspeed-loco-advise: error: advise: budget_minutes = 0.0001 is too small" in err
    needed = float(err.split("needs about ")[1].split(" minutes")[0])
    assert needed > 0.0001 and not out.exists()  # nothing ran past the timing run, nothing written


def _exit_code(argv) -> int:
    """main's exit code, whether it returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as stop:
        return stop.code


@pytest.mark.parametrize("flags, said", [
    (["--budget-minutes", "-1"], "advise: budget_minutes = -1.0 is invalid: it must be a finite number > 0"),
    (["--budget-minutes", "nan"], "advise: budget_minutes = nan is invalid"),
    (["--seeds", "1"], "advise: seeds = 1 is invalid: it must be an integer >= 2"),
    (["--seeds", "two"], "argument --seeds: invalid int value: 'two'"),
    (["--steps", "0"], "advise: steps = 0 is invalid: it must be an integer >= 1"),
    (["--probe-steps", "1"], "advise: probe_steps = 1 is invalid"),
    (["--parallel", "0"], "argument --parallel: '0': an integer >= 1"),
    (["--lr", "0"], "argument --lr: '0': a number > 0"),
    (["--micro-batch", "0"], "argument --micro-batch: '0': an integer >= 1"),
    (["--nodes", "0"], "TrainingSetup: nodes = 0 is invalid: it must be an integer >= 1"),
], ids=["budget", "budget_nan", "seeds", "seeds_word", "steps", "probe_steps", "parallel", "lr", "micro_batch",
        "nodes"])
def test_a_bad_number_is_one_line_and_exit_code_2_before_anything_runs(user_module, tmp_path, capsys, flags, said):
    out = tmp_path / "out"
    code = _exit_code(["--model", f"{user_module}:make_model", "--data", f"{user_module}:batches", "--loss",
                       f"{user_module}:loss", "--out", str(out), *SHAPE, *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("deepspeed-loco-advise: error: ") and said in err
    assert err.count("\n") == 1 and not out.exists()  # one line; nothing ran, nothing written


def test_a_model_whose_forward_returns_logits_is_one_line_naming_the_loss_flag(user_module, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["--model", f"{user_module}:logits_model", "--data", f"{user_module}:batches", "--out", str(out),
                 *SHAPE])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and not out.exists()
    assert err.startswith("deepspeed-loco-advise: error: advise: one micro-batch before the probe: model(*micro_batch), "
                          "the default loss_fn, raised TypeError: Linear.forward() takes 2 positional arguments")
    assert "--loss module:function" in err


def test_without_matplotlib_the_output_names_the_extra_and_the_other_files_are_written(user_module, tmp_path, capsys,
                                                                                      monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # every import of it fails, as when it is not installed
    out = tmp_path / "out"
    code = main(["--model", f"{user_module}:make_model", "--data", f"{user_module}:batches", "--loss",
                 f"{user_module}:loss", "--budget-minutes", "1", "--probe-steps", "3", "--max-steps", "40", "--out",
                 str(out), *SHAPE])
    assert code == 0 and sorted(p.name for p in out.iterdir()) == ["advise.json", "table.md"]
    assert 'no advise.png: matplotlib is not installed (pip install "deepspeed-loco[report]")' in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--data", "m:f"], "the following arguments are required: --model"),
    (["--model", "m:f"], "one of the arguments --data --text is required"),
    (["--model", "m:f", "--data", "m:f", "--text", "t"], "not allowed with argument"),
    (["--model", "m:f", "--text", "t", "--eval", "m:e"], "--eval goes with --data"),
    (["--model", "m:f", "--data", "m:f", "--parallel", "0"], "'0': an integer >= 1"),
])
def test_bad_arguments_exit_2_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_reference_that_does_not_resolve_names_the_flag(user_module, capsys):
    with pytest.raises(ValueError, match=r"--model 'nomodule_xyz:f': module 'nomodule_xyz' does not import"):
        load_callable("--model", "nomodule_xyz:f")
    with pytest.raises(ValueError, match=r"--data 'just_a_name' is invalid: it must be module:function"):
        load_callable("--data", "just_a_name")
    assert main(["--model", f"{user_module}:missing", "--data", f"{user_module}:batches", *SHAPE]) == 2
    assert f"--model '{user_module}:missing': {user_module} has no function 'missing'" in capsys.readouterr().err


def test_help_is_plain_text_with_each_default_once(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert ":func:" not in text and "``" not in text and "(default: None)" not in text
    assert text.count("(default: 8)") == 2 and "(default: what the budget allows)" in text


@pytest.mark.slow
def test_the_console_script_needs_no_loco_lab(user_module, tmp_path):
    """loco_lab (the demo) is not in the wheel: the script's whole path, a refusal included, runs without it."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    code = ("import sys; sys.modules['loco_lab'] = None; from deepspeed_loco.simulation.advise_cli import main; "
            f"sys.exit(main(['--model', '{user_module}:make_model', '--data', '{user_module}:batches', '--loss', "
            f"'{user_module}:loss', '--budget-minutes', '0.0001', '--nodes', '2', '--gpus-per-node', '2', "
            f"'--device', 'cpu', '--no-progress', '--out', 'out']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1"), timeout=300)
    assert done.returncode == 2 and "is too small: the probe alone needs about" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("text, tokens", [(True, 64 * 1 * 2 * 2), (False, None)])
def test_the_global_batch_in_tokens_reaches_advise_only_for_token_windows(user_module, tmp_path, monkeypatch, text,
                                                                           tokens):
    """With --text the batch is windows of --seq-len bytes, so advise reads the map's batch-bounded rows with
    ``seq_len x micro_batch x W`` tokens a step; a user's own data has no known token count (None)."""
    import deepspeed_loco.simulation.advise as advise_module
    seen = {}

    def stub(setup, budget_minutes, **kwargs):
        seen.update(kwargs)
        raise advise_module.BudgetTooSmall("stopped by the test", 2.0)

    monkeypatch.setattr(advise_module, "advise", stub)
    (tmp_path / "plays.txt").write_text("To be, or not to be, that is the question. " * 40)
    source = (["--model", f"{user_module}:byte_model", "--text", str(tmp_path / "plays.txt"), "--seq-len", "64"]
              if text else ["--model", f"{user_module}:make_model", "--data", f"{user_module}:batches", "--loss",
                            f"{user_module}:loss"])
    assert main(source + SHAPE + ["--budget-minutes", "1", "--out", str(tmp_path / "out")]) == 2
    assert seen["tokens_per_step"] == tokens
