"""The one argument layer: every public entry point checks its arguments here before any launch.

A refused call raises before anything is launched, allocated or uploaded, so
the cache is unchanged, bit for bit. Messages read
``<name>: expected <what>, got <value>`` and start with the name of the
argument at fault: ``TypeError`` for a wrong type, device or dtype,
``ValueError`` for a wrong value, shape, layout, aliasing or launch size,
``MemoryError`` for a cache larger than the backend can hold.

What is checked, module by module:

- :mod:`~cupykv._args.scalars`: ints inside the range of the kernel type that
  receives them (Python ints, NumPy scalars of any width and signedness, list
  elements: nothing wraps before the check); floats as the kernel's type holds
  them (``scale``, ``softcap`` and ``eps`` normal float32 > 0; rope ``theta``
  finite and >= 1); choices and bools.
- :mod:`~cupykv._args.cache_args`: shapes and values of the cache operations
  and of attention (shared with the reference, so both refuse alike).
- :mod:`~cupykv._args.arrays`: operands are the backend's arrays, of the
  kernel's dtype, C-contiguous (strided and reversed views are refused;
  contiguous views pass without a copy), and writeable where written; a
  launch's ``run_if`` gate is a device int32 ``[1]`` apart from what the
  launch writes and from every cache's and plan's buffers.
- :mod:`~cupykv._args.overlap`: an array a kernel writes shares no byte with
  what the launch reads, or with the buffers of any live cache (exact
  in-place is allowed only where an op documents it).
- :mod:`~cupykv._args.limits`: the bounds of the kernels' ``int`` arithmetic
  and CUDA's launch limits, checked with the shape that sets the launch.
- :mod:`~cupykv._args.positions`: ``write``'s positions and the
  ``positions_out`` of ``append`` and ``write``.

The reference (:mod:`cupykv.reference`, :mod:`cupykv.ops_reference`) uses
``scalars`` and ``cache_args`` only; the rest is the fast path's.
"""
from cupykv._args.arrays import (ALWAYS_RUN, FLOAT_DTYPES, backend_for, check_contiguous, check_shape,
                                 check_writeable, describe, device_operand, float_operand, float_output,
                                 int32_operand, run_if_operand, run_if_word, to_backend_array)
from cupykv._args.cache_args import (check_advance, check_layer, check_new_lengths, check_q, check_q_len,
                                     check_kv_scale, check_rope, check_rope_theta, check_rows, check_same_shape, check_scale,
                                     check_slots, check_softcap, check_window,
                                     check_capacity_request, check_lengths_shape, check_lengths_values,
                                     check_pending, check_positions, check_positions_shape, check_seq,
                                     check_set_lengths, check_view_layout)
from cupykv._args.limits import INT32_MAX, MAX_DYNAMIC_SHARED_MEMORY, MAX_NEW, MAX_SEQ, check_launch, check_memory
from cupykv._args.positions import positions_operand, positions_output
from cupykv._args.overlap import byte_range, check_apart_from_caches, check_no_overlap, register_buffers
from cupykv._args.scalars import check_bool, check_choice, check_int, check_int32, check_positive_float32, got, is_int
from cupykv.errors import shown

__all__ = [
    "ALWAYS_RUN", "FLOAT_DTYPES", "backend_for", "check_contiguous", "check_shape", "check_writeable", "describe",
    "device_operand", "float_operand", "float_output", "int32_operand", "run_if_operand", "run_if_word",
    "to_backend_array",
    "check_advance", "check_layer", "check_new_lengths", "check_q", "check_q_len", "check_rope", "check_rope_theta",
    "check_kv_scale", "check_rows", "check_same_shape", "check_scale", "check_slots", "check_softcap", "check_window",
    "check_capacity_request", "check_lengths_shape", "check_lengths_values", "check_pending", "check_positions",
    "check_positions_shape", "check_seq", "check_set_lengths", "check_view_layout",
    "INT32_MAX", "MAX_DYNAMIC_SHARED_MEMORY", "MAX_NEW", "MAX_SEQ", "check_launch", "check_memory",
    "positions_operand", "positions_output",
    "byte_range", "check_apart_from_caches", "check_no_overlap", "register_buffers",
    "check_bool", "check_choice", "check_int", "check_int32", "check_positive_float32", "got",
    "is_int", "shown",
]
