"""The package's layers: plan -> run -> backend -> kernels, each calling only downwards.

Static checks on the source: no module above ``cupykv/backends/`` branches on
which backend it holds (it calls Backend methods instead), and the backends
never import the layers above them.
"""
import ast
import re
from pathlib import Path

import pytest

import cupykv
from cupykv.backends import BACKENDS

PACKAGE = Path(cupykv.__file__).parent
NAMES = "|".join(BACKENDS)
# `x == "cupy"`, `"emulator" != x`, `x in ("cupy", ...)`, `.name == ...`: a branch on a backend's identity
BRANCH = re.compile(rf"""(==|!=)\s*["']({NAMES})["']|["']({NAMES})["']\s*(==|!=|\bin\b)|\.name\s*(==|!=|\bin\b)"""
                    rf"""|\bin\s*[\(\[\{{][^)\]}}]*["']({NAMES})["']""")
ABOVE_BACKENDS = ("cupykv.graph", "cupykv.cache", "cupykv.attention", "cupykv.attention_plan", "cupykv.ops",
                  "cupykv.models", "cupykv.bench", "cupykv.reference", "cupykv.testing", "cupykv.validate")


def code_lines(source: str):
    """``(line number, text)`` of the lines that hold code, docstrings and comments blanked."""
    tree = ast.parse(source)
    blank = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            blank.update(range(body[0].lineno, body[0].end_lineno + 1))
    for number, line in enumerate(source.splitlines(), 1):
        if number not in blank:
            yield number, line.split("#")[0]


def backend_branches(source: str):
    return [(number, line.strip()) for number, line in code_lines(source) if BRANCH.search(line)]


def test_the_checker_finds_a_planted_branch_on_a_backend_name():
    planted = 'def f(backend):\n    """backend == "cupy" in a docstring is fine."""\n    if backend.name == "cupy":\n' \
              '        return 1\n    return 2 if kind != "emulator" else 3  # "cupy" == x in a comment is fine\n' \
              '    if name not in (None, "emulator"):\n        pass\n    choices = ("cupy", "emulator")\n'
    assert [number for number, _ in backend_branches(planted)] == [3, 5, 6]


def modules_above_backends():
    return sorted(path for path in PACKAGE.rglob("*.py") if "backends" not in path.relative_to(PACKAGE).parts)


@pytest.mark.parametrize("path", modules_above_backends(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_above_the_backends_branches_on_a_backend_name(path):
    found = backend_branches(path.read_text(encoding="utf-8"))
    assert not found, f"{path.relative_to(PACKAGE)} branches on a backend's name (call a Backend method): {found}"


def imported_modules(source: str):
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


@pytest.mark.parametrize("path", sorted((PACKAGE / "backends").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_backends_import_no_layer_above_them(path):
    upward = sorted({name for name in imported_modules(path.read_text(encoding="utf-8"))
                     if name.startswith(ABOVE_BACKENDS) or name in ("cupykv.attention",)})
    assert not upward, f"{path.relative_to(PACKAGE)} imports {upward}, a layer above the backends"
