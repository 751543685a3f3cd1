"""The documentation: the Sphinx site builds with warnings as errors, every public name has a docstring, and
every callable of the device API says whether it is graph-safe.

The build needs the ``docs`` extra (the ``test`` extra includes it); on the
CI machine a missing Sphinx is a failure, elsewhere a visible skip.
tests/test_graph_safety.py checks that the graph-safety statements are true.
"""
import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cupykv
from cupykv import ops, reference, testing, tolerances
from cupykv.backends import base as backends_base
from cupykv.models import Llama, LlamaConfig

ROOT = Path(__file__).resolve().parent.parent
PUBLIC_MODULES = (cupykv, ops, reference, testing, tolerances)
PUBLIC_CLASSES = (cupykv.KVCache, cupykv.AttentionPlan, cupykv.KernelView, cupykv.CacheSpec, cupykv.Graph,
                  cupykv.Rope, Llama, LlamaConfig, backends_base.Backend, backends_base.DeviceInfo)


def public_names():
    for module in PUBLIC_MODULES:
        names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
        for name in names:
            value = getattr(module, name)
            if callable(value) and getattr(value, "__module__", "").startswith("cupykv"):
                yield f"{module.__name__}.{name}", value
    for cls in PUBLIC_CLASSES:
        for name, value in vars(cls).items():
            if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, (property, classmethod,
                                                                                                staticmethod))):
                yield f"{cls.__module__}.{cls.__name__}.{name}", value


def docstring(value):
    target = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
    return inspect.getdoc(target) or ""


def test_every_public_name_has_a_docstring():
    missing = sorted(name for name, value in public_names() if not docstring(value).strip())
    assert not missing, f"public names without a docstring: {missing}"


def test_the_docstring_check_sees_a_missing_docstring():
    class Bare:
        def method(self):
            return 1
    assert docstring(vars(Bare)["method"]) == ""


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    if importlib.util.find_spec("sphinx") is None or importlib.util.find_spec("myst_nb") is None:
        if os.environ.get("CI"):
            pytest.fail("the docs build needs the docs extra (sphinx, numpydoc, myst-nb): pip install -e '.[test]'")
        pytest.skip("sphinx or myst-nb is not installed: pip install -e '.[docs]'")
    result = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                             "-d", str(tmp_path / "doctrees"), str(ROOT / "docs"), str(tmp_path / "html")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"sphinx-build failed:\n{result.stderr[-5000:]}"
    for page in ("index", "api", "contract", "performance", "migrating", "emulator", "changelog",
                 "notebooks/01_tour"):
        assert (tmp_path / "html" / f"{page}.html").exists(), f"{page}.html was not built"


# -- graph safety ------------------------------------------------------------------------------------
# The device API: every callable that may be called while a step is being captured, or that a captured
# step must not call. A class stands for its constructor. Host-only modules (reference, ops_reference,
# testing, tolerances, the config) touch no device array and are left out.
GRAPH_API = (
    "cupykv.KVCache", "cupykv.KVCache.append", "cupykv.KVCache.write", "cupykv.KVCache.advance",
    "cupykv.KVCache.truncate", "cupykv.KVCache.set_lengths", "cupykv.KVCache.reset", "cupykv.KVCache.additive_mask",
    "cupykv.KVCache.check", "cupykv.KVCache.lengths_host", "cupykv.KVCache.to_device", "cupykv.KVCache.kernel_view",
    "cupykv.KVCache.owned_ranges", "cupykv.KVCache.device_info", "cupykv.KVCache.layer", "cupykv.KVCache.live",
    "cupykv.KVCache.remaining_capacity", "cupykv.KVCache.has_capacity", "cupykv.KVCache.set_scales",
    "cupykv.KVCache.scales_host", "cupykv.calibrate_scales",
    "cupykv.KernelView.layout_args", "cupykv.KernelView.scale_args",
    "cupykv.AttentionPlan", "cupykv.AttentionPlan.run", "cupykv.AttentionPlan.owned_ranges",
    "cupykv.attention",
    "cupykv.capture", "cupykv.Graph.replay",
    "cupykv.ops.linear", "cupykv.ops.embedding", "cupykv.ops.rmsnorm", "cupykv.ops.silu_mul", "cupykv.ops.add",
    "cupykv.ops.argmax",
    "cupykv.models.Llama", "cupykv.models.Llama.random", "cupykv.models.Llama.from_safetensors",
    "cupykv.models.Llama.from_gguf", "cupykv.models.Llama.first_layers", "cupykv.models.Llama.decode_step",
    "cupykv.models.Llama.feed", "cupykv.models.Llama.next_tokens", "cupykv.models.Llama.generate",
    "cupykv.models.Llama.calibrate_kv_scales",
    "cupykv.backends.base.Backend.launch", "cupykv.backends.base.Backend.zeros", "cupykv.backends.base.Backend.asarray",
    "cupykv.backends.base.Backend.to_host", "cupykv.backends.base.Backend.upload", "cupykv.backends.base.Backend.copy",
    "cupykv.backends.base.Backend.synchronize", "cupykv.backends.base.Backend.always_run",
    "cupykv.backends.base.Backend.owned_ranges",
)
# Classes whose every public method (not property) is in GRAPH_API, and the public functions of the API.
GRAPH_CLASSES = (cupykv.KVCache, cupykv.KernelView, cupykv.AttentionPlan, cupykv.Graph, Llama)

# One paragraph of the docstring, in one of three forms (the reason follows the dash):
#   Graph-safe: yes — <why a captured step may call it>
#   Graph-safe: yes, <with|unless|without ...> — <why; and what is refused otherwise>
#   Graph-safe: no — refused inside a captured step (CaptureError): <why>
GRAPH_SAFE = re.compile(r"Graph-safe: (?P<verdict>yes|no)(?:, (?P<condition>(?:with|unless|without) [^—]+?))? — "
                        r"(?P<why>.+)")


def resolve(name):
    """The object a dotted name in GRAPH_API names: attributes from the package down, a submodule where
    there is no attribute of that name (``cupykv.attention`` is the function, not its module)."""
    parts = name.split(".")
    value = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        value = getattr(value, part) if hasattr(value, part) else importlib.import_module(".".join(parts[:i + 1]))
    return value


def graph_safety(name):
    """``(verdict, condition)`` of the graph-safety paragraph of ``name``'s docstring; ValueError if it has none
    or one not in the standard form."""
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", docstring(resolve(name)))]
    stated = [p for p in paragraphs if p.startswith("Graph-safe:")]
    if len(stated) != 1:
        raise ValueError(f"{name}: expected one paragraph starting 'Graph-safe:', found {len(stated)}")
    match = GRAPH_SAFE.fullmatch(stated[0])
    if match is None:
        raise ValueError(f"{name}: not in the standard form: {stated[0]!r}")
    verdict, condition, why = match.group("verdict", "condition", "why")
    if verdict == "no" and (condition or not why.startswith("refused inside a captured step (CaptureError)")):
        raise ValueError(f"{name}: a 'no' reads 'Graph-safe: no — refused inside a captured step (CaptureError): "
                         f"...', got {stated[0]!r}")
    if condition and "refuse" not in why:
        raise ValueError(f"{name}: a conditional 'yes' says what a captured step refuses, got {stated[0]!r}")
    return verdict, condition


def test_every_device_api_callable_states_whether_it_is_graph_safe():
    problems = []
    for name in GRAPH_API:
        try:
            graph_safety(name)
        except ValueError as error:
            problems.append(str(error))
    assert not problems, "\n".join(problems)


def test_the_device_api_list_is_complete():
    listed = set(GRAPH_API)
    missing = [f"{cls.__module__}.{cls.__name__}.{name}" for cls in GRAPH_CLASSES for name, value in vars(cls).items()
               if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, classmethod))
               and not any(entry.endswith(f".{cls.__name__}.{name}") for entry in listed)]
    functions = [f"cupykv.{name}" for name in cupykv.__all__ if inspect.isfunction(getattr(cupykv, name))]
    functions += [f"cupykv.ops.{name}" for name in ops.__all__]
    missing += [name for name in functions if name not in listed and f"cupykv.ops.{name.split('.')[-1]}" not in listed]
    assert not missing, f"public callables of the device API with no graph-safety entry in GRAPH_API: {missing}"
    assert all(callable(resolve(name)) for name in GRAPH_API)


@pytest.mark.parametrize("text, problem", [
    ("Graph-safe: maybe — sometimes.", "standard form"),
    ("Graph-safe: no — it allocates.", "refused inside a captured step"),
    ("Graph-safe: yes, with ``out=`` — one launch.", "says what a captured step refuses"),
])
def test_the_graph_safety_check_sees_a_bad_statement(monkeypatch, text, problem):
    def bare():
        pass
    bare.__doc__ = f"Summary.\n\n{text}\n"
    monkeypatch.setattr(sys.modules[__name__], "resolve", lambda name: bare)
    with pytest.raises(ValueError, match=problem):
        graph_safety("bare")
