"""The command line's edges: bad flags fail at once with exit 2, help shows every default,
the JSON report carries its settings, progress writes no carriage returns into logs."""

import argparse
import json
from types import SimpleNamespace

import numpy as np
import pytest

import kvjax.cli.main as cli
from kvjax.cli.demo import ServeReport, _tokens_note, check_against_reference, run_settings
from kvjax.host.scheduler import Request
from kvjax.runner import RunnerConfig
from kvjax.testing import vllm as oracle


def _refuse_to_serve(*args, **kwargs):
    raise AssertionError("the demo started serving")


def _exit_code(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("command", ["demo", "difftest"])
def test_json_into_a_missing_folder_fails_before_anything_runs(command, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli, "serve", _refuse_to_serve)
    monkeypatch.setattr(cli.dt, "difftest", _refuse_to_serve)
    out = tmp_path / "missing" / "out.json"
    code, err = _exit_code([command, "--json", str(out)], capsys)
    assert code == 2
    assert "--json" in err and "does not exist" in err and str(out.parent) in err
    code, err = _exit_code([command, "--json", str(tmp_path)], capsys)  # a folder, not a file
    assert code == 2 and "is a folder" in err


@pytest.mark.parametrize("argv, fragment", [
    (["demo", "--backend", "bogus"], "argument --backend: invalid choice: 'bogus'"),
    (["demo", "--compile-workers", "0"], "argument --compile-workers: must be >= 1, got 0"),
    (["demo", "--num-blocks", "-3"], "argument --num-blocks: must be >= 1, got -3"),
    (["demo", "--max-model-len", "lots"], "argument --max-model-len: expected an int, got 'lots'"),
    (["demo", "--num-spec-tokens", "-1"], "argument --num-spec-tokens: must be >= 0, got -1"),
    (["demo", "--requests", "0"], "argument --requests: must be >= 1, got 0"),
    (["trace", "--requests", "0"], "argument --requests: must be >= 1, got 0"),
    (["difftest", "--cases", "-1"], "argument --cases: must be >= 0, got -1"),
    (["difftest", "--backend", "bogus"], "argument --backend: invalid choice: 'bogus'"),
])
def test_bad_flags_are_a_usage_error_naming_the_flag(argv, fragment, monkeypatch, capsys):
    monkeypatch.setattr(cli, "serve", _refuse_to_serve)
    code, err = _exit_code(argv, capsys)
    assert code == 2
    assert fragment in err
    assert "Traceback" not in err


def _subparsers(parser):
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


def test_every_option_has_help_and_shows_its_default():
    subs = _subparsers(cli.build_parser())
    assert set(subs) == {"demo", "trace", "difftest"}
    for name, parser in subs.items():
        text = parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = action.option_strings[0]
            assert action.help, f"{name} {flag} has no help text"
            if action.default not in (None, False):
                shown = ",".join(map(str, action.default)) if isinstance(action.default, tuple) else action.default
                assert f"(default: {shown})" in " ".join(text.split()), f"{name} {flag}: default not shown"


def test_the_vllm_install_hint_is_printed_once(monkeypatch, capsys):
    reasons = [f"vllm is not installed; install it with `{oracle.INSTALL_COMMAND}`",
               "vLLM disabled Triton (no active driver)"]
    for why in reasons:
        monkeypatch.setattr(oracle, "available", lambda: False)
        monkeypatch.setattr(oracle, "reason", lambda why=why: why)
        assert cli.main(["difftest", "--against", "vllm", "--quiet"]) == 2
        err = capsys.readouterr().err
        assert err.count(oracle.INSTALL_COMMAND) == 1, err
        assert why in err


def test_demo_json_report_records_the_settings_it_ran_with(monkeypatch, tmp_path):
    seen = {}

    def fake_serve(config, requests, *, strict, progress_stream, compile_workers, overlap, **_):
        seen["config"] = config
        report = ServeReport(requests={}, steps=0, generated_tokens=0, tokens_per_s=0.0, serving_seconds=0.0,
                             buckets=[], executables=0, compile_seconds=0.0, serving_compiles=0, nan_count=0,
                             preemptions=0, drafts_proposed=0, drafts_accepted=0, all_match=True,
                             settings=run_settings(config, strict=strict, compile_workers=compile_workers,
                                                   overlap=overlap))
        return report, None

    monkeypatch.setattr(cli, "serve", fake_serve)
    monkeypatch.setattr(cli, "print_summary", lambda report, config: None)
    out = tmp_path / "report.json"
    argv = ["demo", "--backend", "reference", "--kv-cache-dtype", "fp8", "--poison", "--seed", "7",
            "--requests", "2", "--max-new-requests-per-step", "3", "--json", str(out), "--quiet"]
    assert cli.main(argv) == 0
    s = json.loads(out.read_text())["settings"]
    assert (s["backend"], s["kv_cache_dtype"], s["poison"], s["seed"]) == ("reference", "fp8", True, 7)
    assert s["token_sizes"] == [4, 16, 32] and s["max_model_len"] == 96 and s["strict"] is True
    assert s["model"]["config"]["layer_types"] == ["attn", "mamba", "attn", "mamba"]
    assert s["platform"] == "cpu" and s["jax_version"] and s["workload"] == "generated: 2 requests, seed 7"
    assert seen["config"].seed == 7 and seen["config"].max_new_requests_per_step == 3
    assert s["max_new_requests_per_step"] == 3


def test_run_settings_records_every_config_field_and_anything_else_as_text():
    config = RunnerConfig(backend="pallas", poison=True)
    s = run_settings(config, strict=False, mesh=object())
    for field in ("backend", "poison", "seed", "kv_cache_dtype", "block_size", "num_blocks", "max_model_len"):
        assert s[field] == getattr(config, field)
    assert s["strict"] is False and isinstance(s["mesh"], str)
    json.dumps(s)


def test_difftest_progress_into_a_log_has_no_carriage_return_and_json_has_its_settings(capsys, tmp_path):
    out = tmp_path / "diff.json"
    argv = ["difftest", "--ops", "combine_sampled_and_draft_tokens", "--cases", "0", "--backend", "reference",
            "--seed", "3", "--json", str(out)]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err  # not a terminal
    assert "\r" not in err and err.rstrip().endswith("scenarios  done")
    config = json.loads(out.read_text())["config"]
    assert config["backend"] == "reference" and config["seed"] == 3 and config["against"] == ["torch"]
    assert config["platform"] == "cpu" and config["jax_version"] and config["kvjax_kernels"] == "reference"


def test_the_parity_check_pads_to_the_request_not_to_max_model_len():
    """--max-model-len 100000 once shaped every dense-reference call [100000] (24 GB)."""
    config = RunnerConfig(max_model_len=100_000)
    shapes = []

    class FakeRunner:
        @staticmethod
        def dense_reference(tokens):
            shapes.append(tokens.shape)
            return np.zeros((tokens.shape[0], config.model.vocab_size), np.float32)

    done = Request("a", [1, 2, 3], 2)
    done.output, done.logits = [0, 0], [np.zeros(config.model.vocab_size, np.float32)] * 2
    results, nan_count = check_against_reference(FakeRunner(), config, [done])
    assert shapes == [(16,)] and nan_count == 0 and results["a"]["matches_reference"]


def test_version_prints_the_package_version(capsys):
    import kvjax

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvjax {kvjax.__version__}"


@pytest.mark.parametrize("mesh, fragment", [
    ("data=3", "moe_num_experts=8 must be a multiple of the data axis size 3"),
    ("model=3", "model=3 must divide num_kv_heads=2"),
    ("data=0", "mesh axis 'data' needs a positive int, got 0"),
    ("model=-2", "mesh axis 'model' needs a positive int, got -2"),
    ("data=two", "mesh axis 'data' needs a positive int, got 'two'"),
    ("data", "mesh must look like 'data=D,model=M', got 'data'"),
    ("pipe=2", "mesh must look like 'data=D,model=M', got 'pipe=2'"),
    ("data=2;model=2", "needs a positive int"),
])
def test_an_invalid_mesh_is_a_one_line_usage_error_before_anything_starts(mesh, fragment, monkeypatch, capsys):
    # Issue 25 item 7: --mesh data=3 / model=3 printed a traceback and exited 1.
    monkeypatch.setattr(cli, "serve", _refuse_to_serve)
    monkeypatch.setattr(cli.demo_cli, "start_devices", _refuse_to_serve)  # nor the devices
    monkeypatch.setattr(cli, "make_mesh", _refuse_to_serve)
    code, err = _exit_code(["demo", "--mesh", mesh], capsys)
    assert code == 2, err
    assert fragment in err and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("python -m kvjax")][0]  # argparse usage
    assert len([line for line in err.splitlines() if "error" in line]) == 1, err


def test_quiet_prints_nothing_but_the_summary(monkeypatch, capsys):
    # Issue 25 item 7: --quiet still printed the memory line.
    seen = {}

    def fake_serve(config, requests, *, mesh, strict, progress_stream, compile_workers, overlap, **_):
        seen["progress_stream"] = progress_stream
        raise SystemExit(0)  # stop before the summary: only what came before is checked

    monkeypatch.setattr(cli, "serve", fake_serve)
    with pytest.raises(SystemExit):
        cli.main(["demo", "--quiet", "--requests", "2"])
    assert seen["progress_stream"] is None
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit):
        cli.main(["demo", "--requests", "2"])
    assert "estimated memory" in capsys.readouterr().err  # and without --quiet it is there


def _check_one(ref_row: np.ndarray, served_row: np.ndarray, token: int, temperature: float = 0.0) -> dict:
    """check_against_reference of one request whose one output row is ``served_row`` / ``token``,
    against a dense reference whose row is ``ref_row``."""
    config = RunnerConfig()
    V = config.model.vocab_size

    class FakeRunner:
        @staticmethod
        def dense_reference(tokens):
            out = np.zeros((tokens.shape[0], V), np.float32)
            out[2] = ref_row  # the row before the output token (prompt of 3)
            return out

    done = Request("a", [1, 2, 3], 1, temperature=temperature, seed=1)
    done.output, done.logits = [token], [served_row.astype(np.float32)]
    results, _ = check_against_reference(FakeRunner(), config, [done])
    return results["a"]


def test_a_greedy_near_tie_matches_only_within_twice_the_rows_logits_error():
    """A greedy flip between two logits closer than twice the served row's error is a near tie
    (bf16 serving: tokens flipped on one of six requests with logits within 0.015); the same flip
    with exact logits, or a token far below the max, is a mismatch."""
    V = RunnerConfig().model.vocab_size
    ref = np.linspace(0.0, 0.5, V, dtype=np.float32)
    ref[5], ref[7] = 1.0, 1.0 - 4e-5
    served = ref.copy()
    served[5], served[7] = 1.0 - 4e-5, 1.0  # every logit within 4e-5 <= atol, argmax flipped to 7
    flip = _check_one(ref, served, 7)
    assert flip["matches_reference"] and flip["near_tie_rows"] == 1, flip
    assert _check_one(ref, served, 5)["matches_reference"]  # the reference's own argmax
    exact = _check_one(ref, ref, 7)  # logits exact: nothing can have flipped the argmax
    assert not exact["matches_reference"] and exact["near_tie_rows"] == 0, exact
    far = _check_one(ref, served, 0)  # 1.0 below the max
    assert not far["matches_reference"], far
    assert _tokens_note(SimpleNamespace(requests={"a": flip, "b": exact})) == "tokens identical but 1 greedy near ties"
    assert _tokens_note(SimpleNamespace(requests={"b": exact})) == "tokens identical"
