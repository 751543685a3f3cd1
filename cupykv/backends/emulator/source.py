"""Source-text work for the emulator: shared memory rewrites (dynamic and static), launch
bounds, and the registry translation unit appended to every module.

Every rewrite keeps the line count, so compiler errors and runtime reports point at
the real line of the .cu file.
"""

import re

from cupykv.kernels.cexpr import eval_int

_IDENT = re.compile(r"[A-Za-z_]\w*")


def _fill(out, a, b):
    for k in range(a, b):
        if out[k] != "\n":
            out[k] = " "


def blank(text, keep_strings=False):
    """``text`` with comments (and the insides of string/char literals unless
    ``keep_strings``) replaced by spaces; newlines and length are kept, so offsets
    into the result are offsets into ``text``."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            _fill(out, i, j)
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            _fill(out, i, j)
            i = j
        elif c == '"' or (c == "'" and not (i and text[i - 1].isalnum())):
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j, n)
            if not keep_strings:
                _fill(out, i + 1, j)
            i = j + 1
        else:
            i += 1
    return "".join(out)


# ---- extern __shared__ ---------------------------------------------------------------
_EXTERN_SHARED = re.compile(
    r"\bextern\s+__shared__\s+(?P<decl>[^;\[\]{}()]*(?:\([^()]*\)[^;\[\]{}()]*)*?)"
    r"\s*\b(?P<name>[A-Za-z_]\w*)\s*\[\s*\]\s*;")
_ALIGN = re.compile(r"__align__\s*\([^()]*\)|alignas\s*\([^()]*\)|__attribute__\s*\(\(.*?\)\)")
_NAMESPACE_OPEN = re.compile(r"(?:\bnamespace\b[\w\s:]*|\bextern\s*(?:\"C\"|\s))\s*$")


def _in_directive(blanked, pos):
    """True when ``pos`` lies on a preprocessor line (``#define ...``)."""
    line_start = blanked.rfind("\n", 0, pos) + 1
    return blanked[line_start:pos].lstrip().startswith("#")


def _in_function(blanked, pos):
    """True when ``pos`` lies inside braces other than namespace / extern "C" ones."""
    stack = []
    last = 0
    for m in re.finditer(r"[{};]", blanked[:pos]):
        ch = m.group()
        if ch == "{":
            head = blanked[last:m.start()]
            stack.append(bool(_NAMESPACE_OPEN.search(head)))
        elif ch == "}" and stack:
            stack.pop()
        last = m.end()
    return not all(stack)


def rewrite_dynamic_shared(text):
    """Turns ``extern __shared__ [align] T name[];`` into a pointer to the launch's
    dynamic shared memory, on the same line(s)."""
    blanked = blank(text)
    pieces, last = [], 0
    for m in _EXTERN_SHARED.finditer(blanked):
        decl_text = text[m.start("decl"):m.end("decl")]
        decl = _ALIGN.sub(" ", decl_text)
        type_ = " ".join(decl.split())
        name = m.group("name")
        if not type_:
            continue
        # The alignment asked for, compiled on an undefined char of that alignment as NVRTC compiles it (a
        # value that is not a power of two fails the build) and held to what the emulator gives: the
        # launch's dynamic shared memory starts 16-byte aligned (it ends at a guard page). The char is
        # an extern declaration, which may repeat where the array's declaration does.
        alignments = " ".join(a for a in _ALIGN.findall(decl_text) if "align" in a)
        check = (f"{alignments} extern char cuemu_alignment_of_{name}; "
                 f"static_assert(__alignof__(cuemu_alignment_of_{name}) <= 16, \"the emulator's dynamic shared "
                 f"memory starts 16-byte aligned: extern __shared__ alignment above 16 is not emulated\"); "
                 if alignments else "")
        if _in_function(blanked, m.start()):
            repl = (f"{check}{type_}* const {name} = "
                    f"reinterpret_cast<{type_}*>(::cuemu::dynamic_shared());")
        else:
            repl = (f"{check}{type_}* const& {name} = "
                    f"reinterpret_cast<{type_}* const&>(::cuemu_ctx.dyn_smem);")
        repl += "\n" * text.count("\n", m.start(), m.end())
        pieces += [text[last:m.start()], repl]
        last = m.end()
    pieces.append(text[last:])
    return "".join(pieces)


# ---- static __shared__ ---------------------------------------------------------------
# `__shared__ [align] T name[dims];` inside a function (one declarator, no initializer).
_STATIC_SHARED = re.compile(
    r"(?<![\w])(?:static\s+)?__shared__\s+(?P<decl>[^;\[\]{}()=,]*(?:\([^()]*\)[^;\[\]{}()=,]*)*?)"
    r"\s*\b(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\[\];{}]*\]\s*)*);")
STATIC_SHARED_PREFIX = "cuemu_shared_"
STATIC_SHARED_GUARD = 16  # guard bytes on each side of a function's variable (CUEMU_STATIC_SHARED_GUARD)
UNBOXED_PREFIX = "cuemu_unboxed_"  # a function's variable aligned to more than the guard: not boxed
_ALIGNMENT = re.compile(r"\b(?:__align__|alignas)\s*\(\s*(\d+)\s*\)")


def rewrite_static_shared(text):
    """Turns ``__shared__ [align] T name[dims];`` into value-initialised thread-local storage,
    on the same line(s); inside a function, boxed between guard bytes and reached through a
    reference that ``cuemu::static_shared`` returns.

    Static ``__shared__`` variables are ``thread_local``. A function's variable is the member
    ``value`` of a box, after ``STATIC_SHARED_GUARD`` guard bytes and before at least as many;
    at the declaration the runtime learns where the value lies, poisons it once per block
    and fails any access to the guards (access.cpp). The ``cuemu_shared_`` prefix of the box lets
    reports name the variable (sites.py). A variable declared with an alignment above the guard
    (``__align__(128)``) is not boxed (``cuemu_unboxed_`` prefix): neither poisoned nor bounds-checked.
    The ``{}`` value-initialises the
    storage, which for the trivial constructors CUDA allows in shared memory is
    zero-initialisation at load time: without it g++ guards the default-initialisation of a
    class type (``__half``) with a thread-local flag that every fiber reads and the first one
    sets, which the instrumentation sees as a race. Declarations with several declarators or a
    comma in the type stay plain ``thread_local`` (``cuemu.h``).
    """
    blanked = blank(text)
    pieces, last = [], 0
    for m in _STATIC_SHARED.finditer(blanked):
        before = blanked[max(blanked.rfind(c, 0, m.start()) for c in ";{}") + 1:m.start()]   # this statement's
        if (re.search(r"\bextern\s*$", before) or not m.group("decl").strip()
                or _in_directive(blanked, m.start())):
            continue
        decl = " ".join(text[m.start("decl"):m.end("decl")].split())
        dims = " ".join(text[m.start("dims"):m.end("dims")].split())
        name = m.group("name")
        over_aligned = any(int(a) > STATIC_SHARED_GUARD for a in _ALIGNMENT.findall(decl))
        if _in_function(blanked, m.start()) and over_aligned:
            storage = UNBOXED_PREFIX + name   # a box would move the value off its alignment
            repl = f"thread_local {decl} {storage}{dims}{{}}; auto& {name} = *::cuemu::opaque(&{storage});"
        elif _in_function(blanked, m.start()):
            storage = STATIC_SHARED_PREFIX + name
            repl = (f"thread_local struct {{ unsigned char cuemu_guard_lo[{STATIC_SHARED_GUARD}]; "
                    f"{decl} value{dims}; unsigned char cuemu_guard_hi[{STATIC_SHARED_GUARD}]; }} "
                    f"{storage}{{}}; auto& {name} = *::cuemu::static_shared(&{storage});")
        else:
            static = "static " if blanked.startswith("static", m.start()) else ""
            repl = f"{static}thread_local {decl} {name}{dims}{{}};"
        repl += "\n" * text.count("\n", m.start(), m.end())
        pieces += [text[last:m.start()], repl]
        last = m.end()
    pieces.append(text[last:])
    return "".join(pieces)


def rewrite_shared(text):
    """Both rewrites: dynamic shared memory, then static ``__shared__`` variables."""
    return rewrite_static_shared(rewrite_dynamic_shared(text))


# ---- __launch_bounds__ ---------------------------------------------------------------
_LB = re.compile(r"\b__launch_bounds__\s*\(")
_DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)[ \t]+([^\n]+?)[ \t]*$", re.M)
_CONST = re.compile(
    r"\b(?:static\s+)?(?:constexpr|const)\s+(?:static\s+)?(?:unsigned\s+|signed\s+)?"
    r"(?:int|long|long\s+long|short|size_t|int32_t|uint32_t|int64_t|uint64_t|unsigned)?\s*"
    r"([A-Za-z_]\w*)\s*(?:=\s*([^;{}]+?)|\{([^;{}]+?)\})\s*;")
_QUALIFIER = re.compile(r"\b[A-Za-z_]\w*\s*::\s*")
_INT_LIT = re.compile(r"\b(0[xX][0-9a-fA-F]+|\d+)[uUlL]*\b")
def _resolve(expr, consts, depth=0):
    """Integer value of a C expression over literals and known constants, or None."""
    if depth > 8:
        return None
    expr = _INT_LIT.sub(lambda m: str(int(m.group(1), 0)), expr)
    expr = _QUALIFIER.sub("", expr)   # tiling::kThreads -> kThreads (constants are looked up by bare name)

    def sub(m):
        name = m.group()
        if name not in consts:
            raise KeyError(name)
        v = _resolve(consts[name], consts, depth + 1)
        if v is None:
            raise KeyError(name)
        return f"({v})"
    try:
        expr = _IDENT.sub(sub, expr)
        return int(eval_int(expr.replace("&&", "and").strip()))
    except (KeyError, ValueError, SyntaxError, ZeroDivisionError, TypeError):
        return None


def _balanced(text, open_pos):
    """Index just past the parenthesis matching the one at ``open_pos``."""
    depth = 0
    for i in range(open_pos, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _split_top(args):
    parts, depth, cur = [], 0, []
    for ch in args:
        if ch in "(<[":
            depth += 1
        elif ch in ")>]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts]


def parse_launch_bounds(text):
    """{kernel base name: (expression text, int or None)} from ``__launch_bounds__``.

    The expression may be a literal or use ``#define`` / ``constexpr`` constants of the
    same source; anything else (a template parameter) is kept with value None.
    """
    blanked = blank(text)
    consts = {m.group(1): m.group(2) for m in _DEFINE.finditer(blanked)}
    for m in _CONST.finditer(blanked):
        consts.setdefault(m.group(1), m.group(2) or m.group(3))
    found = {}
    for args, end, params in _launch_bounds_uses(blanked):
        names = _IDENT.findall(blanked[end:params])
        if names:
            expr = _split_top(args)[0]
            found[names[-1]] = (expr, _resolve(expr, consts))
    return found


def _launch_bounds_uses(blanked):
    """``(arguments, end of the attribute, start of the kernel's parameter list)`` of each
    ``__launch_bounds__(arguments)`` in ``blanked`` (:func:`blank`'s text) that a parameter list follows."""
    for m in _LB.finditer(blanked):
        if _in_directive(blanked, m.start()):
            continue  # inside a macro definition: cannot tell which kernel
        end = _balanced(blanked, m.end() - 1)
        params = blanked.find("(", end)
        if params > 0:
            yield blanked[m.end():end - 1], end, params


def rewrite_launch_bounds(text):
    """``text`` with each kernel's ``__launch_bounds__(args)`` also stated as ``CUEMU_LAUNCH_BOUNDS(args);``
    at the top of its body (cuemu.h), on the line of its opening brace, so that line numbers stay.

    There the arguments are compiled in the kernel's scope (its template parameters included) and
    the first is checked against the block at every launch of every instance: a bound that depends on
    template arguments has no value :func:`parse_launch_bounds` could find.
    """
    blanked = blank(text)
    inserts = []
    for args, _, params in _launch_bounds_uses(blanked):
        args = " ".join(args.split())   # one line: comments are blanks already
        if not args:
            continue
        body = _balanced(blanked, params)
        while body < len(blanked) and blanked[body].isspace():
            body += 1
        if body < len(blanked) and blanked[body] == "{":   # a definition, not a declaration
            inserts.append((body + 1, f" CUEMU_LAUNCH_BOUNDS({args});"))
    for at, statement in reversed(inserts):
        text = text[:at] + statement + text[at:]
    return text


def rewrite_kernel_source(text):
    """Every rewrite a kernel source, or a header it includes, goes through: shared memory
    (:func:`rewrite_shared`), then launch bounds (:func:`rewrite_launch_bounds`)."""
    return rewrite_launch_bounds(rewrite_shared(text))


def needs_rewrite(text):
    """Whether :func:`rewrite_kernel_source` changes ``text``'s meaning: it declares ``__shared__``
    variables or gives a kernel ``__launch_bounds__``."""
    if "__shared__" not in text and "__launch_bounds__" not in text:
        return False
    blanked = blank(text)
    return bool(_EXTERN_SHARED.search(blanked) or _STATIC_SHARED.search(blanked)
                or any(_launch_bounds_uses(blanked)))


_GLOBAL = re.compile(r"\b__global__\b")
_CALL = re.compile(r"([A-Za-z_]\w*)\s*\(")


def parse_restrict_params(text):
    """{kernel base name: (bool per parameter: declared ``__restrict__``)} of the ``__global__``
    function definitions in ``text`` (a kernel defined twice keeps its first parameter list)."""
    blanked = blank(text)
    found = {}
    for m in _GLOBAL.finditer(blanked):
        if _in_directive(blanked, m.start()):
            continue
        pos = m.end()
        while True:
            call = _CALL.search(blanked, pos)
            if call is None:
                break
            end = _balanced(blanked, call.end() - 1)
            if call.group(1) in ("__launch_bounds__", "__attribute__", "alignas"):
                pos = end
                continue
            params = _split_top(blanked[call.end():end - 1])
            if params == [""] or params == ["void"]:
                params = []
            found.setdefault(call.group(1), tuple(bool(re.search(r"\b__restrict__\b", p)) for p in params))
            break
    return found


def base_name(name_expression):
    """``'ns::k<float, 4>'`` -> ``'k'``."""
    s = name_expression.strip().lstrip("&").strip()
    out, depth = [], 0
    for ch in s:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out).split("::")[-1].strip()


_EXTERN_C_KERNEL = re.compile(
    r"\bextern\s+\"C\"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^()]*\)\s*)?"
    r"([A-Za-z_]\w*)\s*\(")


def extern_c_kernels(text):
    """Names of ``extern "C" __global__`` kernels (registered without name expressions)."""
    return _EXTERN_C_KERNEL.findall(blank(text, keep_strings=True))


# ---- registry translation unit ----------------------------------------------------------
def _c_string(s):
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def registry_source(name_expressions):
    """C++ appended after the kernel source: one type-erased entry per name expression,
    the module's exported table, the device-assert hook and the static shared memory probe."""
    lines = ['\n#line 1 "<cupykv emulator registry>"',
             "static const cuemu_entry cuemu_registry_table[] = {"]
    for name in name_expressions:
        expr = name.strip()
        if not expr.startswith("&"):
            expr = "&" + expr
        lines.append(f"  ::cuemu::reg::entry<{expr} >({_c_string(name)}),")
    lines.append("  cuemu_entry{nullptr, nullptr, 0, nullptr, nullptr, nullptr},")
    lines += [
        "};",
        'extern "C" __attribute__((visibility("default")))',
        "const cuemu_entry* cuemu_module_entries(unsigned* count) {",
        f"  *count = {len(name_expressions)}u;",
        "  return cuemu_registry_table;",
        "}",
        'extern "C" __attribute__((visibility("default"), noreturn))',
        "void __wrap___assert_fail(const char* e, const char* f, unsigned l, const char* fn) {",
        "  cuemu_device_assert(e, f, l, fn);",
        "}",
        "// Static __shared__ variables are thread_local: touching this byte allocates the",
        "// module's thread-local block, which the runtime then finds as static shared memory.",
        "static thread_local char cuemu_tls_probe_byte;",
        'extern "C" __attribute__((visibility("default")))',
        "void* cuemu_module_tls_probe() { return &cuemu_tls_probe_byte; }",
        "",
    ]
    return "\n".join(lines)
