"""Command line: ``python -m kvjax demo``."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvjax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run a seeded scheduling trace through the state functions")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--requests", type=int, default=4)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from kvjax.demo_trace import run_trace

        if args.requests <= 0:
            parser.error(f"--requests must be positive, got {args.requests}")
        summary = run_trace(seed=args.seed, num_requests=args.requests)
        return 0 if all(summary["checks"].values()) else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
