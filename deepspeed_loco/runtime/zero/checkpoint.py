"""LoCo's error-feedback state in DeepSpeed checkpoints: what is saved, how it is checked, when it is reset.

Saving (format version 3): the ZeRO-3 optimizer's ``state_dict`` gains the key ``"deepspeed_loco"``, a small manifest
(:func:`manifest`: the signature, the step counter and where the buffers are), in that rank's
``zero_pp_rank_*_optim_states.pt``. When the engine's checkpoint engine saves that file, :func:`write_entry` first
streams the rank's buffers into a file of their own beside it (:func:`write_error_file`, layout below), through one
reused host buffer of at most :data:`CHUNK_BYTES`, and names the file in the manifest. With
``zeropp_loco_param.checkpoint_error_state: false`` no file is written and the manifest says so.

Loading: the checkpoint engine's ``load`` of an optimizer file gives the manifest the file's path (:func:`locate`);
the wrapped ``load_state_dict`` (``runtime/deepspeed_seam.py``, which owns every touch of DeepSpeed) takes this rank's
entry out of the list before DeepSpeed's own loader sees it and asks :func:`decide_load`, which checks the manifest
and reads the error-state file into the buffers chunk by chunk (:func:`read_error_file`, checking every record's
shape, size, CRC-32 and finiteness on the way), or checks an inline entry of versions 1 and 2 (:func:`parse_state_dict`,
kept to read checkpoints written before version 3). The ranks then agree (one all-gather of each rank's failure), so a
file that cannot be read fails on every rank before any other collective; DeepSpeed loads; :func:`apply_decision`
sets the step counter (and copies an inline entry's buffers in). The rules (``docs/checkpointing.md``):

* no LoCo entry (a checkpoint of stock DeepSpeed, or of the removed upstream LoCo, which never saved its buffers),
  a universal checkpoint, or ``load_optimizer_states=False``: buffers start from zero, with a WARNING saying why;
* saved with ``checkpoint_error_state: false``: buffers start from zero, the step counter is restored, and rank 0
  logs one WARNING naming the key;
* a different layout (``W``, ``L``, ``group_size``, ``error_bits``, ``hadamard``, ``error_feedback``,
  ``exact_own_block``): buffers start from zero, with a WARNING naming the saved and the current values; the step
  counter is restored (a signature without ``exact_own_block``, written before the key existed, reads as false);
* a corrupt, truncated or missing file or entry: :class:`LocoCheckpointError` on every rank, naming the failing
  ranks and what is wrong with their files, raised before the ZeRO-3 optimizer state is loaded (DeepSpeed has read
  the module's file by then), or, with ``zeropp_loco_param.on_corrupt_checkpoint: "reset"``, that rank's buffers from
  zero with a WARNING.

Error-state file, version 1 (all integers little-endian): :data:`ERROR_FILE_MAGIC` (8 bytes); the header's length
(8 bytes) and the header, UTF-8 JSON ``{"format", "version", "token", "records": [{"param", "numel", "ds_id", "hop",
"field", "dtype", "shape", "nbytes"}, ...]}`` (``field`` "values" or "scale"; ``token`` also in the manifest, so a
file left by another save is recognized); each record's bytes in that order, row-major; the CRC-32 of each record
(4 bytes each); :data:`ERROR_FILE_END` (8 bytes). Its size is known from the header, so a cut file is found before
any data is read.

Parameters are identified by their name in ``engine.module.named_parameters()``, not by ZeRO-3's ``ds_id``: ds_ids
come from a process-wide counter (``deepspeed.zero.Init.param_id``), so the same model built a second time in one
process (an in-process restart, a second engine) gets different ds_ids. The ds_id is saved for information only.
"""
import json
import math
import os
import struct
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import torch

from deepspeed_loco.config import INTER_NODE_ONLY, LocoConfig
from deepspeed_loco.layout import INTER_NODE, INTRA_NODE, plan_hops
from deepspeed_loco.runtime.comm.error_feedback import ErrorFeedbackState
from deepspeed_loco.runtime.zero import deepspeed_seam
from deepspeed_loco.utils.logging import describe_ranks, logger

STATE_KEY = "deepspeed_loco"
FORMAT = "deepspeed_loco.error_feedback"
# 3: a manifest here, the buffers in an error-state file beside the optimizer file; read too: 2 (buffers inline,
# keyed by hop name) and 1 (inline, fixed keys "hop1" (intra-node) and "hop2" (inter-node))
FORMAT_VERSION = 3
READ_VERSIONS = (1, 2, 3)
V1_HOP_NAMES = {"hop1": INTRA_NODE, "hop2": INTER_NODE}
# signature entries whose difference makes the saved buffers meaningless here (layout, storage or basis)
RESET_KEYS = ("world_size", "local_size", "group_size", "error_bits", "hadamard", "error_feedback",
              "exact_own_block")
# added to the signature after checkpoints were written without them: a saved signature that lacks one has this value
LATER_KEYS = {"exact_own_block": False}
BOOL_KEYS = ("hadamard", "exact_own_block")
# recorded and compared for information only: the buffers hold not-yet-sent gradient in gradient units, which
# does not depend on the wire's bit width
INFO_KEYS = ("intra_node_bits", "inter_node_bits")
SIGNATURE_KEYS = RESET_KEYS + INFO_KEYS
PREFIX = "deepspeed-loco: "  # what starts every error and warning of this module, once

# where a version-3 manifest says the buffers are ("error_state")
IN_FILE = "file"  # in the error-state file it names ("file", "token", "bytes")
LEFT_OUT = "left_out"  # not saved: zeropp_loco_param.checkpoint_error_state was false
NO_BUFFERS = "none"  # the layout keeps no buffers (error feedback off, or one rank)
UNWRITTEN = "unwritten"  # the optimizer's state_dict was taken outside the engine's checkpoint engine: no file
ERROR_STATES = (IN_FILE, LEFT_OUT, NO_BUFFERS, UNWRITTEN)
LOADED_FROM = "loaded_from"  # added to a manifest when read (:func:`locate`), never saved: the optimizer file's path

ERROR_FILE_FORMAT = "deepspeed_loco.error_state_file"
ERROR_FILE_VERSION = 1
ERROR_FILE_MAGIC = b"DSLOCOEF"
ERROR_FILE_END = b"DSLOCOEN"
ERROR_FILE_SUFFIX = ".loco_errors"
CHUNK_BYTES = 64 * 2**20  # host memory a save or load stages at most at a time, per rank
RECORD_KEYS = ("param", "numel", "ds_id", "hop", "field", "dtype", "shape", "nbytes")
_FIXED = len(ERROR_FILE_MAGIC) + 8 + len(ERROR_FILE_END)  # bytes of a file besides its header, data and CRCs


class LocoCheckpointError(RuntimeError):
    """The LoCo state in a checkpoint is corrupt, truncated or does not fit this model; the message says what."""


class LocoCheckpointMismatch(Exception):
    """The checkpoint was saved with another layout (``W``, ``L``, group size, ...): its buffers cannot be used."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


# ----------------------------------------------------------------------------------------------------- saving
def signature(state) -> Dict[str, Any]:
    """What the buffers' layout and meaning depend on, for an :class:`ErrorFeedbackState`."""
    cfg, plan = state.config, state.plan
    return {
        "world_size": int(plan.world_size),
        "local_size": int(plan.local_size),
        "group_size": int(plan.group_size),
        "error_bits": int(state.error_bits),
        "hadamard": bool(plan.hadamard),
        "error_feedback": state.error_feedback,
        "exact_own_block": bool(plan.exact_own_block),
        "intra_node_bits": int(cfg.intra_node_bits),
        "inter_node_bits": int(cfg.inter_node_bits),
    }


def manifest(state) -> Dict[str, Any]:
    """LoCo's entry in the optimizer's ``state_dict``: ``{"format", "version", "signature", "step", "error_state"}``,
    plain types only. ``error_state`` is :data:`LEFT_OUT` (``checkpoint_error_state`` false), :data:`NO_BUFFERS`, or
    :data:`UNWRITTEN` until :func:`write_entry` writes the buffers' file and makes it :data:`IN_FILE`."""
    if not state.rows():
        status = NO_BUFFERS
    else:
        status = UNWRITTEN if state.config.checkpoint_error_state else LEFT_OUT
    return {"format": FORMAT, "version": FORMAT_VERSION, "signature": signature(state), "step": int(state.step),
            "error_state": status}


def write_entry(state, named_params: Mapping[str, torch.Tensor], entry: Any, path: str) -> Any:
    """Called as the optimizer file ``path`` is saved with LoCo's ``entry``: writes the error-state file beside it
    when the manifest awaits one (:func:`write_error_file`) and returns the manifest naming it; any other entry is
    returned as it is."""
    if not isinstance(entry, Mapping) or entry.get("error_state") != UNWRITTEN:
        return entry
    name, token = error_file_name(path), uuid.uuid4().hex
    size = write_error_file(state, named_params, os.path.join(os.path.dirname(path), name), token)
    return {**entry, "error_state": IN_FILE, "file": name, "token": token, "bytes": size}


def locate(entry: Any, path: str) -> Any:
    """Called as the optimizer file ``path`` is loaded: a version-3 manifest learns the file's path (its error-state
    file lies beside it); anything else is returned as it is."""
    if isinstance(entry, dict) and entry.get("version") == FORMAT_VERSION:
        return {**entry, LOADED_FROM: path}
    return entry


def error_file_name(optimizer_file: str) -> str:
    """The name of the error-state file saved beside the optimizer file ``optimizer_file``."""
    return os.path.splitext(os.path.basename(optimizer_file))[0] + ERROR_FILE_SUFFIX


class HostStaging:
    """The one host buffer every byte of the error state passes through on its way to or from a file: at most
    ``limit`` bytes (and no more than ``needed``, the largest record), allocated once per file and reused."""

    def __init__(self, limit: int, needed: int):
        if limit < 8:
            raise ValueError(f"deepspeed-loco: the host staging of LoCo checkpoints needs >= 8 bytes, got {limit}")
        self.buffer = torch.empty(max(8, min(limit, needed)) // 8 * 8, dtype=torch.uint8)

    def pieces(self, flat: torch.Tensor) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """``(piece, host)`` for consecutive pieces of the 1-D tensor ``flat``: ``host`` a view of the buffer with the
        piece's dtype and size (its contents are those of the previous piece until copied)."""
        step = self.buffer.numel() // flat.element_size()
        for start in range(0, flat.numel(), step):
            piece = flat[start:start + step]
            yield piece, self.buffer[:piece.numel() * piece.element_size()].view(piece.dtype)


def _record(name: str, numel: int, ds_id, hop: str, field_: str, dtype: torch.dtype, shape) -> Dict[str, Any]:
    nbytes = math.prod(shape) * dtype.itemsize
    return {"param": name, "numel": int(numel), "ds_id": ds_id, "hop": hop, "field": field_, "dtype": str(dtype),
            "shape": [int(s) for s in shape], "nbytes": int(nbytes)}


def _saved_tensors(state, named_params: Mapping[str, torch.Tensor]) -> List[Tuple[Dict[str, Any], torch.Tensor]]:
    """``(record, tensor)`` for every tensor of every buffer, in first-use, hop and field order."""
    out = []
    for name in state.names():
        if name not in named_params:
            raise RuntimeError(f"{PREFIX}parameter {name!r} has error-feedback buffers but is not a parameter of the "
                               f"model being checkpointed")
        param = named_params[name]
        numel, ds_id = deepspeed_seam.param_numel(param), deepspeed_seam.param_id(param)
        for hop, buffer in state.buffers_of(name).items():
            for field_, tensor in (("values", buffer.values), ("scale", buffer.scale)):
                if tensor is not None:
                    out.append((_record(name, numel, ds_id, hop, field_, tensor.dtype, tensor.shape), tensor))
    return out


def _expected_records(state, name: str, numel: int, ds_id) -> List[Dict[str, Any]]:
    """The records a parameter of ``numel`` elements has in a file of ``state``'s layout."""
    cols, storage, out = state.plan.widths([numel])[0], state.storage, []
    for hop, rows in state.rows().items():
        out.append(_record(name, numel, ds_id, hop, "values", storage.values_dtype, storage.values_shape(rows, cols)))
        if storage.scaled:
            out.append(_record(name, numel, ds_id, hop, "scale", torch.float32, (rows, cols // state.plan.group_size)))
    return out


def write_error_file(state, named_params: Mapping[str, torch.Tensor], path: str, token: str,
                     chunk_bytes: int = CHUNK_BYTES) -> int:
    """Writes ``state``'s buffers to ``path`` (the layout of the module's docstring), piece by piece through one
    :class:`HostStaging` of at most ``chunk_bytes``; the file appears under its name only when complete. Returns
    its size in bytes."""
    saved = _saved_tensors(state, named_params)
    header = json.dumps({"format": ERROR_FILE_FORMAT, "version": ERROR_FILE_VERSION, "token": token,
                         "records": [record for record, _ in saved]}).encode()
    staging = HostStaging(chunk_bytes, max((record["nbytes"] for record, _ in saved), default=8))
    partial = path + ".partial"
    try:
        with open(partial, "wb") as out:
            out.write(ERROR_FILE_MAGIC + len(header).to_bytes(8, "little") + header)
            crcs = [_write_tensor(out, tensor, staging) for _, tensor in saved]
            out.write(struct.pack(f"<{len(crcs)}I", *crcs) + ERROR_FILE_END)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return os.path.getsize(path)


def _write_tensor(out, tensor: torch.Tensor, staging: HostStaging) -> int:
    crc = 0
    for piece, host in staging.pieces(tensor.detach().view(-1)):  # a buffer is contiguous: no copy
        host.copy_(piece)
        data = host.view(torch.uint8).numpy()
        out.write(data)
        crc = zlib.crc32(data, crc)
    return crc


def saved_bytes(config: LocoConfig, world_size: int, local_size: int, numel: int) -> int:
    """Bytes of error state one rank's checkpoint holds for a parameter of ``numel`` elements (its buffers, as
    ``ErrorFeedbackState.planned_bytes``; 0 with ``checkpoint_error_state`` false), headers aside."""
    state = ErrorFeedbackState(config, plan_hops(world_size, local_size, config))
    return state.planned_bytes(numel) if config.checkpoint_error_state else 0


# ---------------------------------------------------------------------------------------------------- loading
def read_error_file(state, named_params: Mapping[str, torch.Tensor], path: str, token: str,
                    chunk_bytes: int = CHUNK_BYTES) -> int:
    """Reads the error-state file ``path`` (written with ``token``) into ``state``: every buffer zeroed, then each
    saved one filled piece by piece through one :class:`HostStaging` of at most ``chunk_bytes`` (buffers a parameter
    does not have yet are allocated on its partition's device). Returns the number of parameters restored.

    Checks the header against the model and the layout, the file's size (a cut file fails before any data is read),
    then each record's CRC-32 and finiteness as it is read. Raises :class:`LocoCheckpointError` naming ``path`` and
    what is wrong; the buffers are then zero again."""
    state.reset()
    try:
        with open(path, "rb") as source:
            return _read_error_file(state, named_params, path, token, source, chunk_bytes)
    except LocoCheckpointError:
        state.reset()
        raise
    except FileNotFoundError:
        state.reset()
        _corrupt(f"{path}: the error-state file is missing")
    except Exception as exc:  # whatever else a damaged file trips over is reported as corruption, not a crash
        state.reset()
        _corrupt(f"{path}: the error-state file could not be read ({type(exc).__name__}: {exc})")


def _read_error_file(state, named_params, path: str, token: str, source, chunk_bytes: int) -> int:
    size = os.fstat(source.fileno()).st_size
    head = source.read(len(ERROR_FILE_MAGIC) + 8)
    if len(head) < len(ERROR_FILE_MAGIC) + 8 or head[:len(ERROR_FILE_MAGIC)] != ERROR_FILE_MAGIC:
        _corrupt(f"{path}: not a deepspeed-loco error-state file ({size} bytes; cut short or overwritten?)")
    header_bytes = int.from_bytes(head[len(ERROR_FILE_MAGIC):], "little")
    if header_bytes > size - _FIXED:
        _corrupt(f"{path}: {size} bytes, shorter than its header of {header_bytes} bytes (the file was cut short)")
    header = json.loads(source.read(header_bytes).decode())
    records = _check_header(state, named_params, path, token, header)
    data_start = len(ERROR_FILE_MAGIC) + 8 + header_bytes
    data_bytes = sum(record["nbytes"] for record in records)
    expected = data_start + data_bytes + 4 * len(records) + len(ERROR_FILE_END)
    if size != expected:
        _corrupt(f"{path}: {size} bytes, its header says {expected} ({'cut short' if size < expected else 'too long'})")
    source.seek(data_start + data_bytes)
    trailer = source.read(4 * len(records) + len(ERROR_FILE_END))
    if trailer[4 * len(records):] != ERROR_FILE_END:
        _corrupt(f"{path}: the end marker is missing (the file was not completely written)")
    crcs = struct.unpack(f"<{len(records)}I", trailer[:4 * len(records)])
    source.seek(data_start)
    staging = HostStaging(chunk_bytes, max((record["nbytes"] for record in records), default=8))
    restored = set()
    for record, crc in zip(records, crcs):
        name = record["param"]
        buffer = state.buffers_for(name, record["numel"], deepspeed_seam.partition_device(named_params[name]))
        target = getattr(buffer[record["hop"]], record["field"])
        at = f"{path}: parameter {name!r}, {record['hop']}, {record['field']}"
        if _read_tensor(source, target, staging, at) != crc:
            _corrupt(f"{at}: CRC-32 mismatch (the file is damaged)")
        restored.add(name)
    return len(restored)


def _check_header(state, named_params, path: str, token: str, header: Any) -> List[Dict[str, Any]]:
    """The header's records, checked: the file format, the manifest's ``token``, and record for record what
    ``state``'s layout keeps for each parameter it names (which the model must have, with that many elements)."""
    if not isinstance(header, Mapping) or any(k not in header for k in ("format", "version", "token", "records")):
        _corrupt(f"{path}: the header is {_brief(header)}, expected format, version, token and records")
    if header["format"] != ERROR_FILE_FORMAT or header["version"] != ERROR_FILE_VERSION:
        _corrupt(f"{path}: format {header['format']!r} version {header['version']!r}, this release reads "
                 f"{ERROR_FILE_FORMAT!r} version {ERROR_FILE_VERSION}")
    if header["token"] != token:
        _corrupt(f"{path} was written by another save than the optimizer file beside it (token {header['token']!r}, "
                 f"expected {token!r})")
    records = header["records"]
    if not isinstance(records, list) or not all(isinstance(r, Mapping) and set(r) == set(RECORD_KEYS) for r in records):
        _corrupt(f"{path}: the header's records are not a list of {RECORD_KEYS}")
    expected, seen = [], set()
    for record in records:
        name = record["param"]
        if name in seen:
            continue
        if not isinstance(name, str) or name not in named_params:
            _corrupt(f"{path}: buffers for parameter {name!r}, which this model does not have")
        numel = deepspeed_seam.param_numel(named_params[name])
        if record["numel"] != numel:
            _corrupt(f"{path}: parameter {name!r} saved for {record['numel']!r} elements, the model's has {numel}")
        seen.add(name)
        expected += _expected_records(state, name, numel, record["ds_id"])
    for i, (got, want) in enumerate(zip(records + [None] * len(expected), expected + [None] * len(records))):
        if got != want:
            _corrupt(f"{path}: record {i} is {_record_brief(got)}, this layout expects {_record_brief(want)}")
    return records


def _record_brief(record: Optional[Mapping[str, Any]]) -> str:
    if record is None:
        return "nothing"
    return f"{record['param']!r} {record['hop']} {record['field']} {record['dtype']} {tuple(record['shape'])}"


def _read_tensor(source, target: torch.Tensor, staging: HostStaging, at: str) -> int:
    crc = 0
    for piece, host in staging.pieces(target.view(-1)):
        data = host.view(torch.uint8).numpy()
        if source.readinto(data) != data.nbytes:
            _corrupt(f"{at}: the file ends early")
        crc = zlib.crc32(data, crc)
        if host.is_floating_point() and not all(math.isfinite(v) for v in torch.aminmax(host)):
            _corrupt(f"{at}: non-finite value(s); a saved buffer is always finite")
        piece.copy_(host)
    return crc


@dataclass
class LoadPlan:
    """A checked inline entry (versions 1 and 2), ready to be applied: the step, per parameter name the saved
    ``{"numel", "buffers": {hop name: {"values", "scale"}}}`` (the shape of ``ErrorFeedbackState.state_dict``), and
    the device of each parameter's partition (where the buffers a parameter does not have yet are allocated)."""
    step: int
    params: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    devices: Dict[str, torch.device] = field(default_factory=dict)


def load_state_dict(state, sd: Any, named_params: Mapping[str, torch.Tensor]) -> None:
    """Restores an inline entry (versions 1 and 2) into ``state``: checks all of it first (``LocoCheckpointError``
    if corrupt, ``LocoCheckpointMismatch`` if saved with another layout), then sets the buffers and the step."""
    apply_plan(state, parse_state_dict(state, sd, named_params))


def parse_state_dict(state, sd: Any, named_params: Mapping[str, torch.Tensor]) -> LoadPlan:
    """Checks an inline entry (versions 1 and 2) against ``state`` (config, hop plan) and the model; touches nothing.

    Raises :class:`LocoCheckpointError` for a corrupt or truncated entry (or one of version 3, whose buffers are in
    a file: :func:`decide_load` reads those) and :class:`LocoCheckpointMismatch` for a valid entry saved with
    another layout.
    """
    return _guarded(_parse_inline, state, sd, named_params)


def _guarded(parse, *args):
    """``parse(*args)``, with whatever else than a LoCo exception a damaged entry trips over reported as
    corruption, not a crash."""
    try:
        return parse(*args)
    except (LocoCheckpointError, LocoCheckpointMismatch):
        raise
    except Exception as exc:
        raise LocoCheckpointError(f"{PREFIX}checkpoint key {STATE_KEY!r} could not be read "
                                  f"({type(exc).__name__}: {exc})") from exc


WHERE = f"checkpoint key {STATE_KEY!r}"


def _parse_head(state, sd: Any) -> Tuple[int, int]:
    """Checks the fields every version has, then the signature against ``state``'s; returns ``(version, step)``.
    :class:`LocoCheckpointMismatch` if the buffers were saved with another layout."""
    if not isinstance(sd, Mapping):
        _corrupt(f"{WHERE} is a {type(sd).__name__}, expected a dict")
    missing = [k for k in ("format", "version", "signature", "step") if k not in sd]
    if missing:
        _corrupt(f"{WHERE} lacks field(s) {missing} (truncated or not written by deepspeed-loco)")
    if sd["format"] != FORMAT:
        _corrupt(f"{WHERE}: format is {sd['format']!r}, expected {FORMAT!r}")
    version = sd["version"]
    if not _is_int(version) or version < 1:
        _corrupt(f"{WHERE}: version is {version!r}, expected a positive integer")
    if version not in READ_VERSIONS:
        _corrupt(f"{WHERE}: format version {version} was written by another deepspeed-loco release; this one reads "
                 f"versions {list(READ_VERSIONS)}")
    step = sd["step"]
    if not _is_int(step) or step < 0:
        _corrupt(f"{WHERE}: step is {step!r}, expected an integer >= 0")
    saved = sd["signature"]
    if not isinstance(saved, Mapping):
        _corrupt(f"{WHERE}: signature is a {type(saved).__name__}, expected a dict")
    saved = {**LATER_KEYS, **saved}
    for key in SIGNATURE_KEYS:
        if key not in saved:
            _corrupt(f"{WHERE}: signature lacks {key!r}")
        value = saved[key]
        if key == "error_feedback":  # true, false or "inter_node", as the config key
            kind_ok = isinstance(value, bool) or value == INTER_NODE_ONLY
        else:
            kind_ok = isinstance(value, bool) if key in BOOL_KEYS else _is_int(value)
        if not kind_ok:
            _corrupt(f"{WHERE}: signature[{key!r}] is {saved[key]!r}, of the wrong type")
    current = signature(state)
    changed = [k for k in RESET_KEYS if saved[k] != current[k]]
    if changed:
        diff = ", ".join(f"{k} {saved[k]} -> {current[k]}" for k in changed)
        raise LocoCheckpointMismatch(
            f"the checkpoint's error buffers were saved with {_describe(saved)} and this run has "
            f"{_describe(current)} ({diff}), so they do not fit", int(step))
    return version, int(step)


def _parse_inline(state, sd: Any, named_params: Mapping[str, torch.Tensor]) -> LoadPlan:
    version, step = _parse_head(state, sd)
    if version == FORMAT_VERSION:
        _corrupt(f"{WHERE}: a version-{version} manifest, whose buffers are in a file of their own: read it with "
                 f"decide_load")
    if "params" not in sd:
        _corrupt(f"{WHERE} lacks field(s) ['params'] (truncated or not written by deepspeed-loco)")
    params = sd["params"]
    if not isinstance(params, Mapping):
        _corrupt(f"{WHERE}: params is a {type(params).__name__}, expected a dict")
    plan = LoadPlan(step=step)
    rows = state.rows()
    if params and not rows:
        _corrupt(f"{WHERE} holds buffers for {len(params)} parameter(s) but its signature says there are none")
    for name, entry in params.items():
        if not isinstance(name, str) or name not in named_params:
            _corrupt(f"{WHERE}: buffers for parameter {name!r}, which this model does not have")
        param = named_params[name]
        at = f"{WHERE}, parameter {name!r}"
        buffers = _entry_buffers(at, entry, version)
        numel = deepspeed_seam.param_numel(param)
        if not _is_int(entry["numel"]) or entry["numel"] != numel:
            _corrupt(f"{at}: saved for {entry['numel']!r} elements, the model's parameter has {numel}")
        extra = sorted(set(buffers) - set(rows))
        if extra:
            _corrupt(f"{at}: buffers for hop(s) {extra}, which this layout does not have (hops: {list(rows)})")
        cols = state.plan.widths([numel])[0]
        plan.params[name] = {"numel": numel, "buffers": {
            hop: _check_buffer(f"{at}, {hop}", buffers.get(hop), count, cols, state) for hop, count in rows.items()}}
        plan.devices[name] = deepspeed_seam.partition_device(param)
    return plan


def _parse_manifest(state, sd: Any) -> Tuple[int, str]:
    """Checks a version-3 manifest (after :func:`_parse_head`); returns ``(step, error_state)``."""
    _, step = _parse_head(state, sd)
    status = sd.get("error_state")
    if status not in ERROR_STATES:
        _corrupt(f"{WHERE}: error_state is {_brief(status)}, expected one of {list(ERROR_STATES)}")
    if status == NO_BUFFERS and state.rows():
        _corrupt(f"{WHERE} says the layout keeps no buffers but its signature says it does")
    if status == IN_FILE:
        name = sd.get("file")
        if not isinstance(name, str) or not name or os.path.basename(name) != name:
            _corrupt(f"{WHERE}: file is {_brief(name)}, expected the name of a file beside the optimizer file")
        if not isinstance(sd.get("token"), str):
            _corrupt(f"{WHERE}: token is {_brief(sd.get('token'))}, expected a string")
        if not isinstance(sd.get(LOADED_FROM), str):
            _corrupt(f"{WHERE} names the error-state file {name!r} but was not read through the engine's checkpoint "
                     f"engine (engine.load_checkpoint), so the folder it lies in is unknown")
    return step, status


def _entry_buffers(at: str, entry: Any, version: int) -> Mapping[str, Any]:
    """A parameter entry's ``{hop name: saved buffer}``; version 1 named the hops ``hop1`` and ``hop2``."""
    fields_ = ("numel", "buffers") if version >= 2 else ("numel", ) + tuple(V1_HOP_NAMES)
    if not isinstance(entry, Mapping) or any(k not in entry for k in fields_):
        _corrupt(f"{at}: expected a dict with {', '.join(repr(k) for k in fields_[:-1])} and {fields_[-1]!r}, "
                 f"got {_brief(entry)}")
    if version == 1:
        return {hop: entry[old] for old, hop in V1_HOP_NAMES.items() if entry[old] is not None}
    if not isinstance(entry["buffers"], Mapping):
        _corrupt(f"{at}: buffers is {_brief(entry['buffers'])}, expected a dict keyed by hop name")
    return entry["buffers"]


def _check_buffer(at: str, saved: Any, rows: int, cols: int, state) -> Dict[str, Any]:
    if not isinstance(saved, Mapping) or "values" not in saved or "scale" not in saved:
        _corrupt(f"{at}: expected a dict with 'values' and 'scale', got {_brief(saved)}")
    values, scale = saved["values"], saved["scale"]
    storage = state.storage
    _check_tensor(f"{at}, values", values, storage.values_dtype, storage.values_shape(rows, cols))
    if storage.scaled:
        _check_tensor(f"{at}, scale", scale, torch.float32, (rows, cols // state.plan.group_size))
    elif scale is not None:
        _corrupt(f"{at}: scale must be None for error_bits {storage.bits}, got {_brief(scale)}")
    return {"values": values, "scale": scale}


def _check_tensor(at: str, value: Any, dtype: torch.dtype, shape: tuple) -> None:
    if not isinstance(value, torch.Tensor):
        _corrupt(f"{at}: expected a {dtype} tensor, got {_brief(value)}")
    if value.dtype != dtype:
        _corrupt(f"{at}: dtype {value.dtype}, expected {dtype}")
    if tuple(value.shape) != shape:
        _corrupt(f"{at}: shape {tuple(value.shape)}, expected {shape} (truncated?)")
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        bad = int((~torch.isfinite(value)).sum())
        _corrupt(f"{at}: {bad} non-finite value(s); a saved buffer is always finite")


def apply_plan(state, plan: LoadPlan) -> None:
    """Makes ``state`` exactly the checked entry: every buffer zeroed, the saved ones copied in, the step set."""
    state.load_state_dict({"step": plan.step, "params": plan.params}, plan.devices)


def _describe(sig: Mapping[str, Any]) -> str:
    return (f"W={sig['world_size']} L={sig['local_size']} group_size={sig['group_size']} "
            f"error_bits={sig['error_bits']} hadamard={sig['hadamard']} error_feedback={sig['error_feedback']} "
            f"exact_own_block={sig['exact_own_block']}")


def _brief(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, Mapping):
        return f"a dict with keys {sorted(map(str, value))}"
    return f"{type(value).__name__} {value!r}"[:120]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _corrupt(message: str):
    raise LocoCheckpointError(f"{PREFIX}{message}")


# ------------------------------------------------------------------------------------------- what a load does
@dataclass
class LoadDecision:
    """What loading a checkpoint does to the LoCo state. ``kind``: "load" (``plan``, an inline entry to apply; or,
    for a version-3 manifest, ``step`` to set, the buffers of ``restored`` parameters already read in), "reset" (zero
    the buffers, restore ``step`` unless None; ``why`` is logged by this rank, or, when ``everywhere`` is False (a
    cause every rank shares), once by rank 0; once the ranks have agreed, ``agreed`` holds every rank's reason with
    the ranks it concerns, which rank 0 logs once each) or "error" (raise; ``why`` this rank's problem, ``failed``
    the ``(rank, why)`` of every failing rank once the ranks have agreed)."""
    kind: str
    why: str = ""
    plan: Optional[LoadPlan] = None
    step: Optional[int] = None
    restored: int = 0
    everywhere: bool = True
    failed: Tuple[Tuple[int, str], ...] = ()
    agreed: Tuple[Tuple[str, Tuple[int, ...]], ...] = ()  # once the ranks agreed: every distinct reset why, its ranks


DROPPED = ("the checkpoint's error-feedback buffers are dropped: this run keeps none (zeropp_loco_param."
           "error_feedback false)")


def decide_load(state, entry: Any, named_params: Mapping[str, torch.Tensor], universal: bool,
                load_optimizer_states: bool) -> LoadDecision:
    """The rules of ``docs/checkpointing.md`` for this rank's saved ``entry`` (``MISSING`` when the file has none).
    A version-3 entry's error-state file is read into ``state`` here (zero again if it cannot be read)."""
    if universal:
        return LoadDecision("reset", "a universal checkpoint carries no LoCo error-feedback state")
    if not load_optimizer_states:
        return LoadDecision("reset", "load_optimizer_states=False: LoCo's buffers are optimizer state")
    if entry is MISSING:
        if not state.rows():
            return LoadDecision("load")
        return LoadDecision("reset", f"the checkpoint has no {STATE_KEY!r} entry (saved without deepspeed-loco, or "
                            f"by the removed upstream LoCo, which never saved its buffers)")
    try:
        if isinstance(entry, Mapping) and entry.get("version") == FORMAT_VERSION:
            return _decide_manifest(state, entry, named_params)
        return LoadDecision("load", plan=parse_state_dict(state, entry, named_params))
    except LocoCheckpointMismatch as mismatch:
        if not state.rows():  # nothing to reset: the saved buffers are simply not used
            return LoadDecision("reset", DROPPED, step=mismatch.step, everywhere=False)
        return LoadDecision("reset", str(mismatch), step=mismatch.step)
    except LocoCheckpointError as err:
        why = str(err).removeprefix(PREFIX)
        if state.config.on_corrupt_checkpoint == "reset":  # the warning says "deepspeed-loco: rank N:" itself
            return LoadDecision("reset", f"{why} (zeropp_loco_param.on_corrupt_checkpoint is 'reset')")
        return LoadDecision("error", why)


def _decide_manifest(state, entry: Mapping[str, Any], named_params: Mapping[str, torch.Tensor]) -> LoadDecision:
    step, status = _guarded(_parse_manifest, state, entry)
    if status == IN_FILE and not state.rows():
        return LoadDecision("reset", DROPPED, step=step, everywhere=False)
    if status == IN_FILE:
        path = os.path.join(os.path.dirname(entry[LOADED_FROM]), entry["file"])
        return LoadDecision("load", step=step, restored=read_error_file(state, named_params, path, entry["token"]))
    if status == NO_BUFFERS or not state.rows():
        return LoadDecision("load", step=step)
    if status == LEFT_OUT:
        return LoadDecision("reset", "the checkpoint was saved with zeropp_loco_param.checkpoint_error_state false, "
                            "which leaves them out", step=step, everywhere=False)
    return LoadDecision("reset", "the optimizer state was saved outside the engine's checkpoint engine "
                        "(engine.save_checkpoint), which writes LoCo's error-state file, so the buffers were not saved",
                        step=step)


def apply_decision(state, decision: LoadDecision, rank: int) -> None:
    """Carries out a "load" or "reset" decision on ``state`` and logs it (rank ``rank``); an "error" decision
    raises :class:`LocoCheckpointError` naming every failing rank and its problem, and leaves ``state`` as it is."""
    if decision.kind == "error":
        raise LocoCheckpointError(failure_message(decision.failed or ((rank, decision.why), )))
    if decision.agreed and rank == 0:  # the ranks agreed: rank 0 says each reason once, naming the ranks it concerns
        step = decision.step if decision.step is not None else state.step
        for why, ranks in decision.agreed:
            logger.warning(f"{PREFIX}{describe_ranks(ranks)}: " + (why if why == DROPPED else
                           f"error-feedback buffers start from zero: {why} (optimizer step {step})"))
    if decision.kind == "load":
        if decision.plan is not None:
            apply_plan(state, decision.plan)
        elif decision.step is not None:
            state.step = decision.step
        restored = len(decision.plan.params) if decision.plan is not None else decision.restored
        if restored and rank == 0:
            logger.info(f"{PREFIX}restored error-feedback state ({restored} parameters, optimizer step {state.step})")
        return
    state.reset()
    if decision.step is not None:
        state.step = decision.step
    if decision.agreed:
        return
    if decision.everywhere:
        logger.warning(f"{PREFIX}rank {rank}: error-feedback buffers start from zero: {decision.why}")
    elif rank == 0:
        logger.warning(f"{PREFIX}" + (decision.why if decision.why == DROPPED else
                       f"error-feedback buffers start from zero on every rank: {decision.why} (optimizer step "
                       f"{state.step})"))


SHOWN_FAILURES = 4  # failing ranks a failure message details; the rest are counted


def failure_message(failed) -> str:
    """The one line every rank raises when the LoCo state of some ranks' checkpoint files (``failed``: ``(rank,
    why)``) could not be loaded."""
    shown = "; ".join(f"rank {rank}: {why}" for rank, why in failed[:SHOWN_FAILURES])
    more = f"; and {len(failed) - SHOWN_FAILURES} more" if len(failed) > SHOWN_FAILURES else ""
    return (f"{PREFIX}the LoCo state of this checkpoint could not be loaded on rank(s) {[r for r, _ in failed]} "
            f"({shown}{more}); the ZeRO-3 optimizer state was not loaded, rebuild the engine before loading again, "
            f"or set zeropp_loco_param.on_corrupt_checkpoint to 'reset' to start those ranks' error buffers from zero")


MISSING = object()  # a checkpoint file without a LoCo entry

__all__ = ["LocoCheckpointError", "LocoCheckpointMismatch", "STATE_KEY", "FORMAT_VERSION", "CHUNK_BYTES", "manifest",
           "write_entry", "locate", "error_file_name", "write_error_file", "read_error_file", "saved_bytes",
           "load_state_dict", "parse_state_dict", "apply_plan", "LoadDecision", "decide_load",
           "apply_decision", "failure_message", "MISSING"]
