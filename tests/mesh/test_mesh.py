"""Serving over a ("data", "model") mesh on 8 host CPU devices (in a subprocess: the device
count must be set before JAX starts)."""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from kvjax.host.placement import least_loaded
from kvjax.models import TinyHybridConfig, TinyHybridModel
from kvjax.runner import Runner, RunnerConfig
from kvjax.runner.mesh import force_host_device_count, parse_mesh_shape
from kvjax.testing.fast_compile import FAST_XLA_FLAGS

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = pathlib.Path(__file__).with_name("mesh_worker.py")
WORKLOAD = json.loads(WORKER.with_name("workload.json").read_text())
# The CLI's processes compile at kvjax.testing.fast_compile's settings, as the worker's runners do
# (mesh_worker.FAST_COMPILE); the demo keeps the flags and adds its host device count.


def run_worker(*cases, timeout=900):
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
                       ("data", "data=D,model=M"), ("", "data=D,model=M"), (" , ", "data=D,model=M"),
                       ("data=2,data=4", "twice")):
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


# The worker's sizes (mesh_worker.config) as demo options, and its one compile thread
# (mesh_worker.COMPILE_WORKERS).
CLI_SIZES = ("--poison", "--quiet", "--block-size", "8", "--num-blocks", "24", "--max-model-len", "48",
             "--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--token-sizes", "16",
             "--compile-workers", "1")


def run_cli_2x1(tmp_path):
    """``python -m kvjax demo --mesh data=2`` on the worker's workload and sizes (sets XLA_FLAGS itself)."""
    workload = tmp_path / "workload.json"
    workload.write_text(json.dumps(WORKLOAD))
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_XLA_FLAGS)
    proc = subprocess.run(
        [sys.executable, "-m", "kvjax", "demo", "--mesh", "data=2,model=1",
         "--workload", str(workload), *CLI_SIZES, "--json", str(out)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "CPU-only machine: set XLA_FLAGS=--xla_force_host_platform_device_count=2" in proc.stderr
    assert "rank 1" in proc.stdout and "dummy steps" in proc.stdout
    rep = json.loads(out.read_text())
    return {"outputs": {k: v["output"] for k, v in rep["requests"].items()}, "ok": proc.returncode == 0,
            "checked": rep["checked"], "serving_compiles": rep["serving_compiles"], "ranks": rep["ranks"]}


MESHES = ("2x1", "1x2", "2x2")
# Features on a mesh: tokens must match the dense reference (fp8 and drafts change them vs "single").
# The overlapped 2x2 case reuses the 2x2 runner (the loop is no setting of the compiled step), so
# it runs here, after "2x2"; the others compile their own runners, in test_mesh_features.py.
SHARED_FEATURES = ("2x2_overlap",)
FEATURES = ("2x1_fp8_spec", "2x1_rpa_overlap")
# Planted bugs: case -> the sanitizer invariants that may catch it. The host-side plants
# (mesh_worker.HOST_PLANTS) reuse the clean 2x1 runner compiled by the case "2x1" (here); the
# compiled-in one ("planted") compiles its own (test_mesh_features.py).
HOST_PLANTED = ("planted_stale", "planted_nozero")
PLANTED = {
    # PR 39444: the dummy step's zeros slot mapping writes into rank 1's null block
    "planted": {"null_block_changed", "idle_rank_changed"},
    # re-sent inputs are not a dummy step: the device says so for the rank the loop left idle
    "planted_stale": {"idle_rank_not_dummy"},
    # fresh blocks handed out unzeroed (every rank's zero_blocks ids all -1)
    "planted_nozero": {"fresh_block_not_zero", "fresh_slot_not_zero"},
}


@pytest.fixture(scope="module")
def worker_results(tmp_path_factory):
    """The meshes' cases, in one process with 8 host devices: one device, meshes (2,1) .. (2,2),
    (2,2) overlapped (it reuses the 2x2 runner), the host-side planted regressions (they reuse the
    2x1 runner); and (2,1) through the CLI. The other features on meshes and the compiled-in plant
    are in test_mesh_features.py, so that the two xdist workers (``--dist loadfile``) share the
    mesh cases."""
    res = run_worker("single", *MESHES, *SHARED_FEATURES, *HOST_PLANTED)
    res["2x1_cli"] = run_cli_2x1(tmp_path_factory.mktemp("cli"))
    return res


def test_the_cli_serves_the_same_tokens_over_a_mesh(worker_results):
    """``demo --mesh data=2`` gives the worker's 2x1 tokens and placement (the CLI sets the host
    device count itself)."""
    cli, ref = worker_results["2x1_cli"], worker_results["2x1"]
    assert cli["ok"] and cli["checked"] and cli["serving_compiles"] == 0
    assert cli["outputs"] == ref["outputs"]
    assert cli["ranks"]["0"]["requests"] == ref["ranks"]["0"]["requests"]


@pytest.mark.parametrize("mesh", MESHES)
def test_mesh_tokens_match_single_device_and_dense_reference_with_poison(worker_results, mesh):
    """Tokens identical to the single-device runner and the dense reference (logits within the
    demo tolerance; two requests sampled with their own seeds) with poison on; no serving-time compile; the sanitizer passes on every rank
    at every step (null block / slot, fresh memory, idle ranks bitwise unchanged)."""
    single = worker_results["single"]
    assert single["all_match"] and single["nan_count"] == 0 and single["serving_compiles"] == 0
    r = worker_results[mesh]
    assert r["ok"] and r["checked"], r
    assert r["outputs"] == single["outputs"]
    assert r["serving_compiles"] == 0
    D = int(mesh.split("x")[0])
    ranks = r["ranks"]
    assert sorted(ranks) == [str(d) for d in range(D)]
    if D > 1:  # idle ranks ran dummy steps (every rank but 0 is idle at some step of this workload)
        assert sum(v["real_steps"] > 0 for v in ranks.values()) >= 2
        assert all(v["dummy_steps"] > 0 for k, v in ranks.items() if k != "0"), ranks


def check_feature_case(r: dict) -> None:
    """A feature on a mesh: every request matches the dense reference, the sanitizer passes on
    every rank (poison on), no serving-time compile, idle ranks ran dummy steps."""
    assert r["ok"] and r["checked"] and r["all_match"] and r["serving_compiles"] == 0, r
    assert len(r["outputs"]) == len(WORKLOAD["requests"])
    assert r["ranks"]["1"]["dummy_steps"] > 0, r["ranks"]


@pytest.mark.parametrize("case", SHARED_FEATURES)
def test_mesh_features_on_a_compiled_runner_match_the_dense_reference_with_poison(worker_results, case):
    """--overlap on a 2x2 mesh (the 2x2 case's runner, reset): as test_mesh_features.py's cases."""
    check_feature_case(worker_results[case])


@pytest.mark.parametrize("case", HOST_PLANTED)
def test_planted_mesh_bugs_are_caught_by_the_sanitizer(worker_results, case):
    err = worker_results[case].get("error")
    assert err is not None and err["invariant"] in PLANTED[case], worker_results[case]


def _two_processes(tmp_path, extra=((), ()), attempts=3):
    """The two processes' ``(procs, [(stdout, stderr)])``. The coordinator's port is a free one
    found just before they start; another process may take it in between, so a run whose
    coordinator could not bind it is run again on another port (``attempts`` in all)."""
    for attempt in range(attempts):
        procs, outs = _two_processes_once(tmp_path, extra)
        if attempt + 1 == attempts or not (procs[0].returncode != 0 and _port_taken(outs[0][1])):
            return procs, outs
    raise AssertionError("unreachable")


def _port_taken(stderr: str) -> bool:
    """Whether the coordinator (process 0) failed to bind its port: gRPC logs "Failed to add port
    to server" (and the process dies, SIGSEGV on jaxlib 0.10.2)."""
    return "failed to add port" in stderr.lower() or "address already in use" in stderr.lower()


def _two_processes_once(tmp_path, extra):
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_XLA_FLAGS)
    # Each process writes to its own files, not a pipe: one blocked on a full pipe while the other
    # waits for it in a collective would stall both until the deadline.
    logs = [(tmp_path / f"out.{i}", tmp_path / f"err.{i}") for i in range(2)]
    procs = []
    try:
        for i, (out, err) in enumerate(logs):
            with open(out, "w") as fo, open(err, "w") as fe:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "kvjax", "demo", "--mesh", "data=2", "--coordinator",
                     f"localhost:{port}", "--num-processes", "2", "--process-id", str(i), *CLI_SIZES,
                     *extra[i], "--json", str(tmp_path / "report.json")],
                    stdout=fo, stderr=fe, stdin=subprocess.DEVNULL, env=env, cwd=ROOT))
        deadline = time.monotonic() + 600  # both processes, together
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if procs[0].poll() not in (None, 0) and _port_taken(logs[0][1].read_text()):
                break  # the coordinator is gone: process 1 would wait for it until its own timeout
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return procs, [(out.read_text(), err.read_text()) for out, err in logs]


def test_two_processes_through_jax_distributed(worker_results, tmp_path):
    """``demo --mesh data=2`` as 2 processes (jax.distributed on localhost, gloo CPU collectives),
    one data rank each: same placement and tokens as the single-device runner, checks pass."""
    workload = tmp_path / "workload.json"
    workload.write_text(json.dumps(WORKLOAD))
    procs, outs = _two_processes(tmp_path, (("--workload", str(workload)),) * 2)
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err[-4000:]
    reports = [json.loads((tmp_path / f"report.json.{i}").read_text()) for i in range(2)]
    outputs = {}
    for i, rep in enumerate(reports):
        assert rep["process_index"] == i and list(rep["ranks"]) == [str(i)]
        assert rep["checked"] and rep["all_match"]
        assert rep["serving_compiles"] == 0
        outputs.update({k: v["output"] for k, v in rep["requests"].items()})
    assert outputs == worker_results["single"]["outputs"]
    assert reports[1]["ranks"]["1"]["dummy_steps"] > 0
    assert reports[0]["ranks"]["0"]["requests"] == worker_results["2x1"]["ranks"]["0"]["requests"]


def test_tp_shard_and_param_layout():
    """A shard sees 1/M of the heads; its contiguous slice of the reordered in_proj / conv params is
    [z | x | B | C | dt] of its own heads, with B and C whole."""
    cfg = TinyHybridConfig(layer_types=("mamba",), mamba_num_heads=4, mamba_head_dim=2, mamba_d_state=3)
    model = TinyHybridModel(cfg)
    shard = model.shard(2).config
    assert (shard.num_heads, shard.num_kv_heads, shard.mamba_num_heads) == (2, 1, 2)
    di, bc, H = cfg.d_inner, 2 * cfg.mamba_d_state, cfg.mamba_num_heads
    cols = np.arange(cfg.in_proj_dim)[None, :] * np.ones((3, 1))
    conv = np.arange(cfg.conv_dim)
    params = {"params": {"layer_0": {"in_proj": cols, "conv_weight": conv[:, None] * np.ones((1, 4)),
                                     "conv_bias": conv}}}
    out = model.layout_for_shards(params, 2)["params"]["layer_0"]
    assert params["params"]["layer_0"]["in_proj"] is cols  # the input is left alone
    z, x, b_c, dt = np.arange(di), di + np.arange(di), 2 * di + np.arange(bc), 2 * di + bc + np.arange(H)
    half = out["in_proj"].shape[1] // 2
    for m in range(2):
        want = np.concatenate([z[m * 4:(m + 1) * 4], x[m * 4:(m + 1) * 4], b_c, dt[m * 2:(m + 1) * 2]])
        np.testing.assert_array_equal(out["in_proj"][0, m * half:(m + 1) * half], want)
        want_conv = np.concatenate([np.arange(di)[m * 4:(m + 1) * 4], di + np.arange(bc)])
        np.testing.assert_array_equal(out["conv_bias"][m * len(want_conv):(m + 1) * len(want_conv)], want_conv)
    assert shard.in_proj_dim == half and shard.conv_dim * 2 == out["conv_weight"].shape[0]
    with pytest.raises(ValueError, match="model=3 must divide"):
        model.shard(3)
    with pytest.raises(ValueError, match="mamba_n_groups == 1"):
        TinyHybridModel(TinyHybridConfig(layer_types=("mamba",), mamba_n_groups=2)).shard(2)


def test_tensor_parallel_rpa_is_a_usage_error_before_anything_starts(capsys):
    from kvjax.cli import main as cli

    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--mesh", "model=2", "--kv-layout", "rpa"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "supports kv_layout='flash', got 'rpa'" in err and "Traceback" not in err


def test_runner_rejects_a_mesh_without_data_and_model_axes():
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("x", "y"))
    with pytest.raises(ValueError, match=r"axes \('data', 'model'\)"):
        Runner(RunnerConfig(), mesh=mesh)


# Mosaic kernels in one rank's step (as in tests/runner/test_step_lowering.py): KV write, zeroing
# of KV blocks and of state slots, token combine, conv and SSM updates (the last two unnamed).
TPU_KERNELS_PER_STEP = 6


def test_sharded_step_lowers_for_a_2x2_tpu_mesh():
    """Every bucket's sharded step (data=2, model=2; TPU kernels inside, backend="pallas_tpu")
    exports for TPU through jax.export on host devices: the Mosaic custom calls are in the module
    (no interpreter callback), the state is donated (every leaf aliases an output), and the
    program holds the mesh's collectives (MoE all-gather / reduce-scatter, TP all-reduce)."""
    buckets = run_worker("tpu_2x2", timeout=300)["tpu_2x2"]["buckets"]
    assert len(buckets) >= 2
    for b in buckets:
        assert b["platforms"] == ["tpu"] and b["nr_devices"] == 4, b
        assert b["tpu_custom_calls"] == TPU_KERNELS_PER_STEP, b
        assert {"zero_blocks_tpu", "kv_write_tpu", "combine_sampled_and_draft_tokens_tpu"} <= set(
            b["kernel_names"]), b
        assert b["host_callbacks"] == 0, b
        assert b["aliased_outputs"] == b["state_leaves"] > 0, b
        assert b["collectives"] == ["all_gather", "all_reduce", "reduce_scatter"], b


def test_no_zero_size_program_parameters():
    # A zero-size donated, data-sharded parameter crashed XLA's GPU compiler on 2 GPUs; the step's
    # parameters are the params, the rows' non-empty arrays, the input and output areas and the
    # pools: none is empty.
    import re

    cfg = RunnerConfig(model=TinyHybridConfig(layer_types=("attn", "mamba")), max_num_seqs=2,
                       max_num_batched_tokens=4, token_sizes=(4,))
    runner = Runner(cfg)
    fn, args, _ = runner.jitted_step(runner.buckets.buckets[0])
    text = fn.lower(*args).as_text()
    params = re.search(r"func\.func public @main\((.*?)\) ->", text, re.S).group(1)
    types = re.findall(r"tensor<([0-9x]+)x?[a-z]", params)
    assert types and not any("0" in t.split("x") for t in types), types
