"""Types: mypy passes over cupykv with the configuration in setup.cfg, and the wheel ships ``py.typed``.

setup.cfg's ``[mypy]`` sections hold the flags: every flag of ``--strict`` on the
public modules, a lenient baseline elsewhere. mypy comes with the ``test`` and
``docs`` extras; on the CI machine (``CI`` set) a missing mypy is a failure,
elsewhere a visible skip.
"""
import configparser
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MYPY_SECONDS = 120   # a cold run takes well under a minute; this bounds a stuck one


def setup_cfg():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return config


def test_mypy_passes_on_the_package(tmp_path):
    if importlib.util.find_spec("mypy") is None:
        if os.environ.get("CI"):
            pytest.fail("the type check needs mypy (the test extra has it): pip install -e '.[test]'")
        pytest.skip("mypy is not installed: pip install -e '.[test]' (or pip install mypy)")
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "setup.cfg"),
                             "--cache-dir", str(tmp_path / "mypy_cache"), "cupykv"],
                            cwd=ROOT, capture_output=True, text=True, timeout=MYPY_SECONDS)
    seconds = time.monotonic() - started
    assert result.returncode == 0, \
        f"mypy found problems ({seconds:.0f} s):\n{result.stdout[-8000:]}{result.stderr[-2000:]}"
    assert "Success" in result.stdout, result.stdout


def test_strict_modules_are_the_public_api():
    config = setup_cfg()
    strict = [section for section in config.sections()
              if section.startswith("mypy-") and config[section].getboolean("disallow_untyped_defs", False)]
    assert len(strict) == 1, strict
    modules = set(strict[0][len("mypy-"):].split(","))
    public = {"cupykv", "cupykv.cache", "cupykv.cache_views", "cupykv.attention", "cupykv.attention_plan",
              "cupykv.graph", "cupykv.spec", "cupykv.rope", "cupykv.errors", "cupykv.ops", "cupykv.reference",
              "cupykv.ops_reference", "cupykv.tolerances", "cupykv.testing", "cupykv.models", "cupykv.models.config",
              "cupykv.models.llama", "cupykv.backends", "cupykv.backends.base"}
    assert public <= modules, f"public modules not checked strictly: {sorted(public - modules)}"
    flags = config[strict[0]]
    for flag in ("disallow_untyped_defs", "disallow_incomplete_defs", "disallow_untyped_calls",
                 "disallow_untyped_decorators", "disallow_any_generics", "disallow_subclassing_any",
                 "check_untyped_defs", "warn_return_any", "no_implicit_reexport", "extra_checks"):
        assert flags.getboolean(flag, False), f"[{strict[0]}] lacks {flag} = True"


def test_py_typed_is_package_data_and_present():
    package_data = setup_cfg()["options.package_data"]
    assert "py.typed" in [entry.strip() for entry in package_data.get("cupykv", "").split(",")], \
        "setup.cfg [options.package_data] must list py.typed for cupykv, so that the wheel ships it"
    marker = ROOT / "cupykv" / "py.typed"
    assert marker.is_file(), f"{marker} is missing"
    assert "partial" not in marker.read_text(), "py.typed marks a complete package (PEP 561), not a partial one"


def test_mypy_is_in_the_test_and_docs_extras():
    extras = setup_cfg()["options.extras_require"]
    for extra in ("test", "docs"):
        requirements = [line.split("#")[0].strip() for line in extras[extra].splitlines()]
        assert any(r.startswith("mypy") for r in requirements), f"the {extra} extra lacks mypy"
