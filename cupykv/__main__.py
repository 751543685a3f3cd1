"""Command line: ``python -m cupykv {demo,check}``.

- ``demo``: a batched decode loop through the kernels on the default backend
  (the GPU through CuPy, or the CPU emulator), checked step by step against
  the NumPy reference, with a speculative-decoding rollback and an overflow
  caught by ``check()``. Exits non-zero if anything disagrees.
- ``check``: compiles every kernel instance with NVRTC for sm_80 and sm_90 and
  fails on a compile error or a register spill (no GPU needed).
"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupykv", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="decode through the kernels and check against the reference")
    demo.add_argument("--backend", choices=("cupy", "emulator"), default=None,
                      help="default: cupy when a GPU is usable, else the emulator")
    demo.add_argument("--steps", type=int, default=12, help="decode steps")
    demo.add_argument("--seed", type=int, default=0)
    commands.add_parser("check", help="NVRTC-compile every kernel for sm_80/sm_90; fail on spills")
    args = parser.parse_args(argv)
    if args.command == "check":
        from cupykv.nvrtc_check import main as check_main
        return check_main()
    from cupykv.demo import run_demo
    return run_demo(backend=args.backend, steps=args.steps, seed=args.seed)


if __name__ == "__main__":
    sys.exit(main())
