"""``dasspec kernels build | info``: build the CPU kernels ahead of time (containers, Ray nodes, CI), or say what
this machine runs and what that promises about a float32 row's bits."""

from __future__ import annotations

import argparse
import sys

HELP = "build the CPU kernels ahead of time (build), or show the ISA and the exactness guarantee (info)"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("kernels", help=HELP, description=__doc__)
    p.add_argument("action", choices=("build", "info"), help="build: compile now (exit 1 if that fails); info: report")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from .model import decode_kernel            # lazy: torch, when the command runs (not for --help)
    if args.action == "build":
        try:
            isa = decode_kernel.build(verbose=False)
        except Exception as e:                      # a compiler's error is the user's to see, not a traceback
            print(f"dasspec: the CPU kernels could not be built: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        print(f"dasspec: CPU kernels built in {decode_kernel.build_dir() / decode_kernel.build_tag()} "
              f"(this CPU runs the {isa} path; paths here: {', '.join(decode_kernel.isas_here())})")
        return 0
    ok = decode_kernel.available()
    print(f"kernels: {'built' if ok else 'not available (' + str(decode_kernel.error()) + ')'}")
    if ok:
        print(f"isa: {decode_kernel.isa()} (paths here: {', '.join(decode_kernel.isas_here())})")
    print(f"build folder: {decode_kernel.build_dir() / decode_kernel.build_tag()}")
    print(f"guarantee: {decode_kernel.guarantee()}")
    return 0
