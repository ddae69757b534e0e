"""kvjax.testing.difftest and ``python -m kvjax difftest``.

Against torch everything runs on a fresh machine (torch is a test extra); the
vLLM oracle is simulated as missing by monkeypatching
``kvjax.testing.vllm.available``, and one small real ``--against vllm`` run is
skipped unless vLLM 0.33.0 is installed (``bash scripts/install_vllm_oracle.sh``).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")

from kvjax.__main__ import main  # noqa: E402
from kvjax.testing import difftest as dt  # noqa: E402
from kvjax.testing import scenarios as sc  # noqa: E402
from kvjax.testing.fast_compile import with_fast_xla_flags  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]

# The adversarial scenarios the issue lists, by name (each must exist for at least one op).
REQUIRED = (
    "all-pad-dummy-step", "pad-inside-and-tail", "n-lt-t", "null-block-nan", "reused-row-overwrite",
    "reused-row-fresh-start", "reused-row-pd-disagg", "chunked-prefill-gap", "decode-0..k-drafts",
    "spec-decode-0..k-drafts", "prompt-tail-straddling", "fp8-saturation", "fp8-per-head-scales",
    "null-mamba-rows", "speculative-mamba-rows", "last-block", "kernel-blocks-per-block-2",
)


def test_every_op_has_seeded_random_and_adversarial_scenarios():
    all_sc = sc.scenarios(cases=2)
    assert {s.op for s in all_sc} == set(sc.OPS)
    names = {s.name for s in all_sc}
    assert set(REQUIRED) <= names, set(REQUIRED) - names
    for op in sc.OPS:
        mine = [s for s in all_sc if s.op == op]
        assert [s.name for s in mine if not s.adversarial] == ["random-0", "random-1"], op
        assert any(s.adversarial for s in mine), op
    s = next(x for x in all_sc if x.key == "reshape_and_cache_flash/random-0")
    a, b = s.inputs(5), s.inputs(5)
    assert all(np.array_equal(np.asarray(a[k]).view(np.uint8), np.asarray(b[k]).view(np.uint8))
               for k in a if isinstance(a[k], np.ndarray))
    assert sc.scenario_seed(0, s) == sc.scenario_seed(0, s) != sc.scenario_seed(1, s)
    with pytest.raises(ValueError, match="unknown op"):
        sc.scenarios(["no_such_op"])


def test_compare_arrays_reports_bits_ulps_and_the_first_difference():
    f = np.array([1.0, np.nan, -0.0, 3.0], np.float32)
    same = dt.compare_arrays("a", f, f.copy(), sc.BITWISE)
    assert same.ok and same.bitwise and same.max_abs == 0 and same.max_ulp == 0
    g = f.copy()
    g[3] = np.nextafter(np.float32(3.0), np.float32(4.0))
    close = dt.compare_arrays("a", g, f, sc.SSM_F32, other="torch")
    assert close.ok and not close.bitwise and close.max_ulp == 1
    bad = dt.compare_arrays("a", g, f, sc.BITWISE, other="torch")
    assert not bad.ok and "first at index (3,)" in bad.reason and "torch 3.0" in bad.reason
    g[1] = 0.0  # NaN -> number
    nan = dt.compare_arrays("a", g, f, sc.SSM_F32)
    assert not nan.ok and nan.max_abs == np.inf and "index (1,)" in nan.reason
    ex = dt.compare_arrays("a", g, f, sc.SSM_F32, exclude=[(np.arange(4) == 1, "a quirk")])
    assert ex.ok and ex.excluded == 1 and "a quirk" in ex.notes[0]
    ints = dt.compare_arrays("s", np.array([3, -1], np.int32), np.array([3, 0], np.int64), sc.EXACT)
    assert not ints.ok and ints.max_abs == 1 and "kvjax -1, other 0" in ints.reason


def test_api_against_torch_passes_on_every_op():
    """(At the suite's fast XLA:CPU settings, tests/conftest.py.)"""
    report = dt.difftest(against="torch", cases=1, seed=3, backend="reference")
    assert report.ok, report.table()
    assert {r.op for r in report.rows} == set(sc.OPS)
    assert all(r.status == "pass" and r.against == "torch" for r in report.rows)
    # Copies and fp8 casts bitwise (bar NaN bits of bf16 null rows, which is noted); integers exact.
    for r in report.rows:
        if r.op in ("reshape_and_cache_flash", "concat_and_cache_mla", "zero_blocks",
                    "combine_sampled_and_draft_tokens", "compute_slot_mapping", "request_state"):
            assert r.max_abs == 0 and (r.bitwise or "NaNs compared as values" in r.notes[0]), r
    table = report.table()
    assert "reshape_and_cache_flash" in table and "fp8-saturation" in table and "OK:" in table
    json.dumps(report.to_json(), allow_nan=False)


def _pad_to_null_block(original):
    """A kvjax KV write with the PR 39444 bug: the first PAD slot writes into null block 0."""
    def buggy(key, value, key_cache, value_cache, slot_mapping, *args, **kwargs):
        s = np.array(slot_mapping)
        pads = np.flatnonzero(s < 0)
        if pads.size:
            s[pads[0]] = 0
        return original(key, value, key_cache, value_cache, s, *args, **kwargs)
    return buggy


def test_planted_pad_write_fails_with_a_readable_report(monkeypatch, capsys):
    from pallas_kernels import kv_write

    monkeypatch.setattr(kv_write, "reshape_and_cache_flash",
                        _pad_to_null_block(kv_write.reshape_and_cache_flash))
    report = dt.difftest(against="torch", ops=["reshape_and_cache_flash"], cases=0, backend="reference")
    assert not report.ok
    failed = {r.scenario for r in report.failures}
    assert "all-pad-dummy-step" in failed and "pad-inside-and-tail" in failed
    row = next(r for r in report.failures if r.scenario == "all-pad-dummy-step")
    # Which array, the first differing index (null block, slot 0), both values.
    assert row.reason.startswith("key_cache: ") and "first at index (0, 0, 0, 0)" in row.reason
    assert "kvjax 12288.0" in row.reason and "torch nan (float32, 0x7fe5a5a5)" in row.reason
    table = report.table()
    assert "FAIL reshape_and_cache_flash/all-pad-dummy-step vs torch" in table
    assert "FAILED:" in table.splitlines()[-1]
    # The CLI: same table, exit status 1.
    rc = main(["difftest", "--ops", "reshape_and_cache_flash", "--cases", "0", "--backend",
               "reference", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 1 and "FAIL" in out and "key_cache: " in out


def test_planted_ssm_error_is_caught_by_the_tolerance(monkeypatch):
    from pallas_kernels import mamba

    original = mamba.selective_state_update

    def one_element_off(*args, **kwargs):
        out, state = original(*args, **kwargs)
        return out.at[(0,) * out.ndim].add(0.5), state

    monkeypatch.setattr(mamba, "selective_state_update", one_element_off)
    report = dt.difftest(against="torch", ops="selective_state_update", cases=0, backend="reference")
    assert not report.ok and len(report.failures) == len(report.rows)
    assert all(r.reason.startswith("out: 1 of ") and "outside rtol" in r.reason
               for r in report.failures)


def test_cli_against_torch_passes_and_writes_json(tmp_path, capsys):
    out_json = tmp_path / "report.json"
    rc = main(["difftest", "--ops", "compute_slot_mapping,request_state", "zero_blocks",
               "--cases", "1", "--seed", "4", "--backend", "reference", "--json", str(out_json)])
    cap = capsys.readouterr()
    assert rc == 0, cap.out
    assert "compute_slot_mapping" in cap.out and "OK:" in cap.out
    assert "scenarios" in cap.err  # the progress bar
    data = json.loads(out_json.read_text())
    assert data["ok"] and data["config"]["ops"] == ["zero_blocks", "compute_slot_mapping",
                                                    "request_state"]


def test_cli_entry_point_in_a_fresh_process():
    # kvjax.testing.fast_compile's settings: about half the CPU time of each compile
    flags = with_fast_xla_flags(os.environ.get("XLA_FLAGS"))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
    p = subprocess.run([sys.executable, "-m", "kvjax", "difftest", "--ops", "compute_slot_mapping",
                        "--cases", "1", "--quiet"], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "compute_slot_mapping" in p.stdout and "chunked-prefill-gap" in p.stdout
    bad = subprocess.run([sys.executable, "-m", "kvjax", "difftest", "--ops", "nope"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert bad.returncode == 2 and "unknown op" in bad.stderr


@pytest.mark.parametrize("against", ["vllm", "all"])
def test_against_vllm_without_vllm_says_how_to_install(monkeypatch, capsys, against):
    from kvjax.testing import vllm as oracle

    monkeypatch.setattr(oracle, "available", lambda: False)
    monkeypatch.setattr(oracle, "reason", lambda: "vllm is not installed (simulated)")
    rc = main(["difftest", "--against", against, "--ops", "compute_slot_mapping", "--quiet"])
    err = capsys.readouterr().err
    assert rc != 0 and "bash scripts/install_vllm_oracle.sh" in err and "(simulated)" in err
    with pytest.raises(dt.VLLMUnavailable, match="install_vllm_oracle"):
        dt.difftest(against=against, ops=["zero_blocks"])


def test_small_run_against_vllm(capsys, vllm_oracle):
    rc = main(["difftest", "--against", "vllm", "--ops", "combine_sampled_and_draft_tokens",
               "reshape_and_cache_flash", "--cases", "1", "--backend", "reference", "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert " vllm " in out and "pass*" in out  # the fp8 interpreter rule is stated, not silent
    assert "skip" in out  # per-head scales / padded rows: skipped with a reason
