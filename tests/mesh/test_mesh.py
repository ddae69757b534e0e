"""Serving over a ("data", "model") mesh on 8 host CPU devices (in a subprocess: the device
count must be set before JAX starts)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from kvjax.host.placement import least_loaded
from kvjax.runner.mesh import force_host_device_count, parse_mesh_shape

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = pathlib.Path(__file__).with_name("mesh_worker.py")
WORKLOAD = json.loads(WORKER.with_name("workload.json").read_text())


def run_worker(*cases, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(WORKER), *cases], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r["case"]: r for r in map(json.loads, proc.stdout.splitlines())}


def test_parse_mesh_shape():
    assert parse_mesh_shape("data=4,model=2") == (4, 2)
    assert parse_mesh_shape("model=2") == (1, 2)
    assert parse_mesh_shape("data=3") == (3, 1)
    for bad, match in (("data=0", "positive"), ("pipe=2", "data=D,model=M"), ("data=x", "positive int"),
                       ("data", "data=D,model=M")):
        with pytest.raises(ValueError, match=match):
            parse_mesh_shape(bad)


def test_least_loaded_picks_the_lowest_rank_among_equals():
    assert least_loaded([2, 1, 1, 3]) == 1
    assert least_loaded([0]) == 0
    with pytest.raises(ValueError, match="loads"):
        least_loaded([])


def test_force_host_device_count_replaces_an_existing_flag(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=2")
    assert force_host_device_count(8)
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=8"
    assert not force_host_device_count(8)


def run_cli_2x1(tmp_path):
    """``python -m kvjax demo --mesh data=2`` on the worker's workload and sizes (sets XLA_FLAGS itself)."""
    workload = tmp_path / "workload.json"
    workload.write_text(json.dumps(WORKLOAD))
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "kvjax", "demo", "--mesh", "data=2,model=1", "--poison", "--quiet",
         "--workload", str(workload), "--block-size", "8", "--num-blocks", "24", "--max-model-len", "48",
         "--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--token-sizes", "16", "--json", str(out)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "CPU-only machine: set XLA_FLAGS=--xla_force_host_platform_device_count=2" in proc.stderr
    assert "rank 1" in proc.stdout and "dummy steps" in proc.stdout
    rep = json.loads(out.read_text())
    return {"outputs": {k: v["output"] for k, v in rep["requests"].items()}, "ok": proc.returncode == 0,
            "checked": rep["checked"], "check_failures": rep["check_failures"],
            "serving_compiles": rep["serving_compiles"], "ranks": rep["ranks"]}


def test_data_parallel_meshes_match_single_device_and_catch_a_zero_slot_dummy_step(tmp_path):
    """Tokens identical to the single-device runner and the dense reference on meshes (1,1), (2,1),
    (4,1) with poison on; idle ranks ran dummy steps that left their null block, null slot and whole
    state bitwise unchanged; the planted PR 39444 regression (dummy slot mapping zeros) is caught."""
    res = run_worker("single", "1x1", "4x1", "planted")
    res["2x1"] = run_cli_2x1(tmp_path)
    single = res["single"]
    assert single["all_match"] and single["nan_count"] == 0 and single["serving_compiles"] == 0
    for case in ("1x1", "2x1", "4x1"):
        r = res[case]
        assert r["ok"] and r["checked"] and not r["check_failures"], (case, r)
        assert r["outputs"] == single["outputs"], case
        assert r["serving_compiles"] == 0
    for case in ("2x1", "4x1"):
        ranks = res[case]["ranks"]
        assert len(ranks) == int(case[0])
        assert sum(v["real_steps"] > 0 for v in ranks.values()) >= 2
        assert all(v["dummy_steps"] > 0 for k, v in ranks.items() if k != "0"), (case, ranks)
    planted = res["planted"]
    failed = {(f["flag"], f["rank"]) for f in planted["check_failures"]}
    assert ("null_unchanged", 1) in failed and ("idle_untouched", 1) in failed, planted["check_failures"]
    assert not planted["ok"]
