"""Source locations for race reports: call sites and static ``__shared__`` variables.

Modules are built with DWARF 4 line tables (``build.LINE_TABLE_FLAGS``). A call site arrives as
the return address of an instrumentation hook minus the module's base; binutils' ``addr2line``
turns the byte before it into ``file:line``, innermost inlined frame first. A static shared memory offset is looked up
among the module's thread-local symbols (``readelf``), since every static ``__shared__``
variable is ``thread_local``. Both run only when a race is reported, cached per module file.
Without binutils the report shows ``module+0xOFFSET`` instead. The module's ``.text`` range,
which every launch passes to the runtime, is read from its ELF section headers directly.
"""

import functools
import os
import re
import shutil
import struct
import subprocess

from . import build, source

_DISCRIMINATOR = re.compile(r"\s*\(discriminator \d+\)\s*$")
_EMULATOR_HEADERS = str(build.INCLUDE_DIR)


@functools.lru_cache(maxsize=64)
def _site_cache(path):
    return {}


def describe_sites(path, sites):
    """``{site: 'file.cu:LINE'}`` for hook return offsets ``sites`` in the module ``path``.

    A line inside a header (``common.cuh:40``) is followed by the line of the kernel's own
    source it is inlined into: ``common.cuh:40 (inlined into rmsnorm.cu:52)``.
    """
    cache = _site_cache(path)
    missing = sorted({s for s in sites if s not in cache})
    if missing:
        cache.update(_addr2line(path, missing))
    return {s: cache.get(s, f"{os.path.basename(path)}+0x{s:x}") for s in sites}


@functools.lru_cache(maxsize=64)
def text_section(path):
    """``(start, end)`` of the ``.text`` section of the module at ``path`` (an x86-64 ELF shared
    object), as offsets from its load base: the kernels' code, without the PLT's call stubs before
    it. ``(0, 0)`` when the file has no such section. Read from the ELF section headers."""
    with open(path, "rb") as f:
        data = f.read()
    section_offset, = struct.unpack_from("<Q", data, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", data, 0x3A)

    def header(i):   # (name offset, address, size)
        name, _, _, address, _, size = struct.unpack_from("<IIQQQQ", data, section_offset + i * entry_size)
        return name, address, size
    _, _, _, _, names_at = struct.unpack_from("<IIQQQ", data, section_offset + names_index * entry_size)
    for i in range(count):
        name, address, size = header(i)
        end = data.index(b"\0", names_at + name)
        if data[names_at + name:end] == b".text":
            return address, address + size
    return 0, 0


def _frame(text):
    text = _DISCRIMINATOR.sub("", text.strip())
    file, _, line = text.rpartition(":")
    if not file or file.startswith("??") or not line.isdigit():
        return None
    if os.path.dirname(os.path.normpath(file)) == _EMULATOR_HEADERS or os.path.basename(file).startswith("<"):
        return None  # cuemu.h and the registry's launch wrappers: not the kernel author's code
    return f"{os.path.basename(file)}:{line}"


def _addr2line(path, sites):
    tool = shutil.which("addr2line")
    if tool is None:
        return {}
    # The return address follows the call instruction: its last byte belongs to the call.
    proc = subprocess.run([tool, "-e", path, "-i", "-a", *[hex(s - 1) for s in sites]],
                          capture_output=True, text=True)
    found, frames, current = {}, [], None

    def flush():
        names = [f for f in frames if f]
        if current is not None and names:
            text = names[0]
            if len(names) > 1 and names[-1].split(":")[0] != names[0].split(":")[0]:
                text += f" (inlined into {names[-1]})"
            found[current + 1] = text

    for line in proc.stdout.splitlines():
        if line.startswith("0x"):
            flush()
            current, frames = int(line, 16), []
        else:
            frames.append(_frame(line))
    flush()
    return found


@functools.lru_cache(maxsize=64)
def _tls_symbols(path):
    """[(offset, size, demangled name)] of the module's thread-local symbols."""
    tool = shutil.which("readelf")
    if tool is None:
        return ()
    proc = subprocess.run([tool, "-sW", "-C", path], capture_output=True, text=True)
    symbols = set()
    for line in proc.stdout.splitlines():
        fields = line.split(None, 7)
        if len(fields) == 8 and fields[3] == "TLS" and fields[7] != "cuemu_tls_probe_byte":
            symbols.add((int(fields[1], 16), int(fields[2], 0), fields[7]))
    return tuple(sorted(symbols))


def _without_arguments(function):
    """``'k<float>(float*, int)'`` -> ``'k<float>'``."""
    if not function.endswith(")"):
        return function
    depth = 0
    for i in range(len(function) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(function[i], 0)
        if depth == 0:
            return function[:i]
    return function


def static_shared_variable(path, offset):
    """``(description, byte offset in the variable)`` of the static ``__shared__`` variable
    at ``offset`` of the module's static shared memory, or None. A function's variable is boxed
    (source.rewrite_static_shared): the offset counts from its value, so an offset in the guard
    bytes is negative, or the variable's size or more."""
    for start, size, name in _tls_symbols(path):
        if start <= offset < start + max(size, 1):
            function, sep, variable = name.rpartition("::")
            boxed = variable.startswith(source.STATIC_SHARED_PREFIX)
            variable = variable.removeprefix(source.STATIC_SHARED_PREFIX).removeprefix(source.UNBOXED_PREFIX)
            where = f"{variable} (in {_without_arguments(function)})" if sep else variable
            return where, offset - start - (source.STATIC_SHARED_GUARD if boxed else 0)
    return None
