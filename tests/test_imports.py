"""Module dependencies run one way: the argument layer imports rope, never the reverse."""
import ast
from pathlib import Path

import cupykv
from cupykv import _args, rope

PACKAGE = Path(cupykv.__file__).parent


def _imports(path, top_level_only=False):
    """(line, module) of every import in ``path``; relative imports are spelled with their dots."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = []
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            found.append((node.lineno, "." * node.level + (node.module or "")))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return found


def _cupykv_imports(path):
    return [(line, name) for line, name in _imports(path) if name.startswith(".") or name.split(".")[0] == "cupykv"]


# Modules that import nothing from cupykv, so that any module may import them without a circle.
LEAVES = ("cupykv.errors",)


def test_the_leaves_import_nothing_from_cupykv():
    for leaf in LEAVES:
        path = PACKAGE / (leaf.split(".", 1)[1].replace(".", "/") + ".py")
        assert not _cupykv_imports(path), f"{leaf} imports {_cupykv_imports(path)}"


def test_rope_imports_nothing_from_cupykv_but_leaves():
    inside = [(line, name) for line, name in _cupykv_imports(PACKAGE / "rope.py") if name not in LEAVES]
    assert not inside, f"rope.py imports {inside}: cupykv._args imports rope, so rope must not import back"


def test_argument_layer_imports_rope_at_module_level():
    """The check that a rope is a Rope used a function-level import of cupykv.rope: the circle, hidden."""
    for path in sorted((PACKAGE / "_args").glob("*.py")):
        rope_imports = [found for found in _imports(path) if found[1] in ("cupykv.rope", "..rope")]
        top = _imports(path, top_level_only=True)
        assert all(found in top for found in rope_imports), f"{path.name}: imports rope inside a function"


def test_one_theta_check():
    assert _args.check_rope_theta is rope.check_rope_theta
    assert rope.Rope(theta=500).theta == 500.0
