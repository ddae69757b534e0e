"""End-to-end parity of real checkpoints served on a GPU: ``python -m kvjax demo --model DIR
--check reference`` on small random Hugging Face checkpoints (made here by transformers, as the
tests make them: nothing is downloaded), float32 and bf16, with the default rows and with
``--max-num-seqs 1`` (every decode step one token: the one-token step's two-row programs).

    PYTHONPATH=. python benchmarks/gpu_check_demo_parity.py --out DIR [--archs granite,nemotron_h,deepseek_v3]
        [--dtypes float32,bfloat16] [--seqs default,1]

Prints, per run, the demo's parity, NaN and serving-time-compile lines; exits 1 if any run is not
at parity with the dense reference (every request's tokens identical, logits within the demo's
tolerance of the reference or of one of its variants: fp8 rounding for an fp8 cache, routing
near-ties for a bf16 model with a router choice bias) or has a NaN.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_checkpoint(arch: str, out: str) -> str:
    """The tests' checkpoint of ``arch`` (tests/models/hf: conftest.CHECKPOINTS, or
    test_feature_matrix.DEEPSEEK for DeepSeek-V3), saved under ``out``."""
    import torch
    import transformers

    sys.path.insert(0, os.path.join(ROOT, "tests", "models", "hf"))
    import conftest  # the tests' checkpoints
    import test_feature_matrix as matrix
    name = matrix.ARCHS[arch]
    cls, kw = ("DeepseekV3Config", matrix.DEEPSEEK) if name is None else conftest.CHECKPOINTS[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**kw))
    conftest.redraw_weights(model, torch)
    path = os.path.join(out, f"ckpt-{arch}")
    model.save_pretrained(path)
    return path


def _at_parity(report: str) -> bool:
    """The demo's own verdict in its ``--json`` report: every request at parity, no NaN, no
    serving-time compile (read from the report, since a process may still fail at exit after
    writing it)."""
    try:
        with open(report) as f:
            r = json.load(f)
    except (OSError, ValueError):
        return False
    return bool(r.get("all_match")) and r.get("nan_count") == 0 and r.get("serving_compiles") == 0


def _print_misses(report: str) -> None:
    """The requests of a demo ``--json`` report that are not at parity, with their figures."""
    try:
        with open(report) as f:
            requests = json.load(f)["requests"]
    except (OSError, ValueError, KeyError) as e:
        print(f"no report ({type(e).__name__}: {e})")
        return
    for rid, r in sorted(requests.items()):
        if not r.get("matches_reference", True):
            print(f"not at parity: {rid} " + json.dumps({k: r.get(k) for k in (
                "max_logit_error", "max_logit_error_vs_match", "near_tie_rows", "fp8_rounding_rows",
                "routing_tie_rows", "preemptions")})
                  + f" output {r.get('output')}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--archs", default="granite,nemotron_h,deepseek_v3")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--seqs", default="default,1", help="--max-num-seqs of each run ('default': the demo's)")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    bad = 0
    for arch in a.archs.split(","):
        path = make_checkpoint(arch, a.out)
        for dtype in a.dtypes.split(","):
            for seqs in a.seqs.split(","):
                extra = [] if seqs == "default" else ["--max-num-seqs", seqs]
                report = os.path.join(a.out, f"demo-{arch}-{dtype}-{seqs}.json")
                cmd = [sys.executable, "-m", "kvjax", "demo", "--model", path, "--dtype", dtype,
                       "--check", "reference", "--quiet", "--json", report, *extra]
                p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
                keep = [ln for ln in p.stdout.splitlines()
                        if ln.startswith(("parity", "NaN", "serving-time"))]
                print(f"== {arch} {dtype} {' '.join(extra)} (exit {p.returncode})")
                print("\n".join(keep) if keep else p.stdout[-2000:])
                ok = _at_parity(report)
                if p.returncode or not ok:
                    print("stderr: " + p.stderr[-1500:])
                    _print_misses(report)
                bad += not ok
                sys.stdout.flush()
    print(f"{'all at parity' if not bad else f'{bad} run(s) NOT at parity'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
