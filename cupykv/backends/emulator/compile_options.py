"""NVRTC compile options, as the emulator takes them (``Module(..., options=...)``).

NVRTC spells an option that takes a value as ``-name=value`` or ``--long-name=value``, and the
preprocessor's also as ``-D X`` or ``--define-macro X``; this module reads every one of those spellings.
Each option is one of:

- **honoured**: ``-D``/``--define-macro``, ``-U``/``--undefine-macro`` and ``-I``/``--include-path`` reach the
  host compiler (the folders are searched, hashed and mirrored as ``include_dirs`` are); ``-std``/``--std``
  (a dialect above C++17 reaches g++; 17, which the emulator's headers need, also compiles code written for
  11 and 14); ``-restrict``/``--restrict`` (every pointer parameter is checked as one declared
  ``__restrict__``, as the GPU compiler then assumes it is);
- **refused** with a :class:`CompileError` naming it, as changing what a kernel computes in a way the
  emulator does not model: ``-use_fast_math`` (approximate ``expf``, ``sinf``, division and square root),
  ``-ftz=false`` (fibers always flush fp32 subnormals, as CuPy's ``-ftz=true`` code does),
  ``-prec-div=false``, ``-prec-sqrt=false``, and a pre-included header (``-include``/``--pre-include``);
- **without effect on what a kernel computes** (the target, ptxas's and the optimizer's settings, debug
  and line information, diagnostics): taken and ignored; ``-fmad`` too, true or false, since g++ never
  contracts ``a*b+c`` here (the emulator's README lists that difference);
- **unknown**: ignored with an :class:`EmulatorOptionWarning` naming it (NVRTC would refuse an option it
  does not know; one newer than this list may be harmless).
"""

import dataclasses
import warnings

from .errors import CompileError, EmulatorOptionWarning

#: long name -> short name of the options honoured or refused below, which take a value
HONOURED = {"--define-macro": "-D", "--undefine-macro": "-U", "--include-path": "-I", "--std": "-std"}
#: the dialects NVRTC accepts; the emulator compiles with C++17 at least
DIALECTS = ("c++03", "c++11", "c++14", "c++17", "c++20")
#: boolean options the emulator models only at one value (NVRTC's default, or CuPy's for -ftz)
MODELLED_ONLY_AT = {"ftz": "true", "prec-div": "true", "prec-sqrt": "true"}
#: why each refused option is refused
REFUSED = {
    "use_fast_math": "it replaces expf, sinf, division and square root by approximations the emulator "
                     "does not reproduce",
    "ftz": "fibers always flush fp32 subnormals to zero, as the -ftz=true code CuPy compiles does",
    "prec-div": "the emulator divides in IEEE round-to-nearest, as -prec-div=true does",
    "prec-sqrt": "the emulator takes square roots in IEEE round-to-nearest, as -prec-sqrt=true does",
    "pre-include": "the emulator compiles only the source and the headers it includes",
    "include": "the emulator compiles only the source and the headers it includes",
}
#: NVRTC's documented options that do not change what a kernel computes (names without dashes; a value,
#: when one is given, is not read)
WITHOUT_EFFECT = frozenset("""
    arch gpu-architecture rdc relocatable-device-code ewp extensible-whole-program G device-debug
    lineinfo generate-line-info dopt Ofast-compile Xptxas ptxas-options maxrregcount
    extra-device-vectorization modify-stack-limit dlto dlink-time-opt gen-opt-lto optix-ir
    jump-table-density no-cache frandom-seed split-compile fdevice-time-trace fdevice-syntax-only
    no-source-include builtin-move-forward builtin-initializer-list w disable-warnings
    default-device device-as-default-execution-space device-int128 device-float128 opt-info
    optimization-info err-no display-error-number no-err-no no-display-error-number diag-error
    diag-suppress diag-warn brief-diag brief-diagnostics time minimal device-stack-protector
    pch create-pch use-pch pch-dir pch-verbose pch-messages instantiate-templates-in-pch Werror
    Wreorder
""".split())


@dataclasses.dataclass(frozen=True)
class HostOptions:
    """What the emulator takes from an NVRTC option list.

    Attributes:
        flags: host compiler flags, in the options' order: ``-D``/``-U`` and a ``-std`` above C++17.
        include_folders: the folders of the ``-I`` options, as written.
        all_restrict: ``-restrict`` was given: every pointer parameter is ``__restrict__``.
    """
    flags: tuple = ()
    include_folders: tuple = ()
    all_restrict: bool = False


def _refuse(option, why):
    return CompileError(f"emulator: NVRTC option {option!r}: {why}")


def _boolean(option, name, value):
    """``value`` (None when the option has none) when it is true or false; a CompileError otherwise."""
    if value not in ("true", "false"):
        got = "no value" if value is None else repr(value)
        raise _refuse(option, f"expected -{name}=true or -{name}=false, got {got}")
    return value


def parse(options):
    """The :class:`HostOptions` of ``options`` (a sequence of NVRTC option strings).

    Raises:
        CompileError: an option the emulator refuses (see the module's docstring), a ``-std`` that names
            no dialect, a boolean option that is neither true nor false, or a -D/-U/-I/-std without its
            value.
    """
    flags, folders, all_restrict, it = [], [], False, iter(options)
    for option in it:
        if not isinstance(option, str):
            raise _refuse(option, f"expected a str, got {type(option).__name__}")
        name, has_value, value = option.partition("=")
        short = HONOURED.get(name, name)
        if short in ("-D", "-U", "-I", "-std") and not has_value:
            value = next(it, "")
            if not value:
                raise _refuse(option, "expected a value after it")
        elif name[:2] in ("-D", "-U", "-I") and not name.startswith("--"):
            short, value = name[:2], option[2:]
        if short in ("-D", "-U"):
            flags.append(short + value)
        elif short == "-I":
            folders.append(value)
        elif short == "-std":
            if value not in DIALECTS:
                raise _refuse(option, f"expected one of {', '.join(DIALECTS)}, got {value!r}")
            if DIALECTS.index(value) > DIALECTS.index("c++17"):
                flags.append(f"-std={value}")
        else:
            bare = name.lstrip("-")
            if bare == "restrict" and not has_value:
                all_restrict = True
            elif bare in MODELLED_ONLY_AT or bare == "fmad":   # booleans; -fmad either way
                value = _boolean(option, bare, value if has_value else None)
                if bare in MODELLED_ONLY_AT and value != MODELLED_ONLY_AT[bare]:
                    raise _refuse(option, REFUSED[bare])
            elif bare in REFUSED:
                raise _refuse(option, REFUSED[bare])
            elif bare not in WITHOUT_EFFECT:
                warnings.warn(f"emulator: NVRTC option {option!r} is not one the emulator knows; it was "
                              f"ignored", EmulatorOptionWarning, stacklevel=3)
    return HostOptions(tuple(flags), tuple(folders), all_restrict)
