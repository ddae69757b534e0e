"""Issue 25: ``python -m kvjax demo`` never ends in a traceback for options a user can type.

Two properties:

* Hypothesis draws option sets (valid and invalid values, numbers at and past their edges,
  contradictory combinations); each run must either be refused with exit status 2 and a one-line
  ``error:`` / usage message, or get as far as compiling (where that test stops it: cheap, so it
  covers many option sets).
* A deterministic, seeded sample of valid-looking option sets of small sizes (block size, blocks,
  model length, rows, admissions per step, token budget and bucket sizes, KV layout and dtype,
  ``--overlap``, ``--poison``, speculative tokens, ``--ignore-eos``, a one-device ``--mesh``) is
  served to the end: each must exit 0 (every request at parity with the dense reference, no NaN,
  no serving-time compile) or be refused before anything compiles (exit 2, a one-line error);
  a ValueError while serving is a bug, never an exit-2 usage error. Steps compile at XLA optimisation
  level 0 (the CPU compile is most of the time; results are checked against the reference
  either way). A mesh of several devices needs XLA_FLAGS before JAX starts, so in this process
  it can only be refused; tests/mesh serves meshes in subprocesses.
"""

import os
import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import kvjax.runner
from kvjax.cli import main as cli
from kvjax.testing.fast_compile import FAST_COMPILER_OPTIONS


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


FAST = FAST_COMPILER_OPTIONS  # kvjax.testing.fast_compile (also in XLA_FLAGS, tests/conftest.py)


#: Features of the sample's option sets, by ``seed % 4``: KV layout, KV dtype, draft tokens, bucket
#: sizes, flags. Four consecutive seeds cover each layout and dtype, --overlap, --poison, one and
#: two draft tokens, two buckets, --ignore-eos and a one-device --mesh; the sizes are random. One
#: bucket (one step executable) where two are not the point, and --poison (which doubles a step's
#: compile) once: the four take about a minute on one core.
FEATURES = [
    ("flash", "fp8", 0, 1, ["--overlap", "--poison"]),
    ("rpa", "auto", 1, 1, ["--ignore-eos", "--mesh", "data=1,model=1"]),
    ("flash", "auto", 2, 2, []),
    ("rpa", "fp8", 0, 1, ["--overlap"]),
]
#: How many option sets are served (KVJAX_CLI_SERVING_SAMPLES raises it for a longer search).
SAMPLES = int(os.environ.get("KVJAX_CLI_SERVING_SAMPLES", "4"))


def serving_options(seed: int) -> list[str]:
    """A valid-looking ``demo`` command line of small sizes, drawn from ``seed`` (features by
    :data:`FEATURES`)."""
    rng = random.Random(seed)
    layout, dtype, k, buckets, flags = FEATURES[seed % len(FEATURES)]
    bs = rng.choice([1, 2, 3, 4, 8])
    mml = rng.choice([8, 12, 16, 24, 32])
    need = -(-mml // bs) + 1  # blocks one request of max_model_len needs, plus the null block
    budget = rng.choice([2, 4, 8, 16]) + k
    sizes = {budget} if buckets == 1 else {rng.randint(1 + k, budget - 1), budget}
    argv = ["demo", "--quiet", "--block-size", bs, "--max-model-len", mml,
            "--num-blocks", rng.choice([need, need + 1, 2 * need]),
            "--max-num-seqs", rng.choice([1, 2, 3, 4]), "--max-new-requests-per-step", rng.choice([1, 2, 8]),
            "--max-num-batched-tokens", budget, "--token-sizes", ",".join(map(str, sorted(sizes))),
            "--num-spec-tokens", k, "--requests", rng.choice([1, 2, 3]), "--seed", rng.randrange(100),
            "--kv-layout", layout, "--kv-cache-dtype", dtype]
    return [str(a) for a in argv + flags]


@pytest.mark.parametrize("seed", range(SAMPLES))
def test_valid_looking_options_serve_to_completion_or_are_refused(seed, monkeypatch, capsys):
    compiled = []

    class FastRunner(kvjax.runner.Runner):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("compiler_options", FAST)
            super().__init__(*args, **kwargs)

        def precompile(self, *args, **kwargs):
            compiled.append(True)
            # one compile thread (the CLI's default is two): the suite's two xdist workers keep
            # both cores busy, and two threads cost ~20% more CPU time for the same programs
            return super().precompile(*args, **{**kwargs, "workers": 1})

    monkeypatch.setattr(cli.demo_cli, "Runner", FastRunner)
    monkeypatch.setattr(cli.demo_cli, "start_devices", lambda args, shape: False)
    argv = serving_options(seed)
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse usage errors
        code = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err, (argv, err[-3000:])
    if code == 2 and not compiled:  # refusals come before anything compiles
        lines = [ln for ln in err.splitlines() if "error" in ln]
        assert len(lines) == 1, (argv, err[-2000:])
        return
    assert code == 0, (argv, code, out[-2000:], err[-2000:])
    assert "serving-time compiles   0" in out and "NaN count               0" in out, (argv, out)
