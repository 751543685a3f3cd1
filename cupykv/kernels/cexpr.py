"""Integer constant expressions of CUDA C++ source, evaluated in Python.

Used wherever Python reads a number out of a ``.cu`` file instead of
repeating it: the tiling constants the launch code uses
(:meth:`cupykv.kernels.KernelFile.constants`) and the emulator's
``__launch_bounds__`` values.
"""
from __future__ import annotations

import ast
import operator


def _c_quotient(a: int, b: int) -> int:
    """``a / b`` as C divides integers: truncated toward zero (Python's ``//`` floors)."""
    quotient = abs(a) // abs(b)   # ZeroDivisionError for b == 0
    return quotient if (a < 0) == (b < 0) else -quotient


def _c_remainder(a: int, b: int) -> int:
    """``a % b`` as C computes it: the sign of ``a``, so that ``(a / b) * b + a % b == a``."""
    return a - b * _c_quotient(a, b)


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: _c_quotient, ast.Mod: _c_remainder, ast.LShift: operator.lshift,
        ast.RShift: operator.rshift, ast.BitOr: operator.or_, ast.BitAnd: operator.and_}


def eval_int(expr: str) -> int:
    """Value of C integer arithmetic on literals; ValueError otherwise.

    ``/`` and ``%`` are C's: the quotient truncates toward zero and the remainder takes the
    dividend's sign (``-7 / 2 == -3``, ``-7 % 2 == -1``); a division by zero raises
    ZeroDivisionError. Values are Python ints (no overflow).
    """
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
