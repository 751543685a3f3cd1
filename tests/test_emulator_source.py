"""The emulator's source-text work (cupykv/backends/emulator/source.py), on strings written here:
what its rewrites and parsers must see as code, and what they must leave alone."""
from cupykv.backends.emulator import source

# Comments of both kinds (an empty one, one opening with "/*/", one over two lines, two with code right
# after them), a string with an escaped quote, a char literal holding a double quote, a digit separator
# and an empty string.
CODE = ('a /* x */b /**/c // c\n'
        'd /*/ e */ f "g\\"h" \'"\' 1\'000 \'x\' "" /*\n'
        'multi\n'
        '*/ z')


def test_blank_clears_comments_and_literal_insides_and_keeps_every_offset():
    assert source.blank(CODE) == ('a        b     c     \n'
                                  'd          f "    " \' \' 1\'000 \' \' ""   \n'
                                  '     \n'
                                  '   z')


def test_blank_can_keep_the_literals():
    assert source.blank(CODE, keep_strings=True) == ('a        b     c     \n'
                                                     'd          f "g\\"h" \'"\' 1\'000 \'x\' ""   \n'
                                                     '     \n'
                                                     '   z')


def test_blank_ends_an_unclosed_comment_or_literal_at_the_end_of_the_text_or_line():
    assert source.blank("k /* open") == "k        "
    assert source.blank('s = "open\nnext "x"') == 's = "    \nnext " "'
    assert source.blank('t = "open') == 't = "    '
    assert source.blank('u = "a\\') == 'u = "  '   # an escape that the text ends in


BOXED = "thread_local struct {{ unsigned char cuemu_guard_lo[16]; {decl} value{dims}; unsigned char " \
        "cuemu_guard_hi[16]; }} cuemu_shared_{name}{{}}; auto& {name} = *::cuemu::static_shared(&cuemu_shared_{name});"


def test_a_functions_shared_variable_is_boxed_wherever_the_function_is():
    """A function's ``__shared__`` variable is boxed between guard bytes, in a kernel of an ``extern "C"``
    block or a namespace as well; one at namespace scope is plain thread-local storage. A declaration
    inside a ``#define`` and an ``extern __shared__`` one (here sized, so the dynamic rewrite leaves it,
    with ``extern`` on the line before) stay as written."""
    src = ('extern "C" __global__ void k() { __shared__ float a[4]; }\n'
           'namespace ns { __shared__ int b; __device__ void f() { __shared__ int c[2]; } }\n'
           'int x;\n#define SMEM __shared__ float d[4];\n'
           '__global__ void g() { extern\n            __shared__ float e[8]; SMEM }\n')
    assert source.rewrite_static_shared(src).splitlines() == [
        'extern "C" __global__ void k() { ' + BOXED.format(decl="float", dims="[4]", name="a") + " }",
        "namespace ns { thread_local int b{}; __device__ void f() { "
        + BOXED.format(decl="int", dims="[2]", name="c") + " } }",
        "int x;", "#define SMEM __shared__ float d[4];",
        "__global__ void g() { extern", "            __shared__ float e[8]; SMEM }"]


def test_a_variable_aligned_past_the_guard_is_not_boxed_however_its_alignment_is_spaced():
    out = source.rewrite_static_shared("__global__ void k() { __shared__ __align__( 128 ) float t[4]; }")
    assert out == ("__global__ void k() { thread_local __align__( 128 ) float cuemu_unboxed_t[4]{}; "
                   "auto& t = *::cuemu::opaque(&cuemu_unboxed_t); }")


def test_a_directive_on_the_first_line_stays_as_written():
    src = "#define SMEM __shared__ float d[4];\n__global__ void g() { SMEM }\n"
    assert source.rewrite_static_shared(src) == src


def test_launch_bounds_resolve_over_literals_and_the_sources_constants():
    src = ("constexpr int kThreads{128};\n#define CYCLE_A CYCLE_B\n#define CYCLE_B CYCLE_A\n"
           "__global__ void __launch_bounds__(256u) a() {}\n"
           "__global__ void __launch_bounds__ (kThreads) b() {}\n"
           "__global__ void __launch_bounds__(CYCLE_A) c() {}\n"
           "__global__ void __launch_bounds__(0x40, 2) d(int* x);  \n")   # a declaration ends the text
    assert source.parse_launch_bounds(src) == {"a": ("256u", 256), "b": ("kThreads", 128), "c": ("CYCLE_A", None),
                                               "d": ("0x40", 64)}
    assert source.rewrite_launch_bounds(src).splitlines()[3:] == [
        "__global__ void __launch_bounds__(256u) a() { CUEMU_LAUNCH_BOUNDS(256u);}",
        "__global__ void __launch_bounds__ (kThreads) b() { CUEMU_LAUNCH_BOUNDS(kThreads);}",
        "__global__ void __launch_bounds__(CYCLE_A) c() { CUEMU_LAUNCH_BOUNDS(CYCLE_A);}",
        "__global__ void __launch_bounds__(0x40, 2) d(int* x);  "]


def test_a_bound_named_through_a_namespace_resolves():
    src = "namespace a { constexpr int kThreads = 64; }\n__global__ void __launch_bounds__(a::kThreads) k() {}\n"
    assert source.parse_launch_bounds(src) == {"k": ("a::kThreads", 64)}


def test_restrict_parameters_are_read_with_a_space_before_the_list():
    assert source.parse_restrict_params("__global__ void k (int* __restrict__ p, int q) {}") == {"k": (True, False)}


def test_a_name_expression_gives_the_kernels_base_name():
    assert source.base_name("&ns::k<float, 4>") == "k"
    assert source.base_name(" cupykv_attention_mma<__half, __half, 64, 1> ") == "cupykv_attention_mma"
