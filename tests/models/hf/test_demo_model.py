"""``python -m kvjax demo --model DIR``: a checkpoint made with transformers at test time, served
token for token with transformers (``--check transformers``), over a mesh and overlapped too; bad
checkpoints are refused by name before anything compiles."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from kvjax.cli import main as cli
from kvjax.testing.fast_compile import FAST_XLA_FLAGS

ROOT = pathlib.Path(__file__).resolve().parents[3]

# One token size (8): two step programs (decode-only and mixed) per run instead of three; longer
# prompts are prefilled in chunks of 8 tokens (nothing here depends on the step sizes).
SIZES = ["--requests", "3", "--max-model-len", "48", "--quiet", "--token-sizes", "8", "--max-num-batched-tokens", "8"]


def _demo(args, tmp_path, env_extra=None):
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # kvjax.testing.fast_compile's settings (about half the CLI's compile time); the demo keeps
    # the flags and adds its host device count. torch on one thread: on a busy 2-core machine its second
    # thread spin-waits (the --check transformers forward).
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_XLA_FLAGS, OMP_NUM_THREADS="1",
               **(env_extra or {}))
    proc = subprocess.run([sys.executable, "-m", "kvjax", "demo", *args, *SIZES, "--json", str(out)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


def test_demo_serves_a_checkpoint_token_for_token_with_transformers(hf_checkpoint, tmp_path):
    path = hf_checkpoint("granite_rope_moe")
    proc, rep = _demo(["--model", path, "--check", "transformers", "--poison"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "parity with transformers 3/3 requests" in proc.stdout
    for rid, r in rep["requests"].items():
        assert r["transformers"]["matches_transformers"] and r["matches_reference"], (rid, r)
        assert r["output"] and all(0 <= t < 128 for t in r["output"])


def test_demo_over_a_mesh_overlapped_with_sampling_matches_one_device(hf_checkpoint, tmp_path):
    """--mesh data=2,model=2 --overlap: the same tokens as one device (sampled requests included:
    the workload's seeds key the noise by position); the sanitizer passes on every rank."""
    path = hf_checkpoint("granite_rope_moe")
    work = {"requests": [
        {"id": "g", "prompt": [5, 6, 7, 8, 9], "max_tokens": 6},
        {"id": "s", "prompt": [40, 41, 42], "max_tokens": 8, "temperature": 0.8, "seed": 3, "arrival_step": 1},
        {"id": "t", "prompt": [70, 71], "max_tokens": 5, "temperature": 1.2, "top_k": 20, "seed": 4,
         "arrival_step": 2}]}
    wfile = tmp_path / "w.json"
    wfile.write_text(json.dumps(work))
    one, rep1 = _demo(["--model", path, "--workload", str(wfile)], tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    mesh, rep2 = _demo(["--model", path, "--workload", str(wfile), "--mesh", "data=2,model=2", "--overlap",
                        "--poison"], tmp_path)
    assert mesh.returncode == 0, mesh.stdout + mesh.stderr[-3000:]
    assert {k: v["output"] for k, v in rep1["requests"].items()} == \
        {k: v["output"] for k, v in rep2["requests"].items()}
    assert rep2["all_match"] and rep2["checked"]


@pytest.mark.parametrize("breakage, match", [
    ("architecture", "MysteryForCausalLM.*not supported"),
    ("field", "position_embedding_type"),
    ("missing", "missing"),
    ("truncated", "truncated|bytes"),
])
def test_a_bad_checkpoint_is_refused_before_any_compile(hf_checkpoint, tmp_path, breakage, match, monkeypatch,
                                                        capsys):
    import shutil

    import kvjax.runner

    src = pathlib.Path(hf_checkpoint("granite_rope_moe"))
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    weights = bad / "model.safetensors"
    if breakage == "architecture":
        cfg["architectures"] = ["MysteryForCausalLM"]
    elif breakage == "field":
        cfg["position_embedding_type"] = "alibi"
    elif breakage == "truncated":
        weights.write_bytes(weights.read_bytes()[:-100])
    (bad / "config.json").write_text(json.dumps(cfg))
    if breakage == "missing":
        from safetensors.numpy import load_file, save_file

        tensors = load_file(str(weights))
        tensors.pop(sorted(tensors)[0])
        save_file(tensors, str(weights), metadata={"format": "pt"})

    def boom(*a, **k):
        raise AssertionError("compiled before refusing the checkpoint")

    monkeypatch.setattr(kvjax.runner.Runner, "precompile", boom)
    capsys.readouterr()  # the checkpoint's making
    assert cli.main(["demo", "--model", str(bad), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "Traceback" not in err
    import re
    assert re.search(match, err), err


def test_model_only_options_need_a_model(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--check", "transformers"])
    assert e.value.code == 2 and "need --model" in capsys.readouterr().err
