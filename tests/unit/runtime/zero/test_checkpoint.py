"""LoCo's error-feedback state in checkpoints.

Real DeepSpeed ZeRO-3 engines on 4 gloo processes (2 nodes x 2 ranks) for save/resume, layout changes and
corrupt files; single-process tests of the format's checks (every rule of ``runtime/zero/checkpoint.py``).
"""
import logging
import os
import shutil
from contextlib import contextmanager

import pytest
import torch

from deepspeed_loco.config import LocoConfig
from deepspeed_loco.layout import plan_hops
from deepspeed_loco.runtime.zero import checkpoint, stage3_hook
from deepspeed_loco.runtime.zero.checkpoint import LocoCheckpointError, LocoCheckpointMismatch
from deepspeed_loco.runtime.zero.deepspeed_seam import private_names
from deepspeed_loco.runtime.comm.error_feedback import ErrorFeedbackState
from deepspeed_loco.utils.logging import logger

WORLD = 4
K = 5  # steps before the checkpoint
N = 10  # steps compared after it
GROUP = 32
TAG = "k5"


# ------------------------------------------------------------------------------------------ engine helpers
class Net(torch.nn.Module):
    """Trainable layers, a frozen one (requires_grad False) and one never used in forward (no gradient)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(13, 33)
        self.frozen = torch.nn.Linear(33, 33)
        self.b = torch.nn.Linear(33, 5)
        self.unused = torch.nn.Linear(3, 3)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.b(torch.tanh(self.frozen(torch.tanh(self.a(x)))))


def ds_config(**loco):
    # torch's Adam: DeepSpeed's CPU FusedAdam keeps beta**t in a process-wide C++ object, updated by multiplication
    # step after step but recomputed with pow() when the step jumps (a resume), so even stock ZeRO-3 resumes on CPU
    # differ from the uninterrupted run by an ulp (csrc/includes/cpu_adam.h, IncrementStep); torch's Adam keeps all
    # of its state in the checkpoint
    return {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "Adam", "params": {"lr": 5e-3, "torch_adam": True, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 10_000,
            "zero_quantized_gradients": True,
            "zeropp_loco_param": {"group_size": GROUP, "reset_T": 8, **loco},
        },
    }


def make_engine(**loco):
    import deepspeed_loco
    torch.manual_seed(0)
    model = Net()
    engine, _, _, _ = deepspeed_loco.initialize(model=model, model_parameters=model.parameters(),
                                                config=ds_config(**loco))
    return engine, deepspeed_loco.loco_hook(engine)


def batch(rank, step):
    gen = torch.Generator().manual_seed(10_000 * step + rank)
    teacher = torch.Generator().manual_seed(123)
    x = torch.randn(8, 13, generator=gen)
    return x, torch.tanh(x @ torch.randn(13, 5, generator=teacher))


def gathered(engine):
    import deepspeed
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return torch.cat([p.detach().float().reshape(-1).clone() for p in params])


def train(engine, first, steps):
    """Steps ``first .. first+steps-1`` (data depends on rank and step only); the parameters after each."""
    rank = torch.distributed.get_rank()
    out = []
    for step in range(first, first + steps):
        x, y = batch(rank, step)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        out.append(gathered(engine))
    return out


def named(engine):
    return dict(engine.module.named_parameters())


def snapshot(hook, engine):
    return checkpoint.state_dict(hook.state, named(engine))


def same_state(a, b):
    """Differences between two LoCo state dicts (buffers compared bit for bit)."""
    diffs = []
    if a["step"] != b["step"] or a["signature"] != b["signature"] or set(a["params"]) != set(b["params"]):
        return [f"step/signature/params differ: {a['step']} {b['step']} {sorted(a['params'])} {sorted(b['params'])}"]
    for name, entry in a["params"].items():
        if set(entry["buffers"]) != set(b["params"][name]["buffers"]):
            diffs.append(f"{name} hops {sorted(entry['buffers'])} {sorted(b['params'][name]['buffers'])}")
            continue
        for hop, x in entry["buffers"].items():
            y = b["params"][name]["buffers"][hop]
            for key in ("values", "scale"):
                if (x[key] is None) != (y[key] is None) or (x[key] is not None and not torch.equal(x[key], y[key])):
                    diffs.append(f"{name} {hop} {key}")
    return diffs


def all_zero(hook):
    return not any(bool(b.dequantize().any()) for b in hook.state.buffers())


class _Records(logging.Handler):

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextmanager
def loco_warnings():
    handler = _Records()
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


def rewrite_zero_file(engine, src, dst, edit):
    """Copies checkpoint ``src/TAG`` to ``dst/TAG`` (rank 0), then each rank applies ``edit(loco_entry)`` to its own
    ``zero_pp_rank_*`` file (``edit`` returns the new entry, or a sentinel to delete it)."""
    dist = torch.distributed
    if dist.get_rank() == 0:
        shutil.copytree(os.path.join(src, TAG), os.path.join(dst, TAG))
        shutil.copy(os.path.join(src, "latest"), os.path.join(dst, "latest"))
    dist.barrier()
    path = engine._get_zero_ckpt_name(dst, TAG)
    sd = torch.load(path, weights_only=False)
    entry = edit(sd["optimizer_state_dict"].pop(checkpoint.STATE_KEY))
    if entry is not DELETE:
        sd["optimizer_state_dict"][checkpoint.STATE_KEY] = entry
    torch.save(sd, path)
    dist.barrier()


DELETE = object()


def truncate_on_rank_2(entry):
    if torch.distributed.get_rank() == 2:
        intra = entry["params"]["a.weight"]["buffers"]["intra_node"]
        intra["values"] = intra["values"][:, :-GROUP].clone()
    return entry


# ------------------------------------------------------------------------------------------- engine tests
def resume_and_faults(root):
    """The whole engine scenario on one rank; returns facts to assert (no assert inside a rank)."""
    ckpt, stripped, corrupt = (os.path.join(root, d) for d in ("ckpt", "stripped", "corrupt"))
    rank = torch.distributed.get_rank()
    out = {}

    # the uninterrupted run, checkpointed after K steps
    engine, hook = make_engine()
    train(engine, 0, K)
    engine.save_checkpoint(ckpt, tag=TAG)
    saved = snapshot(hook, engine)
    at_save = gathered(engine)
    if rank == 0:  # DeepSpeed's offline consolidation reads files that carry the LoCo key
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        fp32 = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag=TAG)
        out["zero_to_fp32"] = torch.equal(torch.cat([fp32[n].reshape(-1) for n, _ in engine.module.named_parameters()]),
                                          at_save)
    out["saved_nonzero_buffers"] = not all_zero(hook)
    out["saved_names"] = sorted(saved["params"])
    out["frozen_or_unused_buffers"] = [n for n in hook.state.names() if n.startswith(("frozen", "unused"))]
    reference = train(engine, K, N)
    out["reference_resets"] = hook.state.step  # K + N: a reset at step 8 happened inside the compared window
    rewrite_zero_file(engine, ckpt, stripped, lambda entry: DELETE)
    rewrite_zero_file(engine, ckpt, corrupt, truncate_on_rank_2)

    # resumed in a fresh engine
    engine, hook = make_engine()
    with loco_warnings() as warned:
        engine.load_checkpoint(ckpt, tag=TAG)
    out["resume_warnings"] = warned
    out["resume_step"] = hook.state.step
    out["resume_state_diffs"] = same_state(saved, snapshot(hook, engine))
    resumed = train(engine, K, N)
    out["resume_unequal_steps"] = [i for i in range(N) if not torch.equal(reference[i], resumed[i])]

    # stock DeepSpeed (no LoCo) loads a LoCo checkpoint: the extra key is ignored
    import deepspeed
    torch.manual_seed(0)
    model = Net()
    stock_config = ds_config()
    del stock_config["zero_optimization"]["zeropp_loco_param"]
    stock_config["zero_optimization"]["zero_quantized_gradients"] = False
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=stock_config)
    load_path, _ = engine.load_checkpoint(ckpt, tag=TAG)
    out["stock_loads"] = load_path is not None and bool(torch.isfinite(train(engine, K, 1)[-1]).all())

    # a checkpoint without LoCo state: buffers from zero, with a warning; the run then differs
    engine, hook = make_engine()
    with loco_warnings() as warned:
        engine.load_checkpoint(stripped, tag=TAG)
    out["stripped_warnings"] = warned
    out["stripped_zero"] = all_zero(hook)
    without = train(engine, K, N)
    out["stripped_unequal_steps"] = [i for i in range(N) if not torch.equal(reference[i], without[i])]

    # another layout (L = 4: one node of 4): reset with a warning naming old and new, the step kept; trains on
    engine, hook = make_engine(local_world_size=4)
    with loco_warnings() as warned:
        engine.load_checkpoint(ckpt, tag=TAG)
    out["layout_warnings"] = warned
    out["layout_step"] = hook.state.step
    out["layout_zero"] = all_zero(hook)
    out["layout_trains"] = bool(torch.isfinite(train(engine, K, 2)[-1]).all())

    # rank 2's entry truncated: every rank raises before the optimizer state is loaded ...
    engine, hook = make_engine()
    try:
        engine.load_checkpoint(corrupt, tag=TAG)
        out["corrupt_error"] = None
    except LocoCheckpointError as err:
        out["corrupt_error"] = str(err)
    out["corrupt_step"] = hook.state.step

    # ... unless the config asks for a reset: rank 2 starts from zero with a warning, the others resume
    engine, hook = make_engine(on_corrupt_checkpoint="reset")
    with loco_warnings() as warned:
        engine.load_checkpoint(corrupt, tag=TAG)
    out["corrupt_reset_warnings"] = warned
    out["corrupt_reset_zero"] = all_zero(hook)
    out["corrupt_reset_diffs"] = same_state(saved, snapshot(hook, engine))
    out["corrupt_reset_trains"] = bool(torch.isfinite(train(engine, K, 1)[-1]).all())
    out["rank"] = rank
    return out


@pytest.fixture(scope="module")
def scenario(process_pool, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("loco_ckpt"))
    return process_pool(WORLD).run(resume_and_faults, root)


def test_checkpoint_holds_buffers_of_trainable_parameters_only(scenario):
    for r in scenario:
        assert r["saved_nonzero_buffers"]
        assert r["saved_names"] == ["a.bias", "a.weight", "b.bias", "b.weight"]
        assert r["frozen_or_unused_buffers"] == []


def test_resume_from_step_k_reproduces_the_uninterrupted_run_bit_for_bit(scenario):
    for r in scenario:
        assert r["resume_warnings"] == []
        assert r["resume_step"] == K
        assert r["resume_state_diffs"] == []
        assert r["reference_resets"] == K + N
        assert r["resume_unequal_steps"] == [], f"rank {r['rank']}"


def test_stock_deepspeed_and_zero_to_fp32_read_a_loco_checkpoint(scenario):
    assert all(r["stock_loads"] for r in scenario)
    assert scenario[0]["zero_to_fp32"]


def test_checkpoint_without_loco_state_resets_with_a_warning_and_the_run_differs(scenario):
    for r in scenario:
        assert r["stripped_zero"]
        assert len(r["stripped_warnings"]) == 1 and "has no 'deepspeed_loco' entry" in r["stripped_warnings"][0]
        assert "buffers start from zero" in r["stripped_warnings"][0]
        # the resume test can fail: not restoring the buffers changes the parameters
        assert r["stripped_unequal_steps"], f"rank {r['rank']}"


def test_different_layout_resets_with_a_warning_naming_old_and_new(scenario):
    for r in scenario:
        assert r["layout_zero"] and r["layout_step"] == K and r["layout_trains"]
        assert len(r["layout_warnings"]) == 1
        assert "local_size 2 -> 4" in r["layout_warnings"][0]
        assert "W=4 L=2" in r["layout_warnings"][0] and "W=4 L=4" in r["layout_warnings"][0]


def test_corrupt_entry_on_one_rank_is_a_clear_error_on_every_rank(scenario):
    for r in scenario:
        message = r["corrupt_error"]
        assert message is not None and r["corrupt_step"] == 0
        if r["rank"] == 2:
            assert "parameter 'a.weight', intra_node, values: shape (4, 96), expected (4, 128) (truncated?)" in message
            assert "on_corrupt_checkpoint" in message
        else:
            assert "another rank's checkpoint file is corrupt" in message


def test_corrupt_entry_resets_that_rank_when_the_config_asks(scenario):
    for r in scenario:
        assert r["corrupt_reset_trains"]
        if r["rank"] == 2:
            assert r["corrupt_reset_zero"]
            assert len(r["corrupt_reset_warnings"]) == 1
            assert "rank 2" in r["corrupt_reset_warnings"][0] and "truncated" in r["corrupt_reset_warnings"][0]
        else:
            assert r["corrupt_reset_warnings"] == [] and r["corrupt_reset_diffs"] == []


# ------------------------------------------------------------------------ the format's rules, one process
NAMES = {"w": (100, 7), "bias": (5, ), "tiny": (1, )}


def new_state(config, world=4, local=2):
    return ErrorFeedbackState(config, plan_hops(world, local, config))


def filled_state(world=4, local=2, seed=0, **cfg):
    """A state with random buffers for three parameters, and the ``{name: param}`` map."""
    config = LocoConfig(group_size=GROUP, **cfg)
    state = new_state(config, world, local)
    params = {name: torch.nn.Parameter(torch.zeros(shape)) for name, shape in NAMES.items()}
    gen = torch.Generator().manual_seed(seed)
    for name, param in params.items():
        feedback = state.buffers_for(name, param.numel(), "cpu")
        for buffer in (feedback.values() if feedback else ()):
            buffer.store_(torch.randn(buffer.shape, generator=gen))
    state.step = 7
    return state, params


@pytest.mark.parametrize("world,local,error_bits", [(4, 2, 8), (4, 2, 32), (4, 1, 8), (4, 4, 8), (8, 2, 32)])
def test_state_dict_round_trips_through_torch_save(world, local, error_bits, tmp_path):
    state, params = filled_state(world, local, error_bits=error_bits)
    torch.save(checkpoint.state_dict(state, params), tmp_path / "loco.pt")
    loaded = torch.load(tmp_path / "loco.pt", weights_only=True)  # plain types and tensors only
    fresh, fresh_params = filled_state(world, local, seed=1, error_bits=error_bits)
    checkpoint.load_state_dict(fresh, loaded, fresh_params)
    assert fresh.step == 7
    assert same_state(checkpoint.state_dict(state, params), checkpoint.state_dict(fresh, fresh_params)) == []


@pytest.mark.parametrize("world,local", [(4, 2), (4, 1), (4, 4)])
def test_version_1_files_load_with_their_hop1_hop2_keys(world, local):
    """Format 1 (before hop names) stored the intra-node buffer as "hop1" and the inter-node one as "hop2"."""
    state, params = filled_state(world, local)
    sd = checkpoint.state_dict(state, params)
    v1 = dict(sd, version=1, params={
        name: {"ds_id": e["ds_id"], "numel": e["numel"], "hop1": e["buffers"].get("intra_node"),
               "hop2": e["buffers"].get("inter_node")} for name, e in sd["params"].items()})
    fresh, fresh_params = filled_state(world, local, seed=1)
    checkpoint.load_state_dict(fresh, v1, fresh_params)
    assert same_state(sd, checkpoint.state_dict(fresh, fresh_params)) == []
    del v1["params"]["w"]["hop2"]
    with pytest.raises(LocoCheckpointError, match="parameter 'w': expected a dict with 'numel', 'hop1' and 'hop2'"):
        checkpoint.load_state_dict(fresh, v1, fresh_params)


def test_a_format_1_state_dict_as_written_then_loads_into_the_named_hops():
    """A format-1 dict as deepspeed-loco wrote it before the hops had names (literal keys, fp32 errors, W = 4,
    L = 2): "hop1" is the intra_node buffer (W rows), "hop2" the inter_node one (M rows)."""
    cols = 192  # the padded partition of 700 elements over 4 ranks in groups of 32
    hop1 = torch.arange(4 * cols, dtype=torch.float32).view(4, cols)
    hop2 = -torch.arange(2 * cols, dtype=torch.float32).view(2, cols)
    v1 = {"format": "deepspeed_loco.error_feedback", "version": 1, "step": 5,
          "signature": {"world_size": 4, "local_size": 2, "group_size": GROUP, "error_bits": 32, "hadamard": False,
                        "error_feedback": True, "intra_node_bits": 4, "inter_node_bits": 4},
          "params": {"w": {"ds_id": 0, "numel": 700, "hop1": {"values": hop1.clone(), "scale": None},
                           "hop2": {"values": hop2.clone(), "scale": None}}}}
    state = new_state(LocoConfig(group_size=GROUP, error_bits=32))
    checkpoint.load_state_dict(state, v1, {"w": torch.nn.Parameter(torch.zeros(100, 7))})
    buffers = state.buffers_for("w", 700, "cpu")
    assert state.step == 5 and set(buffers) == {"intra_node", "inter_node"}
    assert torch.equal(buffers["intra_node"].values, hop1) and torch.equal(buffers["inter_node"].values, hop2)


def test_load_allocates_buffers_on_parameters_that_have_none_yet():
    state, params = filled_state()
    fresh = ErrorFeedbackState(state.config, state.plan)
    new_params = {name: torch.nn.Parameter(torch.zeros(shape)) for name, shape in NAMES.items()}
    checkpoint.load_state_dict(fresh, checkpoint.state_dict(state, params), new_params)
    assert fresh.names() == tuple(NAMES)
    assert same_state(checkpoint.state_dict(state, params), checkpoint.state_dict(fresh, new_params)) == []


def test_an_entry_as_the_parameter_attribute_era_wrote_it_loads_and_is_written_the_same_way():
    """The on-disk entry, spelled out as releases that kept the buffers on the parameters wrote it (format 2), loads
    into the state, which keeps the buffers by name, and saving gives it back key for key and bit for bit."""
    gen = torch.Generator().manual_seed(4)

    def buffer(rows, cols):
        return {"values": torch.randint(-127, 128, (rows, cols), dtype=torch.int8, generator=gen),
                "scale": torch.rand(rows, cols // GROUP, generator=gen)}

    old = {"format": "deepspeed_loco.error_feedback", "version": 2,
           "signature": {"world_size": 4, "local_size": 2, "group_size": GROUP, "error_bits": 8, "hadamard": False,
                         "error_feedback": True, "intra_node_bits": 4, "inter_node_bits": 4},
           "step": 5, "params": {"w": {"ds_id": None, "numel": 700, "buffers": {"intra_node": buffer(4, 192),
                                                                                 "inter_node": buffer(2, 192)}}}}
    state = new_state(LocoConfig(group_size=GROUP))
    params = {"w": torch.nn.Parameter(torch.zeros(100, 7))}
    checkpoint.load_state_dict(state, old, params)
    assert state.step == 5 and state.names() == ("w", )
    inter = old["params"]["w"]["buffers"]["inter_node"]
    assert torch.equal(state.buffers_of("w")["inter_node"].values, inter["values"])
    saved = checkpoint.state_dict(state, params)
    assert list(saved) == list(old) and list(saved["params"]["w"]) == list(old["params"]["w"])
    assert saved["signature"] == old["signature"] and same_state(old, saved) == []


def test_a_state_with_no_buffers_saves_and_loads():
    state = new_state(LocoConfig(error_feedback=False))
    state.step = 3
    sd = checkpoint.state_dict(state, {})
    fresh = new_state(LocoConfig(error_feedback=False))
    checkpoint.load_state_dict(fresh, sd, {})
    assert sd["params"] == {} and fresh.step == 3


def _set(path, value):

    def edit(sd):
        node = sd
        for key in path[:-1]:
            node = node[key]
        if value is DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value(node[path[-1]]) if callable(value) else value
        return sd

    return edit


CORRUPTIONS = [
    (lambda sd: [sd], "is a list, expected a dict"),
    (_set(["params"], DELETE), "lacks field(s) ['params'] (truncated"),
    (_set(["format"], "something"), "format is 'something'"),
    (_set(["version"], 3), "format version 3 was written by another deepspeed-loco release"),
    (_set(["step"], -1), "step is -1"),
    (_set(["step"], 2.5), "step is 2.5"),
    (_set(["signature", "group_size"], DELETE), "signature lacks 'group_size'"),
    (_set(["signature", "world_size"], "4"), "signature['world_size'] is '4', of the wrong type"),
    (_set(["params"], [1, 2]), "params is a list"),
    (_set(["params", "nope"], {"numel": 1, "buffers": {}}),
     "buffers for parameter 'nope', which this model does not have"),
    (_set(["params", "w", "numel"], 999), "parameter 'w': saved for 999 elements, the model's parameter has 700"),
    (_set(["params", "w", "numel"], torch.tensor([700, 700])), "parameter 'w': saved for tensor([700, 700]) elements"),
    (_set(["signature"], {k: 1 for k in checkpoint.SIGNATURE_KEYS}), "signature['hadamard'] is 1, of the wrong type"),
    (_set(["params", "w", "buffers"], DELETE), "parameter 'w': expected a dict with 'numel' and 'buffers'"),
    (_set(["params", "w", "buffers"], [1]), "parameter 'w': buffers is list [1], expected a dict keyed by hop name"),
    (_set(["params", "w", "buffers", "inter_node"], None),
     "parameter 'w', inter_node: expected a dict with 'values' and 'scale', got NoneType"),
    (_set(["params", "w", "buffers", "inter_node"], DELETE),
     "parameter 'w', inter_node: expected a dict with 'values' and 'scale', got NoneType"),
    (_set(["params", "w", "buffers", "rack"], {}), "parameter 'w': buffers for hop(s) ['rack'], which this layout"),
    (_set(["params", "w", "buffers", "intra_node", "scale"], DELETE),
     "intra_node: expected a dict with 'values' and 'scale'"),
    (_set(["params", "w", "buffers", "intra_node", "values"], lambda t: t[:, :-GROUP]),
     "parameter 'w', intra_node, values: shape (4, 160), expected (4, 192) (truncated?)"),
    (_set(["params", "w", "buffers", "intra_node", "values"], lambda t: t[:2]),
     "intra_node, values: shape (2, 192), expected (4, 192)"),
    (_set(["params", "w", "buffers", "inter_node", "scale"], lambda t: t.reshape(-1)),
     "inter_node, scale: shape (12,), expected (2, 6)"),
    (_set(["params", "w", "buffers", "intra_node", "values"], lambda t: t.float()),
     "values: dtype torch.float32, expected torch.int8"),
    (_set(["params", "w", "buffers", "intra_node", "values"], lambda t: t.tolist()),
     "values: expected a torch.int8 tensor, got list"),
    (_set(["params", "bias", "buffers", "intra_node", "scale"],
          lambda t: t.index_fill(1, torch.tensor([0]), float("nan"))),
     "parameter 'bias', intra_node, scale: 4 non-finite value(s)"),
    (_set(["params", "tiny", "buffers", "inter_node", "scale"], lambda t: t.fill_(float("inf"))),
     "2 non-finite value(s)"),
]


@pytest.mark.parametrize("corrupt,expected", CORRUPTIONS)
def test_corrupt_entry_raises_naming_the_problem_and_touches_nothing(corrupt, expected):
    state, params = filled_state()
    before = checkpoint.state_dict(state, params)
    bad = corrupt(checkpoint.state_dict(state, params))
    with pytest.raises(LocoCheckpointError) as err:
        checkpoint.load_state_dict(state, bad, params)
    assert expected in str(err.value)
    assert same_state(before, checkpoint.state_dict(state, params)) == []  # validated before anything was touched


def test_non_finite_values_in_fp32_buffers_are_corrupt():
    state, params = filled_state(error_bits=32)
    sd = checkpoint.state_dict(state, params)
    sd["params"]["w"]["buffers"]["inter_node"]["values"][1, 3] = float("nan")
    with pytest.raises(LocoCheckpointError, match=r"parameter 'w', inter_node, values: 1 non-finite value\(s\)"):
        checkpoint.load_state_dict(state, sd, params)


@pytest.mark.parametrize("change,text", [
    (dict(world=8), "world_size 8 -> 4"),
    (dict(local=1), "local_size 1 -> 2"),
    (dict(group_size=64), "group_size 64 -> 32"),
    (dict(error_bits=32), "error_bits 32 -> 8"),
    (dict(hadamard=True), "hadamard True -> False"),
    (dict(error_feedback=False), "error_feedback False -> True"),
])
def test_another_layout_is_a_mismatch_naming_old_and_new(change, text):
    world, local = change.pop("world", 4), change.pop("local", 2)
    config = LocoConfig(**{"group_size": GROUP, **change})
    old = new_state(config, world, local)
    old.step = 11
    state, params = filled_state()
    with pytest.raises(LocoCheckpointMismatch) as err:
        checkpoint.load_state_dict(state, checkpoint.state_dict(old, {}), params)
    assert text in str(err.value) and err.value.step == 11


def test_other_wire_bits_keep_the_buffers():
    state, params = filled_state(intra_node_bits=8, inter_node_bits=2)
    fresh, fresh_params = filled_state(seed=3)
    checkpoint.load_state_dict(fresh, checkpoint.state_dict(state, params), fresh_params)
    differs = same_state(checkpoint.state_dict(state, params), checkpoint.state_dict(fresh, fresh_params))[0]
    assert differs.startswith("step/signature")
    assert all(torch.equal(a.dequantize(), b.dequantize()) for a, b in zip(state.buffers(), fresh.buffers()))


class _StubOptimizer:
    """Stands in for DeepSpeed's ZeRO-3 optimizer in one process: same ``load_state_dict`` signature."""
    dp_process_group = None

    def __init__(self):
        self.loaded = []

    def step(self):
        raise AssertionError("not stepped in these tests")

    def _stock_reduce(self, params, communication_data_type):
        raise AssertionError("not reduced in these tests")  # the bucket reduce LoCo replaces (set below the class)

    def state_dict(self):
        return {"ds": 1}

    def load_state_dict(self, state_dict_list, load_optimizer_states=True, load_from_fp32_weights=False,
                        checkpoint_folder=None, load_serial=None, param_shapes=None):
        self.loaded.append((state_dict_list, checkpoint_folder))


setattr(_StubOptimizer, private_names().reduce, _StubOptimizer._stock_reduce)  # its name in the seam's table


class _StubHook:

    def __init__(self, state):
        self.state = state
        self.optimizer = _StubOptimizer()


def _hooked(**cfg):
    state, params = filled_state(**cfg)
    hook = _StubHook(state)
    stage3_hook.patch_optimizer(hook.optimizer, state, params, reduce=None, after_step=None)
    hook.params = params
    return hook


def test_optimizer_state_dict_gains_the_entry_and_the_loader_never_sees_it():
    hook = _hooked()
    sd = hook.optimizer.state_dict()
    assert sd["ds"] == 1 and sd[checkpoint.STATE_KEY]["step"] == 7
    other = _hooked(seed=5)
    other.state.step = 0
    with loco_warnings() as warned:
        other.optimizer.load_state_dict([sd])
    assert warned == [] and checkpoint.STATE_KEY not in other.optimizer.loaded[0][0][0]
    assert other.state.step == 7 and all(
        torch.equal(a.dequantize(), b.dequantize()) for a, b in zip(hook.state.buffers(), other.state.buffers()))


@pytest.mark.parametrize("kwargs,why", [
    (dict(state_dict_list=None, checkpoint_folder="/ckpt/universal"), "a universal checkpoint carries no LoCo"),
    (dict(state_dict_list=[{"ds": 1}]), "has no 'deepspeed_loco' entry"),
    (dict(state_dict_list="SAVED", load_optimizer_states=False), "load_optimizer_states=False"),
])
def test_states_without_loco_entry_reset_with_a_warning(kwargs, why):
    hook = _hooked()
    if kwargs["state_dict_list"] == "SAVED":
        kwargs["state_dict_list"] = [hook.optimizer.state_dict()]
    with loco_warnings() as warned:
        hook.optimizer.load_state_dict(**kwargs)
    assert len(warned) == 1 and why in warned[0] and "buffers start from zero" in warned[0]
    assert not any(bool(b.dequantize().any()) for b in hook.state.buffers())
    assert hook.state.step == 7 and len(hook.optimizer.loaded) == 1


def test_corrupt_entry_is_an_error_before_deepspeed_loads_anything():
    hook = _hooked()
    sd = hook.optimizer.state_dict()
    intra = sd[checkpoint.STATE_KEY]["params"]["w"]["buffers"]["intra_node"]
    intra["values"] = intra["values"][:, :7]
    before = checkpoint.state_dict(hook.state, hook.params)
    with pytest.raises(LocoCheckpointError, match=r"shape \(4, 7\).*on_corrupt_checkpoint"):
        hook.optimizer.load_state_dict([sd])
    assert hook.optimizer.loaded == []
    assert same_state(before, checkpoint.state_dict(hook.state, hook.params)) == []


def test_reset_policy_turns_a_corrupt_entry_into_a_warning():
    hook = _hooked(on_corrupt_checkpoint="reset")
    sd = hook.optimizer.state_dict()
    sd[checkpoint.STATE_KEY]["step"] = "seven"
    with loco_warnings() as warned:
        hook.optimizer.load_state_dict([sd])
    assert len(warned) == 1 and "step is 'seven'" in warned[0] and "on_corrupt_checkpoint is 'reset'" in warned[0]
    assert warned[0].startswith("deepspeed-loco: rank 0: error-feedback buffers start from zero: ")
    assert warned[0].count("deepspeed-loco:") == 1  # the reason is not prefixed a second time
    assert not any(bool(b.dequantize().any()) for b in hook.state.buffers()) and hook.state.step == 7
    assert len(hook.optimizer.loaded) == 1


def test_layout_mismatch_keeps_the_saved_step():
    state = new_state(LocoConfig(group_size=GROUP, error_bits=32))
    state.step = 42
    hook = _hooked()
    with loco_warnings() as warned:
        hook.optimizer.load_state_dict([{checkpoint.STATE_KEY: checkpoint.state_dict(state, {})}])
    assert len(warned) == 1 and "error_bits 32 -> 8" in warned[0]
    assert hook.state.step == 42 and not any(bool(b.dequantize().any()) for b in hook.state.buffers())
