"""LoCo's error-feedback state in checkpoints.

Real DeepSpeed ZeRO-3 engines on 4 gloo processes (2 nodes x 2 ranks) for save/resume, checkpoints of format 2
(written before the error-state file), layout changes and corrupt entries, and on 2 processes for
``checkpoint_error_state: false`` and error-state files cut short or missing; single-process tests of the file's
bounded host staging and of the format's checks (every rule of ``runtime/zero/checkpoint.py``).
"""
import copy
import logging
import os
import shutil
import weakref
from contextlib import contextmanager

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

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


def inline_entry(state, named_params):
    """LoCo's entry as deepspeed-loco wrote it before the error-state file (format 2: every buffer inline, as CPU
    copies, in the optimizer file): the old writer, kept to check that such checkpoints still load, and a snapshot
    of a state to compare."""
    saved = state.state_dict()
    return {"format": checkpoint.FORMAT, "version": 2, "signature": checkpoint.signature(state),
            "step": int(saved["step"]), "params": {
                name: {"ds_id": getattr(named_params[name], "ds_id", None), **entry}
                for name, entry in saved["params"].items()}}


def snapshot(hook, engine):
    return inline_entry(hook.state, named(engine))


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


def copy_checkpoint(src, dst):
    """Copies checkpoint ``src/TAG`` to ``dst/TAG`` (rank 0; every rank waits for it)."""
    if torch.distributed.get_rank() == 0:
        shutil.copytree(os.path.join(src, TAG), os.path.join(dst, TAG))
        shutil.copy(os.path.join(src, "latest"), os.path.join(dst, "latest"))
    torch.distributed.barrier()


def rewrite_zero_file(engine, src, dst, edit):
    """Copies checkpoint ``src`` to ``dst``, then each rank applies ``edit(loco_entry)`` to its own
    ``zero_pp_rank_*`` file (``edit`` returns the new entry, or a sentinel to delete it)."""
    copy_checkpoint(src, dst)
    path = engine._get_zero_ckpt_name(dst, TAG)
    sd = torch.load(path, weights_only=False)
    entry = edit(sd["optimizer_state_dict"].pop(checkpoint.STATE_KEY))
    if entry is not DELETE:
        sd["optimizer_state_dict"][checkpoint.STATE_KEY] = entry
    torch.save(sd, path)
    torch.distributed.barrier()


def error_file(engine, root):
    """This rank's error-state file in checkpoint ``root``."""
    return os.path.join(root, TAG, checkpoint.error_file_name(engine._get_zero_ckpt_name(root, TAG)))


DELETE = object()


def truncated_on_rank_2(entry):
    """A copy of a format-2 ``entry``, whose intra-node buffer of ``a.weight`` lacks a group on rank 2."""
    entry = copy.deepcopy(entry)
    if torch.distributed.get_rank() == 2:
        intra = entry["params"]["a.weight"]["buffers"]["intra_node"]
        intra["values"] = intra["values"][:, :-GROUP].clone()
    return entry


# ------------------------------------------------------------------------------------------- engine tests
def resume_and_faults(root):
    """The whole engine scenario on one rank; returns facts to assert (no assert inside a rank)."""
    ckpt, stripped, old, corrupt = (os.path.join(root, d) for d in ("ckpt", "stripped", "old", "corrupt"))
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
    manifest = torch.load(engine._get_zero_ckpt_name(ckpt, TAG), weights_only=False)["optimizer_state_dict"][
        checkpoint.STATE_KEY]
    out["manifest"] = {k: manifest[k] for k in ("version", "error_state", "step", "file")}
    out["error_file_bytes"] = (manifest["bytes"], os.path.getsize(error_file(engine, ckpt)))
    out["saved_nonzero_buffers"] = not all_zero(hook)
    out["saved_names"] = sorted(saved["params"])
    out["frozen_or_unused_buffers"] = [n for n in hook.state.names() if n.startswith(("frozen", "unused"))]
    reference = train(engine, K, N)
    out["reference_resets"] = hook.state.step  # K + N: a reset at step 8 happened inside the compared window
    rewrite_zero_file(engine, ckpt, stripped, lambda entry: DELETE)
    rewrite_zero_file(engine, ckpt, old, lambda entry: saved)  # as deepspeed-loco wrote it before format 3
    rewrite_zero_file(engine, ckpt, corrupt, lambda entry: truncated_on_rank_2(saved))

    # resumed in a fresh engine, from this release's checkpoint and from one of format 2
    for label, source in (("resume", ckpt), ("old", old)):
        engine, hook = make_engine()
        with loco_warnings() as warned:
            engine.load_checkpoint(source, tag=TAG)
        out[f"{label}_warnings"] = warned
        out[f"{label}_step"] = hook.state.step
        out[f"{label}_state_diffs"] = same_state(saved, snapshot(hook, engine))
        resumed = train(engine, K, N)
        out[f"{label}_unequal_steps"] = [i for i in range(N) if not torch.equal(reference[i], resumed[i])]

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

    # rank 2's format-2 entry truncated: every rank raises before the optimizer state is loaded ...
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


def test_the_optimizer_file_holds_a_manifest_and_the_buffers_a_file_beside_it(scenario):
    for r in scenario:
        assert r["manifest"]["version"] == 3 and r["manifest"]["error_state"] == "file" and r["manifest"]["step"] == K
        assert r["manifest"]["file"] == f"zero_pp_rank_{r['rank']}_mp_rank_00_optim_states.loco_errors"
        assert r["error_file_bytes"][0] == r["error_file_bytes"][1]


@pytest.mark.parametrize("label", ["resume", "old"])
def test_resume_from_step_k_reproduces_the_uninterrupted_run_bit_for_bit(scenario, label):
    """From this release's checkpoint and from one as format 2 wrote it (buffers inline in the optimizer file)."""
    for r in scenario:
        assert r[f"{label}_warnings"] == []
        assert r[f"{label}_step"] == K
        assert r[f"{label}_state_diffs"] == []
        assert r["reference_resets"] == K + N
        assert r[f"{label}_unequal_steps"] == [], f"rank {r['rank']}"


def test_stock_deepspeed_and_zero_to_fp32_read_a_loco_checkpoint(scenario):
    assert all(r["stock_loads"] for r in scenario)
    assert scenario[0]["zero_to_fp32"]


def _once_by_rank0(scenario, label):
    """The one warning of ``label`` that rank 0 printed for every rank (the others printed none)."""
    assert all(r[f"{label}_warnings"] == [] for r in scenario if r["rank"] != 0)
    (line, ) = scenario[0][f"{label}_warnings"]
    return line


def test_checkpoint_without_loco_state_resets_with_a_warning_and_the_run_differs(scenario):
    line = _once_by_rank0(scenario, "stripped")
    assert f"ranks 0-{WORLD - 1}: error-feedback buffers start from zero" in line
    assert "has no 'deepspeed_loco' entry" in line
    for r in scenario:
        assert r["stripped_zero"]
        # the resume test can fail: not restoring the buffers changes the parameters
        assert r["stripped_unequal_steps"], f"rank {r['rank']}"


def test_different_layout_resets_with_a_warning_naming_old_and_new(scenario):
    line = _once_by_rank0(scenario, "layout")
    assert f"ranks 0-{WORLD - 1}:" in line and "local_size 2 -> 4" in line
    assert "W=4 L=2" in line and "W=4 L=4" in line
    for r in scenario:
        assert r["layout_zero"] and r["layout_step"] == K and r["layout_trains"]


def test_corrupt_entry_on_one_rank_is_the_same_clear_error_on_every_rank(scenario):
    for r in scenario:
        message = r["corrupt_error"]
        assert message is not None and r["corrupt_step"] == 0
        assert message == scenario[0]["corrupt_error"]
        assert "could not be loaded on rank(s) [2] (rank 2: checkpoint key 'deepspeed_loco', parameter 'a.weight', " \
            "intra_node, values: shape (4, 96), expected (4, 128) (truncated?))" in message
        assert "on_corrupt_checkpoint" in message


def test_corrupt_entry_resets_that_rank_when_the_config_asks(scenario):
    line = _once_by_rank0(scenario, "corrupt_reset")
    assert "rank 2: error-feedback buffers start from zero" in line and "truncated" in line
    for r in scenario:
        assert r["corrupt_reset_trains"]
        if r["rank"] == 2:
            assert r["corrupt_reset_zero"]
        else:
            assert r["corrupt_reset_diffs"] == []


# ------------------------------------------------ 2 processes: error state left out, files cut short or missing
def left_out_and_unreadable(root):
    """The 2-process scenario on one rank; returns facts to assert."""
    ckpt, lean, cut, gone = (os.path.join(root, d) for d in ("ckpt", "lean", "cut", "gone"))
    dist = torch.distributed
    rank = dist.get_rank()
    out = {"rank": rank}
    engine, hook = make_engine()
    train(engine, 0, K)
    engine.save_checkpoint(ckpt, tag=TAG)

    # checkpoint_error_state false: no error-state file; resumed in a run that has error feedback, the buffers
    # start from zero, the step counter is restored, and rank 0 says so once
    engine, hook = make_engine(checkpoint_error_state=False)
    train(engine, 0, K)
    engine.save_checkpoint(lean, tag=TAG)
    out["lean_files"] = sorted(f for f in os.listdir(os.path.join(lean, TAG)) if "loco" in f)
    out["lean_status"] = torch.load(engine._get_zero_ckpt_name(lean, TAG), weights_only=False)[
        "optimizer_state_dict"][checkpoint.STATE_KEY]["error_state"]
    engine, hook = make_engine()
    with loco_warnings() as warned:
        engine.load_checkpoint(lean, tag=TAG)
    out["lean_warnings"], out["lean_zero"], out["lean_step"] = warned, all_zero(hook), hook.state.step
    out["lean_trains"] = bool(torch.isfinite(train(engine, K, 2)[-1]).all()) and not all_zero(hook)

    # rank 1's error-state file cut in half; rank 0's missing: every rank raises, naming the rank and its file
    copy_checkpoint(ckpt, cut)
    copy_checkpoint(ckpt, gone)
    out["cut_file"], out["gone_file"] = error_file(engine, cut), error_file(engine, gone)
    if rank == 1:
        os.truncate(out["cut_file"], os.path.getsize(out["cut_file"]) // 2)
    if rank == 0:
        os.remove(out["gone_file"])
    dist.barrier()
    for label, source in (("cut", cut), ("gone", gone)):
        engine, hook = make_engine()
        try:
            engine.load_checkpoint(source, tag=TAG)
            out[label] = None
        except LocoCheckpointError as err:
            out[label] = str(err)
        out[f"{label}_step"], out[f"{label}_zero"] = hook.state.step, all_zero(hook)
    together = torch.ones(1)
    dist.all_reduce(together)  # every rank raised and went on: none is left waiting in a collective
    out["together"] = int(together.item())
    return out


@pytest.fixture(scope="module")
def two_ranks(process_pool, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("loco_ckpt_2"))
    return process_pool(2).run(left_out_and_unreadable, root)


def test_checkpoint_error_state_false_saves_no_buffers_and_a_resume_starts_them_from_zero(two_ranks):
    for r in two_ranks:
        assert r["lean_files"] == [] and r["lean_status"] == "left_out"
        assert r["lean_zero"] and r["lean_step"] == K and r["lean_trains"]
    assert two_ranks[1]["lean_warnings"] == []
    (line, ) = two_ranks[0]["lean_warnings"]
    assert "ranks 0, 1: error-feedback buffers start from zero" in line and "checkpoint_error_state false" in line
    assert f"optimizer step {K}" in line


@pytest.mark.parametrize("label,bad_rank,problem", [("cut", 1, "cut short"), ("gone", 0, "file is missing")])
def test_an_unreadable_error_state_file_fails_on_every_rank_naming_the_rank_and_the_file(two_ranks, label, bad_rank,
                                                                                         problem):
    bad_file = two_ranks[bad_rank][f"{label}_file"]
    for r in two_ranks:
        message = r[label]
        assert message is not None and "\n" not in message and r[f"{label}_step"] == 0
        assert f"could not be loaded on rank(s) [{bad_rank}] (rank {bad_rank}: " in message
        assert bad_file in message and problem in message
        assert r["together"] == 2
    assert two_ranks[bad_rank][f"{label}_zero"]


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


def saved_entry(state, params, folder):
    """LoCo's entry as the engine saves it in ``folder`` (its error-state file written beside the optimizer file)
    and loads it back."""
    path = os.path.join(str(folder), "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    entry = checkpoint.write_entry(state, params, checkpoint.manifest(state), path)
    torch.save(entry, path)
    return checkpoint.locate(torch.load(path, weights_only=True), path)


def load(state, entry, params, rank=0):
    """Loads ``entry`` into ``state`` as the optimizer's ``load_state_dict`` does on one rank."""
    checkpoint.apply_decision(state, checkpoint.decide_load(state, entry, params, False, True), rank)


def file_of(entry):
    return os.path.join(os.path.dirname(entry["loaded_from"]), entry["file"])


@pytest.mark.parametrize("world,local,cfg", [(4, 2, {}), (4, 2, dict(error_bits=4)), (4, 2, dict(error_bits=32)),
                                             (4, 1, {}), (4, 4, dict(error_bits=4)), (8, 2, dict(error_bits=32)),
                                             (8, 2, dict(error_feedback="inter_node", error_bits=4))])
def test_error_state_file_round_trips(world, local, cfg, tmp_path):
    state, params = filled_state(world, local, **cfg)
    entry = saved_entry(state, params, tmp_path)
    assert entry["error_state"] == "file" and os.path.getsize(file_of(entry)) == entry["bytes"]
    fresh, fresh_params = filled_state(world, local, seed=1, **cfg)
    fresh.step = 0
    load(fresh, entry, fresh_params)
    assert fresh.step == 7
    assert same_state(inline_entry(state, params), inline_entry(fresh, fresh_params)) == []


class HostAllocations(TorchDispatchMode):
    """Tracks the bytes of the tensor storages that ops create (not views, not in-place results) while their tensors
    are alive: ``peak`` is the most alive at once."""

    def __init__(self):
        super().__init__()
        self.alive = self.peak = 0

    def _freed(self, nbytes):
        self.alive -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if torch.is_tensor(t)}
        for tensor in pytree.tree_leaves(out):
            if torch.is_tensor(tensor) and tensor.untyped_storage().data_ptr() not in inputs:
                nbytes = tensor.untyped_storage().nbytes()
                self.alive += nbytes
                self.peak = max(self.peak, self.alive)
                weakref.finalize(tensor, self._freed, nbytes)
        return out


def test_saving_and_loading_stage_at_most_the_chunk_in_host_memory(tmp_path):
    """60 parameters (up to 5000 elements, W = 4, L = 2, int8 and fp32 scales) through 1 KiB of host staging."""
    chunk = 1024
    config = LocoConfig(group_size=GROUP)
    state, fresh = new_state(config), new_state(config)
    params = {f"p{i}": torch.nn.Parameter(torch.zeros(83 * i + 1)) for i in range(60)}
    gen = torch.Generator().manual_seed(0)
    for name, param in params.items():
        for buffer in state.buffers_for(name, param.numel(), "cpu").values():
            buffer.store_(torch.randn(buffer.shape, generator=gen))
        fresh.buffers_for(name, param.numel(), "cpu")  # allocated before: the load only fills them
    path = str(tmp_path / "errors")
    with HostAllocations() as saving:
        checkpoint.write_error_file(state, params, path, "t", chunk_bytes=chunk)
    with HostAllocations() as loading:
        restored = checkpoint.read_error_file(fresh, params, path, "t", chunk_bytes=chunk)
    with HostAllocations() as copying_all:  # the instrument sees a save that copies everything to the host
        state.state_dict()
    assert state.memory_bytes() > 100 * chunk and copying_all.peak >= state.memory_bytes()
    assert saving.peak <= chunk and loading.peak <= chunk + 16  # + aminmax's two fp32 scalars (finiteness check)
    assert restored == 60 and same_state(inline_entry(state, params), inline_entry(fresh, params)) == []


@pytest.mark.parametrize("world,local", [(4, 2), (4, 1), (4, 4)])
def test_version_1_files_load_with_their_hop1_hop2_keys(world, local):
    """Format 1 (before hop names) stored the intra-node buffer as "hop1" and the inter-node one as "hop2"."""
    state, params = filled_state(world, local)
    sd = inline_entry(state, params)
    v1 = dict(sd, version=1, params={
        name: {"ds_id": e["ds_id"], "numel": e["numel"], "hop1": e["buffers"].get("intra_node"),
               "hop2": e["buffers"].get("inter_node")} for name, e in sd["params"].items()})
    fresh, fresh_params = filled_state(world, local, seed=1)
    checkpoint.load_state_dict(fresh, v1, fresh_params)
    assert same_state(sd, inline_entry(fresh, fresh_params)) == []
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
    checkpoint.load_state_dict(fresh, inline_entry(state, params), new_params)
    assert fresh.names() == tuple(NAMES)
    assert same_state(inline_entry(state, params), inline_entry(fresh, new_params)) == []


def test_an_entry_as_the_parameter_attribute_era_wrote_it_loads_and_this_release_saves_it_bit_for_bit(tmp_path):
    """The on-disk entry, spelled out as releases that kept the buffers on the parameters wrote it (format 2), loads
    into the state, which keeps the buffers by name; saved again (error-state file) and read back, it is the same."""
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
    fresh = new_state(LocoConfig(group_size=GROUP))
    load(fresh, saved_entry(state, params, tmp_path), params)
    saved = inline_entry(fresh, params)
    assert list(saved) == list(old) and list(saved["params"]["w"]) == list(old["params"]["w"])
    # the signature gained exact_own_block since (absent: false, the only behaviour there was)
    assert saved["signature"] == {**old["signature"], "exact_own_block": False}
    assert same_state(dict(old, signature=saved["signature"]), saved) == []


def test_a_state_with_no_buffers_saves_and_loads(tmp_path):
    state = new_state(LocoConfig(error_feedback=False))
    state.step = 3
    entry = saved_entry(state, {}, tmp_path)
    fresh = new_state(LocoConfig(error_feedback=False))
    load(fresh, entry, {})
    assert entry["error_state"] == "none" and os.listdir(tmp_path) == ["zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert fresh.step == 3
    checkpoint.load_state_dict(fresh, inline_entry(state, {}), {})  # the same as format 2 wrote it
    assert fresh.step == 3


def test_checkpoint_error_state_false_saves_no_buffers_and_rank_0_alone_says_they_start_from_zero(tmp_path):
    state, params = filled_state(checkpoint_error_state=False)
    entry = saved_entry(state, params, tmp_path)
    assert entry["error_state"] == "left_out" and entry["step"] == 7 and "file" not in entry
    assert os.listdir(tmp_path) == ["zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    for rank, lines in ((0, 1), (1, 0)):
        fresh, fresh_params = filled_state(seed=1)  # checkpoint_error_state true: the key rules saves only
        fresh.step = 0
        with loco_warnings() as warned:
            load(fresh, entry, fresh_params, rank)
        assert len(warned) == lines and fresh.step == 7
        assert not any(bool(b.dequantize().any()) for b in fresh.buffers())
    assert "zeropp_loco_param.checkpoint_error_state false" in warned[0] if lines else True


def _cut(size):
    return lambda path: os.truncate(path, size(os.path.getsize(path)))


def _flip_byte(at):

    def flip(path):
        with open(path, "r+b") as f:
            f.seek(at(os.path.getsize(path)))
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))

    return flip


def _append(path):
    with open(path, "ab") as f:
        f.write(b"\0")


DAMAGE = [
    (_cut(lambda n: n // 2), "(the file was cut short)"),
    (_cut(lambda n: 12), "not a deepspeed-loco error-state file (12 bytes"),
    (_cut(lambda n: 40), "shorter than its header of"),
    (_cut(lambda n: n - 3), "bytes, its header says"),
    (_cut(lambda n: 0), "not a deepspeed-loco error-state file (0 bytes"),
    (os.remove, ": the error-state file is missing"),
    (_append, "(too long)"),
    (_flip_byte(lambda n: n - 100), "CRC-32 mismatch"),
    (_flip_byte(lambda n: n - 3), "the end marker is missing"),
    (_flip_byte(lambda n: 16), "could not be read (JSONDecodeError"),
]


@pytest.mark.parametrize("damage,expected", DAMAGE)
def test_an_error_state_file_that_cannot_be_read_is_an_error_naming_it_and_leaves_zero_buffers(damage, expected,
                                                                                                tmp_path):
    state, params = filled_state()
    entry = saved_entry(state, params, tmp_path)
    damage(file_of(entry))
    fresh, fresh_params = filled_state(seed=1)
    fresh.step = 0
    decision = checkpoint.decide_load(fresh, entry, fresh_params, False, True)
    assert decision.kind == "error" and file_of(entry) in decision.why and expected in decision.why
    assert not any(bool(b.dequantize().any()) for b in fresh.buffers())
    with pytest.raises(LocoCheckpointError) as err:
        checkpoint.apply_decision(fresh, decision, 3)
    assert f"could not be loaded on rank(s) [3] (rank 3: {file_of(entry)}" in str(err.value) and fresh.step == 0


def test_a_file_of_another_save_another_model_or_non_finite_scales_is_an_error(tmp_path):
    state, params = filled_state()
    entry = saved_entry(state, params, tmp_path)
    with pytest.raises(LocoCheckpointError, match="was written by another save than the optimizer file beside it"):
        checkpoint.read_error_file(state, params, file_of(entry), "another token")
    smaller = {**params, "w": torch.nn.Parameter(torch.zeros(50, 7))}
    with pytest.raises(LocoCheckpointError, match=r"parameter 'w' saved for 700 elements, the model's has 350"):
        checkpoint.read_error_file(state, smaller, file_of(entry), entry["token"])
    wider = new_state(LocoConfig(group_size=GROUP, error_bits=32))
    with pytest.raises(LocoCheckpointError, match=r"record 0 is 'w' intra_node values torch.int8 \(4, 192\), this "
                       r"layout expects 'w' intra_node values torch.float32 \(4, 192\)"):
        checkpoint.read_error_file(wider, params, file_of(entry), entry["token"])
    state.buffers_of("bias")["inter_node"].scale[1, 0] = float("inf")  # never stored so: written, found on reading
    entry = saved_entry(state, params, tmp_path)
    with pytest.raises(LocoCheckpointError, match=r"parameter 'bias', inter_node, scale: non-finite value"):
        checkpoint.read_error_file(state, params, file_of(entry), entry["token"])


@pytest.mark.parametrize("edit,expected", [
    (lambda e: dict(e, error_state="elsewhere"), "error_state is str 'elsewhere', expected one of"),
    (lambda e: dict(e, file="../other.loco_errors"), "file is str '../other.loco_errors', expected the name of a file"),
    (lambda e: dict(e, token=None), "token is NoneType None, expected a string"),
    (lambda e: {k: v for k, v in e.items() if k != "loaded_from"}, "was not read through the engine's checkpoint"),
    (lambda e: dict(e, error_state="none"), "says the layout keeps no buffers but its signature says it does"),
])
def test_a_corrupt_manifest_is_an_error(edit, expected, tmp_path):
    state, params = filled_state()
    decision = checkpoint.decide_load(state, edit(saved_entry(state, params, tmp_path)), params, False, True)
    assert decision.kind == "error" and expected in decision.why


def test_a_manifest_taken_outside_the_checkpoint_engine_resets_with_a_warning():
    state, params = filled_state()
    entry = checkpoint.manifest(state)  # what optimizer.state_dict() holds before the checkpoint engine saves it
    with loco_warnings() as warned:
        load(state, entry, params)
    assert len(warned) == 1 and "saved outside the engine's checkpoint engine" in warned[0] and state.step == 7
    assert not any(bool(b.dequantize().any()) for b in state.buffers())


@pytest.mark.parametrize("option", [dict(error_bits=8), dict(error_bits=4), dict(error_feedback="inter_node"),
                                    dict(error_feedback="inter_node", error_bits=4),
                                    dict(checkpoint_error_state=False)])
def test_saved_bytes_are_the_bytes_a_save_writes(option, tmp_path):
    """One parameter of 10^5 elements at W = 16, L = 8: the file holds exactly ``saved_bytes`` of buffers."""
    config = LocoConfig(**option)
    state = new_state(config, 16, 8)
    params = {"w": torch.nn.Parameter(torch.zeros(100_000))}
    state.buffers_for("w", 100_000, "cpu")
    entry = saved_entry(state, params, tmp_path)
    expected = checkpoint.saved_bytes(config, 16, 8, 100_000)
    if not config.checkpoint_error_state:
        assert expected == 0 and entry["error_state"] == "left_out"
        return
    with open(file_of(entry), "rb") as f:
        header = int.from_bytes(f.read(16)[8:], "little")
    records = len(state.rows()) * 2
    assert expected == state.memory_bytes() > 0
    assert entry["bytes"] == 8 + 8 + header + expected + 4 * records + 8


@pytest.mark.parametrize("option", [dict(error_bits=8), dict(error_bits=4), dict(error_feedback="inter_node"),
                                    dict(error_feedback="inter_node", error_bits=4),
                                    dict(checkpoint_error_state=False)])
def test_a_ranks_checkpoint_holds_its_error_state_per_gpu_or_nothing(option):
    """Per parameter of a large tensor (whole groups per partition), a rank's checkpoint holds what
    ``python -m deepspeed_loco.perf memory`` states for the rank's error state, and nothing with
    ``checkpoint_error_state: false`` (the table in docs/checkpointing.md)."""
    from deepspeed_loco.runtime.comm.error_feedback import error_bytes_per_parameter
    config = LocoConfig(**option)
    numel = 512 * 256 * 1000
    per_parameter = checkpoint.saved_bytes(config, 512, 8, numel) / numel
    expected = error_bytes_per_parameter(512, 8, config) if config.checkpoint_error_state else 0
    assert per_parameter == pytest.approx(expected, rel=1e-12)


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
    (_set(["version"], 4), "format version 4 was written by another deepspeed-loco release"),
    (_set(["version"], 3), "a version-3 manifest, whose buffers are in a file of their own"),
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
    before = inline_entry(state, params)
    bad = corrupt(inline_entry(state, params))
    with pytest.raises(LocoCheckpointError) as err:
        checkpoint.load_state_dict(state, bad, params)
    assert expected in str(err.value)
    assert same_state(before, inline_entry(state, params)) == []  # validated before anything was touched


def test_non_finite_values_in_fp32_buffers_are_corrupt():
    state, params = filled_state(error_bits=32)
    sd = inline_entry(state, params)
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
    (dict(exact_own_block=True), "exact_own_block True -> False"),
])
def test_another_layout_is_a_mismatch_naming_old_and_new(change, text):
    world, local = change.pop("world", 4), change.pop("local", 2)
    config = LocoConfig(**{"group_size": GROUP, **change})
    old = new_state(config, world, local)
    old.step = 11
    state, params = filled_state()
    with pytest.raises(LocoCheckpointMismatch) as err:
        checkpoint.load_state_dict(state, inline_entry(old, {}), params)
    assert text in str(err.value) and err.value.step == 11


def test_a_signature_saved_before_exact_own_block_existed_reads_as_false():
    """Checkpoints written before the key have no ``exact_own_block`` in their signature: they load into a run
    without it, and are another layout for a run with it (its buffers have fewer rows)."""
    state, params = filled_state()
    old = inline_entry(state, params)
    del old["signature"]["exact_own_block"]
    fresh, fresh_params = filled_state(seed=2)
    checkpoint.load_state_dict(fresh, copy.deepcopy(old), fresh_params)
    assert all(torch.equal(a.values, b.values) for a, b in zip(state.buffers(), fresh.buffers()))
    exact, exact_params = filled_state(exact_own_block=True)
    with pytest.raises(LocoCheckpointMismatch, match="exact_own_block False -> True") as err:
        checkpoint.load_state_dict(exact, old, exact_params)
    assert err.value.step == 7


@pytest.mark.parametrize("world,local", [(4, 2), (4, 1), (4, 4)])
def test_buffers_of_an_exact_own_block_round_trip_through_the_error_state_file(world, local, tmp_path):
    state, params = filled_state(world, local, exact_own_block=True)
    assert state.rows() == state.plan.error_rows()
    assert all(b.shape[0] == state.rows()[hop] for name in params for hop, b in state.buffers_of(name).items())
    entry = saved_entry(state, params, tmp_path)
    assert entry["signature"]["exact_own_block"] is True
    fresh, fresh_params = filled_state(world, local, seed=1, exact_own_block=True)
    load(fresh, entry, fresh_params)
    assert same_state(inline_entry(state, params), inline_entry(fresh, fresh_params)) == []


def test_other_wire_bits_keep_the_buffers():
    state, params = filled_state(intra_node_bits=8, inter_node_bits=2)
    fresh, fresh_params = filled_state(seed=3)
    checkpoint.load_state_dict(fresh, inline_entry(state, params), fresh_params)
    differs = same_state(inline_entry(state, params), inline_entry(fresh, fresh_params))[0]
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


class _StubCheckpointEngine:
    """Stands in for DeepSpeed's checkpoint engine: saves and loads through torch."""

    def save(self, state_dict, path):
        torch.save(state_dict, path)

    def load(self, path, map_location=None):
        return torch.load(path, map_location=map_location, weights_only=True)


class _StubHook:

    def __init__(self, state):
        self.state = state
        self.optimizer = _StubOptimizer()
        self.files = _StubCheckpointEngine()


def _hooked(**cfg):
    """A stub optimizer and checkpoint engine, wired to a filled state as ``stage3_hook.attach`` wires an engine's."""
    state, params = filled_state(**cfg)
    hook = _StubHook(state)
    hook.patch = stage3_hook.patch_optimizer(hook.optimizer, state, params, reduce=None, after_step=None)
    hook.patch.watch_files(hook.files, locate=checkpoint.locate,
                           write=lambda entry, path: checkpoint.write_entry(state, params, entry, path))
    hook.params = params
    return hook


def test_the_optimizer_file_gets_a_manifest_the_buffers_a_file_beside_it_and_deepspeed_never_sees_them(tmp_path):
    hook = _hooked()
    path = str(tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    hook.files.save({"optimizer_state_dict": hook.optimizer.state_dict()}, path)
    on_disk = torch.load(path, weights_only=True)["optimizer_state_dict"]
    assert on_disk["ds"] == 1 and on_disk[checkpoint.STATE_KEY]["error_state"] == "file"
    assert sorted(os.listdir(tmp_path)) == ["zero_pp_rank_0_mp_rank_00_optim_states.loco_errors",
                                            "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    other = _hooked(seed=5)
    other.state.step = 0
    loaded = other.files.load(path, map_location="cpu")
    with loco_warnings() as warned:
        other.optimizer.load_state_dict([loaded["optimizer_state_dict"]])
    assert warned == [] and checkpoint.STATE_KEY not in other.optimizer.loaded[0][0][0]
    assert other.state.step == 7 and same_state(inline_entry(hook.state, hook.params),
                                                inline_entry(other.state, other.params)) == []
    other.patch.restore()  # the checkpoint engine's own methods again
    assert "save" not in vars(other.files) and "load" not in vars(other.files)


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
    sd = {"ds": 1, checkpoint.STATE_KEY: inline_entry(hook.state, hook.params)}
    intra = sd[checkpoint.STATE_KEY]["params"]["w"]["buffers"]["intra_node"]
    intra["values"] = intra["values"][:, :7]
    before = inline_entry(hook.state, hook.params)
    with pytest.raises(LocoCheckpointError, match=r"shape \(4, 7\).*on_corrupt_checkpoint"):
        hook.optimizer.load_state_dict([sd])
    assert hook.optimizer.loaded == []
    assert same_state(before, inline_entry(hook.state, hook.params)) == []


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
        hook.optimizer.load_state_dict([{checkpoint.STATE_KEY: inline_entry(state, {})}])
    assert len(warned) == 1 and "error_bits 32 -> 8" in warned[0]
    assert hook.state.step == 42 and not any(bool(b.dequantize().any()) for b in hook.state.buffers())
