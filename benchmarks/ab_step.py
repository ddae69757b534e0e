"""A/B of the model step between source trees, in alternating processes.

The same code's batch-1 step moves by ~10% from one process to the next while its kernels'
busy time does not (BENCHMARKS.md, H200 note 51), so one process per tree cannot tell a change
of a few percent from that spread. This runs ``bench_model.py`` from each tree in turn for
``--rounds`` rounds (A B A B ...), one process each, and reports every row's device time per
process and the median per tree.

Prepare the trees where git is (a device's copy of the working tree has no ``.git``); keep them
out of git (``ab/`` in ``.git/info/exclude``) and carry them to the device:

    python benchmarks/ab_step.py prepare ab/old 94dda2c

Then, on the GPU machine, from the repository root (``.`` is the working tree):

    PYTHONPATH=. python benchmarks/ab_step.py run --tree old=ab/old --tree new=. --out DIR \\
        --rounds 2 -- --preset deepseek-v2-lite --decode 1024:1 --prefill '' \\
        --max-model-len 32768 --no-peers --budget-s 70

Everything after ``--`` goes to ``bench_model.py --gpu-run DIR/<tree>-<round>``. Writes
``DIR/ab.json``: per tree and row (preset, impl, phase, batch, context) the device times in run
order and their median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

#: What a tree needs to run the benchmarks: the library and the benchmark scripts.
TREE_PATHS = ("kvjax", "pallas_kernels", "benchmarks")


def prepare(dest: str, rev: str) -> None:
    """``dest`` <- the library and benchmarks of git revision ``rev`` (results left out)."""
    if os.path.exists(dest) and os.listdir(dest):
        raise SystemExit(f"{dest} exists and is not empty: remove it or name another folder")
    os.makedirs(dest, exist_ok=True)
    archive = subprocess.run(["git", "archive", rev, *TREE_PATHS], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", dest, "--exclude=benchmarks/results"], input=archive, check=True)


def _rows(path: str) -> dict:
    doc = json.load(open(path))
    return {(r["preset"], r["impl"], r["phase"], r["batch"], r["context"]): r.get("device_us")
            for r in doc["rows"]}


def run(trees: list[tuple[str, str]], out: str, rounds: int, args: list[str], *, script: str,
        timeout_s: float) -> dict:
    """``script`` from each tree in turn, ``rounds`` times; returns (and writes) the summary."""
    os.makedirs(out, exist_ok=True)
    times: dict = {name: {} for name, _ in trees}
    runs = []
    for r in range(rounds):
        for name, tree in trees:
            dest = os.path.abspath(os.path.join(out, f"{name}-{r + 1}"))
            tree = os.path.abspath(tree)
            env = dict(os.environ, PYTHONPATH=tree)
            with open(dest + ".log", "w") as log:
                rc = subprocess.run([sys.executable, os.path.join(tree, script), "--gpu-run", dest, *args],
                                    cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    timeout=timeout_s).returncode
            runs.append(dict(tree=name, round=r + 1, rc=rc, dir=dest))
            model = os.path.join(dest, "model.json")
            if rc == 0 and os.path.exists(model):
                for key, us in _rows(model).items():
                    times[name].setdefault(key, []).append(us)
    summary = {name: [dict(zip(("preset", "impl", "phase", "batch", "context"), key), device_us=v,
                           median_us=statistics.median([x for x in v if x is not None] or [float("nan")]))
                      for key, v in sorted(rows.items(), key=lambda kv: str(kv[0]))]
               for name, rows in times.items()}
    doc = dict(trees=dict(trees), rounds=rounds, args=args, runs=runs, summary=summary)
    with open(os.path.join(out, "ab.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    for name, rows in summary.items():
        for row in rows:
            shown = ", ".join("-" if x is None else f"{x:,.0f}" for x in row["device_us"])
            print(f"{name:10s} {row['preset']} {row['phase']} b={row['batch']} ctx={row['context']}: "
                  f"{shown} us (median {row['median_us']:,.0f})", flush=True)
    return doc


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="a tree of a git revision (run where git is)")
    p.add_argument("dest")
    p.add_argument("rev")
    r = sub.add_parser("run", help="the benchmark from each tree in turn")
    r.add_argument("--tree", action="append", required=True, metavar="NAME=DIR")
    r.add_argument("--out", required=True)
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--script", default="benchmarks/bench_model.py", help="relative to each tree")
    r.add_argument("--timeout-s", type=float, default=300.0, help="per process")
    a = ap.parse_args(argv)
    if a.cmd == "prepare":
        prepare(a.dest, a.rev)
        return 0
    trees = []
    for t in a.tree:
        name, sep, path = t.partition("=")
        if not sep or not name or not os.path.isdir(path):
            ap.error(f"--tree must be NAME=DIR with an existing DIR, got {t!r}")
        trees.append((name, path))
    if len({n for n, _ in trees}) != len(trees):
        ap.error(f"--tree names must differ, got {[n for n, _ in trees]}")
    if a.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {a.rounds}")
    doc = run(trees, a.out, a.rounds, passthrough, script=a.script, timeout_s=a.timeout_s)
    return 0 if all(x["rc"] == 0 for x in doc["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
