"""Integer constant expressions of CUDA C++ source, evaluated in Python.

Used wherever Python reads a number out of a ``.cu`` file instead of
repeating it: the tiling constants the launch code uses
(:meth:`cupykv.kernels.KernelFile.constants`) and the emulator's
``__launch_bounds__`` values.
"""
from __future__ import annotations

import ast
import operator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.LShift: operator.lshift,
        ast.RShift: operator.rshift, ast.BitOr: operator.or_, ast.BitAnd: operator.and_}


def eval_int(expr: str) -> int:
    """Value of C integer arithmetic on literals (``/`` is integer division); ValueError otherwise."""
    def value(node):
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            operand = value(node.operand)
            return -operand if isinstance(node.op, ast.USub) else operand
        raise ValueError(expr)
    return value(ast.parse(expr.replace("/", "//"), mode="eval"))
