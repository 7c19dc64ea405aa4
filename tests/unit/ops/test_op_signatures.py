"""Each op's schema is written once (``library.OPS``); what must agree with it does: its reference and fake take its
arguments, and the C++ binding registers a CUDA kernel for each op whose parameters have the schema's names and
C++ types (read as text, so no GPU is needed; on a GPU the dispatcher checks the types again when the extension
loads, where a mismatch would stop the process instead of failing a test)."""
import inspect
import re
from pathlib import Path

import pytest
import torch

from deepspeed_loco.ops import library

BINDING = Path(library.__file__).parents[1] / "csrc" / "quantization" / "loco_binding.cpp"
OPS = {op.name: op for op in library.OPS}
# the C++ types a kernel takes for each schema type (const & stripped), as the dispatcher infers a schema from them
CPP_TYPES = {"Tensor": "at::Tensor", "Tensor[]": "at::TensorList", "Tensor?": "std::optional<at::Tensor>",
             "int": "int64_t", "int[]": "at::IntArrayRef", "float": "double", "bool": "bool", "str": "c10::string_view",
             "ScalarType": "at::ScalarType"}


def schema_arguments(schema: str):
    """``[(name, type)]`` of a schema's arguments as its text spells them, alias annotations dropped
    (``Tensor(a!)[] error_values`` is ``("error_values", "Tensor[]")``)."""
    params = schema[schema.index("(") + 1:schema.rindex(") ->")]
    return [(name, re.sub(r"\(\w+!?\)", "", stype)) for stype, name in (p.rsplit(" ", 1) for p in params.split(", "))]


def cpp_arguments(source: str, function: str):
    """``[(name, C++ type)]`` of ``function``'s definition in ``source``."""
    match = re.search(rf"^[\w:]+ {function}\(([^)]*)\)\s*{{", source, re.M)
    if match is None:
        raise AssertionError(f"no definition of {function} in {BINDING}")
    params = [param.rsplit(" ", 1) for param in " ".join(match.group(1).split()).split(", ")]
    return [(name, ctype.replace("const ", "").rstrip("&").strip()) for ctype, name in params]


def test_every_op_is_defined_once_with_its_reference_and_fake():
    assert list(OPS) == ["quantize_bucket", "requantize_bucket", "final_mean_bucket", "gather_sample"]
    for name, op in OPS.items():
        assert getattr(library, name) is op.reference  # the reference is the module's function of the op's name
        names = [n for n, _ in schema_arguments(op.schema)]
        assert list(inspect.signature(op.reference).parameters) == names, name
        fake = inspect.signature(op.fake).parameters
        assert list(fake) == names or [p.kind for p in fake.values()] == [inspect.Parameter.VAR_POSITIONAL], name
        assert getattr(torch.ops.deepspeed_loco, name).default is not None


@pytest.mark.parametrize("name", list(OPS))
def test_no_argument_has_a_default(name):
    """The dispatcher drops trailing arguments equal to their defaults before it calls a Python kernel; torch 2.11's
    version bump of the mutated arguments indexes the arguments it got and fails with ``IndexError`` on one so
    dropped (seen on the GPU machine, ``stats=None``). Every argument is therefore always passed."""
    assert "=" not in OPS[name].schema


@pytest.mark.parametrize("name", list(OPS))
def test_cpp_kernel_has_the_schema_arguments(name):
    want = [(n, CPP_TYPES[t]) for n, t in schema_arguments(OPS[name].schema)]
    assert cpp_arguments(BINDING.read_text(), name) == want


def test_the_binding_registers_a_cuda_kernel_for_every_op():
    block = re.search(r"TORCH_LIBRARY_IMPL\(LOCO_OPS_NAMESPACE, CUDA, m\) \{(.*?)\n\}", BINDING.read_text(), re.S)
    assert block is not None
    registered = re.findall(r'm\.impl\("(\w+)", TORCH_FN\((\w+)\)\);', block.group(1))
    assert registered == [(name, name) for name in OPS]


def test_the_parsers_see_a_drift():
    """A renamed, retyped or reordered C++ parameter is seen (the checks above compare lists, order included)."""
    source = BINDING.read_text()
    want = [(n, CPP_TYPES[t]) for n, t in schema_arguments(OPS["final_mean_bucket"].schema)]
    assert cpp_arguments(source, "final_mean_bucket") == want
    for old, new in [("int64_t rank", "int64_t rank_"), ("int64_t rank", "double rank"),
                     ("int64_t bits,\n                             int64_t group_size",
                      "int64_t group_size,\n                             int64_t bits")]:
        assert old in source, old
        assert cpp_arguments(source.replace(old, new, 1), "final_mean_bucket") != want
    assert schema_arguments("(Tensor(a!)[] x, int[] y, Tensor(b!)? z) -> ()") == [
        ("x", "Tensor[]"), ("y", "int[]"), ("z", "Tensor?")]
