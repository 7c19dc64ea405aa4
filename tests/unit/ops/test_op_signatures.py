"""Each op's arguments are written once, in ``reference_impl``'s annotated signature (the schema is derived from it);
the copies that must remain agree with the registered schemas: the CUDA implementations' Python signatures
(``loco_cuda``) and the C++ binding's parameters (``loco_binding.cpp``, read as text: no GPU needed)."""
import inspect
import re
import typing
from pathlib import Path

import pytest
import torch

from deepspeed_loco.ops import library, loco_cuda, reference_impl

OPS = ("quantize_bucket", "requantize_bucket", "final_mean_bucket")
BINDING = Path(reference_impl.__file__).parents[1] / "csrc" / "quantization" / "loco_binding.cpp"
# the C++ spelling of each schema type (parameters as the binding declares them, const & stripped)
CPP_TYPES = {"Tensor": "at::Tensor", "Tensor[]": "std::vector<at::Tensor>", "Tensor?": "c10::optional<at::Tensor>",
             "int": "int64_t", "int[]": "std::vector<int64_t>", "float": "double", "bool": "bool",
             "str": "std::string", "ScalarType": "at::ScalarType"}
# the Python annotation of each schema type
PY_TYPES = {"Tensor": torch.Tensor, "Tensor[]": typing.List[torch.Tensor], "Tensor?": typing.Optional[torch.Tensor],
            "int": int, "int[]": typing.List[int], "float": float, "bool": bool, "str": str,
            "ScalarType": torch.dtype}
# where the binding's spelling differs from the schema's, on purpose: shorter scalar names, and ``error_bits`` (0, 8
# or 32: the error lists' dtype) that loco_cuda adds after ``error_scales``
CPP_NAMES = {"world": "world_size", "local": "local_size"}
CPP_ONLY = {"error_bits": "int"}


def schema_arguments(schema: torch._C.FunctionSchema):
    """``[(name, type)]`` of a schema as its text spells them, the alias annotations and defaults dropped
    (``Tensor(a!)[] error_values`` is ``("error_values", "Tensor[]")``)."""
    text = str(schema)
    params = text[text.index("(") + 1:text.rindex(") ->")]
    return [(name.split("=")[0], re.sub(r"\([\w]+!?\)", "", stype))
            for stype, name in (param.rsplit(" ", 1) for param in params.split(", "))]


def python_arguments(fn):
    """``[(name, schema type)]`` of a Python signature, by its annotations."""
    by_annotation = {repr(v): k for k, v in PY_TYPES.items()}
    return [(p.name, by_annotation.get(repr(p.annotation), repr(p.annotation)))
            for p in inspect.signature(fn).parameters.values()]


def cpp_arguments(source: str, function: str):
    """``[(name, C++ type)]`` of ``function``'s definition in ``source``, as the schema would name them."""
    match = re.search(rf"^[\w:]+ {function}\(([^)]*)\)\s*{{", source, re.M)
    if match is None:
        raise AssertionError(f"no definition of {function} in {BINDING}")
    params = []
    for param in " ".join(match.group(1).split()).split(", "):
        ctype, name = param.rsplit(" ", 1)
        params.append((CPP_NAMES.get(name, name), ctype.replace("const ", "").rstrip("&").strip()))
    return params


def schema_in_cpp(arguments):
    """The binding's expected parameters for a schema's ``arguments``."""
    out = []
    for name, stype in arguments:
        out.append((name, CPP_TYPES[stype]))
        if name == "error_scales":
            out += [(n, CPP_TYPES[t]) for n, t in CPP_ONLY.items()]
    return out


def registered(name: str) -> torch._C.FunctionSchema:
    return getattr(torch.ops.deepspeed_loco, name).default._schema


@pytest.mark.parametrize("name", OPS)
def test_schema_is_the_reference_signature(name):
    schema = registered(name)
    derived = library.schema_of(getattr(reference_impl, name))
    assert schema == torch._C.parse_schema(f"{library.NAMESPACE}::{name}{derived}")
    assert schema_arguments(schema) == python_arguments(getattr(reference_impl, name))
    assert [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write] == [
        n for n in library.MUTATED if n in inspect.signature(getattr(reference_impl, name)).parameters]


@pytest.mark.parametrize("name", OPS)
def test_no_mutated_argument_has_a_default(name):
    """The dispatcher drops trailing arguments equal to their defaults before it calls a Python kernel; torch 2.11's
    version bump of the mutated arguments indexes the arguments it got and fails with ``IndexError`` on one so
    dropped (seen on the GPU machine, ``stats=None``). Every mutated argument is therefore always passed."""
    schema = registered(name)
    assert [a.name for a in schema.arguments if a.is_write and a.has_default_value()] == []


@pytest.mark.parametrize("name", OPS)
def test_cuda_implementation_has_the_schema_signature(name):
    assert python_arguments(getattr(loco_cuda, name)) == schema_arguments(registered(name))
    assert inspect.signature(getattr(loco_cuda, name)) == inspect.signature(getattr(reference_impl, name))


@pytest.mark.parametrize("name", OPS)
def test_cpp_binding_has_the_schema_arguments(name):
    assert cpp_arguments(BINDING.read_text(), name) == schema_in_cpp(schema_arguments(registered(name)))


@pytest.mark.parametrize("name", OPS)
def test_cuda_implementation_calls_the_binding_in_its_order(name):
    """``loco_cuda`` passes the op's arguments to the binding in the C++ parameters' order (``error_bits``, 0 for
    empty error lists, inserted); each argument stands for itself here."""
    values = {n: ([] if n == "error_values" else n) for n, _ in schema_arguments(registered(name))}
    params = [n for n, _ in cpp_arguments(BINDING.read_text(), name)]
    assert loco_cuda.binding_arguments(values) == [{"error_values": [], "error_bits": 0}.get(n, n) for n in params]


def test_the_parsers_see_a_drift():
    """A renamed, retyped or reordered C++ parameter is seen (the checks above compare lists, order included)."""
    source = BINDING.read_text()
    want = schema_in_cpp(schema_arguments(registered("final_mean_bucket")))
    for old, new in [("int64_t rank", "int64_t rank_"), ("int64_t rank", "double rank"),
                     ("int64_t bits,\n                             int64_t group_size",
                      "int64_t group_size,\n                             int64_t bits")]:
        assert old in source, old
        assert cpp_arguments(source.replace(old, new, 1), "final_mean_bucket") != want
