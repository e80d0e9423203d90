"""Command line: ``triton-reshard demo`` (and more subcommands as they land)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="triton-reshard", description=__doc__)
    sub = parser.add_subparsers(dest="cmd")
    from . import demo

    p_demo = sub.add_parser("demo", help="reshard a Llama-shaped model on a local world and check it")
    demo.add_args(p_demo)
    args = parser.parse_args(argv)
    if args.cmd is None:
        parser.print_help()
        return 2
    if args.cmd == "demo":
        return demo.run_demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
