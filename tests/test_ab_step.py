"""``benchmarks/ab_step.py``: trees from git revisions, and the benchmark run from each tree in
alternating processes, every row's times kept in run order with their median (a stand-in
benchmark script: the real one needs a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import ab_step  # noqa: E402

FAKE = '''import json, os, sys
out = sys.argv[sys.argv.index("--gpu-run") + 1]
os.makedirs(out, exist_ok=True)
log = os.path.join(os.path.dirname(out), "order.txt")
with open(log, "a") as fh:
    fh.write(os.path.basename(out) + "\\n")
us = float(open(os.path.join(os.getcwd(), "us.txt")).read()) + len(open(log).read().split())
rows = [dict(preset="p", impl="kvjax", phase="decode", batch=1, context=int(sys.argv[-1]), device_us=us)]
json.dump(dict(meta={}, rows=rows), open(os.path.join(out, "model.json"), "w"))
'''


def _tree(path, us):
    os.makedirs(path / "benchmarks")
    (path / "benchmarks" / "fake.py").write_text(FAKE)
    (path / "us.txt").write_text(str(us))
    return str(path)


def test_alternating_processes_and_medians(tmp_path):
    a, b = _tree(tmp_path / "a", 100.0), _tree(tmp_path / "b", 200.0)
    out = tmp_path / "out"
    doc = ab_step.run([("old", a), ("new", b)], str(out), 2, ["--context", "1024"],
                      script="benchmarks/fake.py", timeout_s=60)
    assert (out / "order.txt").read_text().split() == ["old-1", "new-1", "old-2", "new-2"]
    # each process adds its position in the run order: old 101, 103; new 202, 204
    assert [r["device_us"] for r in doc["summary"]["old"]] == [[101.0, 103.0]]
    assert [(r["device_us"], r["median_us"], r["context"]) for r in doc["summary"]["new"]] == \
        [([202.0, 204.0], 203.0, 1024)]
    assert json.load(open(out / "ab.json"))["runs"][-1] == dict(tree="new", round=2, rc=0,
                                                                dir=str(out / "new-2"))


def test_bad_trees_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        ab_step.main(["run", "--tree", "old", "--out", str(tmp_path)])
    assert "--tree must be NAME=DIR" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab_step.main(["run", "--tree", f"x={tmp_path}", "--tree", f"x={tmp_path}", "--out", str(tmp_path)])
    assert "--tree names must differ" in capsys.readouterr().err


def test_prepare_exports_a_revision(tmp_path):
    if subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        ab_step.prepare(str(tmp_path / "t"), "HEAD")
    finally:
        os.chdir(cwd)
    assert (tmp_path / "t" / "kvjax" / "__init__.py").exists()
    assert (tmp_path / "t" / "benchmarks" / "bench_model.py").exists()
    assert not (tmp_path / "t" / "benchmarks" / "results").exists()
    with pytest.raises(SystemExit, match="not empty"):
        ab_step.prepare(str(tmp_path / "t"), "HEAD")
