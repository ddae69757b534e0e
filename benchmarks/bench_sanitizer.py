"""Cost of the checked mode: demo tokens/s with and without ``--poison`` (the sanitizer).

    PYTHONPATH=. python benchmarks/bench_sanitizer.py [--repeats N] [--json OUT] [demo options...]

Both runners are built from the same ``python -m kvjax demo`` options (defaults unless
given), compiled once, and serve the same workload ``--repeats`` times, alternating, so
both see the same machine load; the figure is the median of ``ServeReport.tokens_per_s``
(serving only: no compile, no reference check). Every run must match the reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time

import jax

from kvjax.cli.demo import serve
from kvjax.cli.main import build_parser, runner_config
from kvjax.cli.workload import generate_workload, validate_workload
from kvjax.models import TinyHybridConfig
from kvjax.runner import Runner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    ours, rest = ap.parse_known_args()
    args = build_parser().parse_args(["demo", *rest])
    model = TinyHybridConfig()
    data = generate_workload(args.requests, args.seed, max_model_len=args.max_model_len,
                             vocab_size=model.vocab_size)
    runners = {}
    for poison in (False, True):
        cfg = dataclasses.replace(runner_config(args, model), poison=poison)
        runners[poison] = (cfg, Runner(cfg))
        runners[poison][1].precompile(workers=args.compile_workers)
    rates = {False: [], True: []}
    for _ in range(ours.repeats):
        for poison, (cfg, runner) in runners.items():
            reqs = validate_workload(data, vocab_size=model.vocab_size, max_model_len=cfg.max_model_len)
            report, _ = serve(cfg, reqs, runner=runner, progress_stream=None)
            if not (report.all_match and report.serving_compiles == 0):
                raise SystemExit(f"poison={poison}: run did not match the reference")
            rates[poison].append(report.tokens_per_s)
    plain, checked = statistics.median(rates[False]), statistics.median(rates[True])
    res = {
        "date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "device": str(jax.devices()[0]),
        "python": platform.python_version(), "demo_args": rest, "repeats": ours.repeats,
        "tokens_per_s": {"plain": plain, "poison": checked},
        "all_runs": {"plain": rates[False], "poison": rates[True]},
        "checked_over_plain": checked / plain,
    }
    print(json.dumps(res, indent=1))
    if ours.json:
        with open(ours.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
