"""Issue 25: ``python -m kvjax demo`` never ends in a traceback for options a user can type.

Hypothesis draws option sets (valid and invalid values, numbers at and past their edges,
contradictory combinations); each run must either be refused with exit status 2 and a one-line
``error:`` / usage message, or get as far as compiling (where this test stops it: compiling and
serving are covered by the serving tests)."""

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import kvjax.runner
from kvjax.cli import main as cli


class _ReachedCompile(Exception):
    pass


INTS = st.one_of(st.integers(-3, 3), st.integers(4, 300), st.sampled_from(["x", "", "1.5", "2**40"]))
OPTIONS = {
    "--requests": INTS, "--num-blocks": INTS, "--block-size": INTS, "--max-num-seqs": INTS,
    "--max-new-requests-per-step": INTS, "--max-num-batched-tokens": INTS, "--max-model-len": INTS,
    "--num-spec-tokens": INTS, "--seed": INTS,
    "--token-sizes": st.sampled_from(["4,16,32", "1", "16,4", "0,8", "8,,16", "a", "4,16,100000"]),
    "--kv-cache-dtype": st.sampled_from(["auto", "fp8", "int8"]),
    "--kv-layout": st.sampled_from(["flash", "rpa", "paged"]),
    "--backend": st.sampled_from(["auto", "reference", "pallas", "pallas_gpu", "cuda"]),
    "--mesh": st.sampled_from(["data=2", "model=2", "data=3", "data=2,model=2", "data=0", "pipe=2", ""]),
    "--check": st.sampled_from(["reference", "transformers", "vllm"]),
    "--dtype": st.sampled_from(["float32", "bfloat16", "fp16"]),
    "--workload": st.sampled_from(["/nonexistent.json"]),
    "--model": st.sampled_from(["/nonexistent-dir"]),
}
FLAGS = ["--poison", "--overlap", "--no-strict", "--ignore-eos"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(opts=st.dictionaries(st.sampled_from(sorted(OPTIONS)), st.just(None), max_size=5).flatmap(
           lambda keys: st.fixed_dictionaries({k: OPTIONS[k] for k in keys})),
       flags=st.lists(st.sampled_from(FLAGS), unique=True, max_size=3))
def test_demo_options_end_in_a_clean_refusal_or_a_compile(opts, flags, monkeypatch, capsys):
    def reached(*a, **k):
        raise _ReachedCompile

    monkeypatch.setattr(kvjax.runner.Runner, "precompile", reached)
    monkeypatch.setattr(cli.demo_cli, "start_devices", lambda args, shape: False)  # no XLA_FLAGS here
    argv = ["demo", "--quiet"] + [x for k, v in opts.items() for x in (k, str(v))] + flags
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse usage errors
        code = e.code
    except _ReachedCompile:
        return
    err = capsys.readouterr().err
    assert code == 2, (argv, code, err[-2000:])
    assert "Traceback" not in err and "error" in err, (argv, err[-2000:])
