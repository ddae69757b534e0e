"""The step's Triton GEMM tilings pinned one by one, each timed in the step itself (issue 24,
batch 1), on a GPU.

    PYTHONPATH=. python benchmarks/probe_gemm_pins.py --out DIR [--preset granite-4.0-h-micro]

XLA's GEMM autotuner picks each product's tiling from near-equal candidates (its log: the
fastest four of ~30 within a few percent), so the pick moves from one compile to the next.
This probe measures what pinning buys, in fresh processes of ``probe_launch.py``:

1. the Runner's step compiled as usual, with the autotuner's results and logs dumped
   (``xla_gpu_dump_autotune_results_to`` / ``_logs_to``): the default row;
2. for each candidate tiling, the dumped results with every Triton product set to it (where its
   shared memory fits) and loaded back (``xla_gpu_load_autotune_results_from``): each product's
   kernel time in the step, its weights read from memory as in serving;
3. the results with each product at its fastest tiling of 1-2, against the default, twice.

Products are named by the instruction text in the autotuner's log. Rows: ``gemm_pins.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

# (block_m, block_k, num_warps, num_stages); block_n stays the autotuner's (the rows: 8)
CANDIDATES = [(64, 256, 4, 4), (128, 128, 4, 4), (32, 256, 4, 4), (64, 128, 4, 5), (128, 64, 8, 4),
              (32, 512, 4, 3), (256, 64, 8, 3)]


def launch(out, preset, tag, extra, limit=100) -> dict:
    """One fresh ``probe_launch.py`` process with the Runner's options and ``extra``: its steady
    step, kernel busy time and per-kernel time of its largest kernels."""
    env = dict(os.environ, KVJAX_XLA_EXTRA=json.dumps(extra))
    cmd = ["timeout", str(limit), sys.executable, "benchmarks/probe_launch.py", "--preset", preset, "--batch", "1",
           "--variants", "extra", "--out", os.path.join(out, tag)]
    with open(os.path.join(out, f"{tag}.log"), "w") as f:
        subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, check=False)
    try:
        row = json.load(open(os.path.join(out, tag, "probe_launch.json")))["rows"][0]
    except (OSError, KeyError, IndexError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"[:200]}
    return {"steady_us": row["steady_step_us"], "busy_us": row["kernels"].get("busy_us"),
            "kernel_us": {k["name"]: k["us_per_call"] / k["count_per_call"] for k in row["kernels"].get("top", [])}}


def split_results(text: str):
    """``(head, entries)`` of an AutotuneResults textproto."""
    parts = text.split("entries {")
    return parts[0], parts[1:]


def with_tilings(head: str, entries: list, assign: dict) -> str:
    """The results with entry ``i``'s Triton tiling fields set to ``assign[i]`` (a dict)."""
    out = [head]
    for i, e in enumerate(entries):
        if i in assign:
            def sub(m, c=assign[i]):
                b = m.group(0)
                for k, v in c.items():
                    b = re.sub(rf"{k}: \d+", f"{k}: {v}", b)
                return b
            e = re.sub(r"triton \{[^}]*\}", sub, e)
        out.append(e)
    return "entries {".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="granite-4.0-h-micro")
    a = ap.parse_args(argv)
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    res_path, log_path = os.path.join(out, "results.textproto"), os.path.join(out, "logs.textproto")
    doc = {"preset": a.preset, "candidates": CANDIDATES}
    doc["default"] = launch(out, a.preset, "default", {"xla_gpu_dump_autotune_results_to": res_path,
                                                       "xla_gpu_dump_autotune_logs_to": log_path})
    head, entries = split_results(open(res_path).read())
    names = {}
    for prof in open(log_path).read().split("instruction_profiles {")[1:]:
        fp, txt = re.search(r'hlo_fingerprint: "(\w+)"', prof), re.search(r'hlo_text: "(.*)"', prof)
        if fp and txt:
            names[fp.group(1)] = txt.group(1)
    products = []  # (entry, kernel name, weight operands)
    for i, e in enumerate(entries):
        fp = re.search(r'hlo_fingerprint: "(\w+)"', e).group(1)
        if "backend: TRITON" in e and fp in names:
            txt = names[fp]
            name = re.match(r"%?([\w.\-]+) =", txt).group(1).replace(".", "_")
            ops = txt.split(" fusion(")[1].split(")")[0].count(",") if " fusion(" in txt else 1
            products.append((i, name, max(ops, 1)))
    doc["products"] = [p[1] for p in products]
    doc["candidate_rows"] = []
    for j, (bm, bk, warps, stages) in enumerate(CANDIDATES):
        c = {"block_m": bm, "block_k": bk, "num_warps": warps, "num_stages": stages}
        # shared memory of the pipelined tiles: every weight operand's block_m x block_k, the rows'
        assign = {i: c for i, _, ops in products if stages * bk * (bm * ops + 16) * 2 <= 200 * 1024}
        path = os.path.join(out, f"c{j}.textproto")
        with open(path, "w") as f:
            f.write(with_tilings(head, entries, assign))
        row = launch(out, a.preset, f"c{j}", {"xla_gpu_load_autotune_results_from": path})
        row["tiling"], row["pinned"] = c, [n for i, n, _ in products if i in assign]
        doc["candidate_rows"].append(row)
        print(json.dumps(row), flush=True)
    best = {}
    for i, name, _ in products:
        t = doc["default"].get("kernel_us", {}).get(name, float("inf"))
        for row in doc["candidate_rows"]:
            v = row.get("kernel_us", {}).get(name)
            if v is not None and name in row["pinned"] and v < t:
                t, best[i] = v, row["tiling"]
    doc["pinned_tilings"] = {name: best.get(i) for i, name, _ in products}
    path = os.path.join(out, "pinned.textproto")
    with open(path, "w") as f:
        f.write(with_tilings(head, entries, best))
    for tag in ("pinned", "default2", "pinned2"):
        extra = {} if tag == "default2" else {"xla_gpu_load_autotune_results_from": path}
        doc[tag] = launch(out, a.preset, tag, extra)
        print(tag, json.dumps(doc[tag]), flush=True)
    with open(os.path.join(out, "gemm_pins.json"), "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
