"""The documentation: the Sphinx site builds with warnings as errors, and every public name has a docstring.

The build needs the ``docs`` extra (the ``test`` extra includes it); on the
CI machine a missing Sphinx is a failure, elsewhere a visible skip.
"""
import importlib.util
import inspect
import os
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
