"""Mesh cases run in a fresh process (XLA_FLAGS must be set before JAX starts).

Usage: ``python tests/mesh/mesh_worker.py CASE [CASE ...]``, a case being
``DxM`` (serve the workload over that mesh; suffixes ``_overlap``, ``_fp8``,
``_spec``, ``_rpa`` switch those features on), ``single`` (one device) or a
planted bug on a 2x1 mesh: ``planted`` (dummy steps get an all-zero slot mapping,
as in vLLM PR 39444), ``planted_stale`` (dummy steps re-send the rank's previous
inputs), ``planted_nozero`` (every rank's fresh blocks and slots are passed to
``zero_blocks`` as -1), or ``tpu_DxM`` (export every bucket's sharded step for TPU
over that mesh, Mosaic kernels inside; nothing runs). Prints one JSON line per case.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import sys

from kvjax.testing.fast_compile import FAST_COMPILER_OPTIONS, with_fast_xla_flags

# 8 host devices, and every compile of this process at kvjax.testing.fast_compile's settings (the
# dense oracle and the sanitizer's checks too, not only the runners given FAST_COMPILE). Read
# when JAX creates its CPU client, after this.
os.environ["XLA_FLAGS"] = with_fast_xla_flags("--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import dataclasses  # noqa: E402

import numpy as np  # noqa: E402

from kvjax.cli.demo import MESH_MODEL, serve  # noqa: E402
from kvjax.cli.workload import validate_workload  # noqa: E402
from kvjax.runner import Runner, RunnerConfig  # noqa: E402
from kvjax.runner.mesh import make_mesh  # noqa: E402
from kvjax.runner.sanitizer import SanitizerError  # noqa: E402
from kvjax.state.block_tables import BlockTables  # noqa: E402
from pallas_kernels import tpu_target  # noqa: E402

FAST_COMPILE = FAST_COMPILER_OPTIONS
# One compile thread: the suite's two xdist workers already keep both cores busy, and two threads
# compiling a runner's two step programs cost ~20% more CPU time (a mesh case: ~12.5 -> ~10.5 s).
COMPILE_WORKERS = 1


def config(token_sizes=(16,), backend="auto") -> RunnerConfig:
    return RunnerConfig(model=MESH_MODEL, block_size=8, num_blocks=24, max_model_len=48, max_num_seqs=4,
                        max_num_batched_tokens=max(token_sizes), token_sizes=token_sizes, poison=True,
                        backend=backend)


# Staggered arrivals and lengths: ranks go idle at different times.
WORKLOAD = json.loads(pathlib.Path(__file__).with_name("workload.json").read_text())


def requests():
    return validate_workload(WORKLOAD, vocab_size=256, max_model_len=48)


@contextlib.contextmanager
def patched(owner, name, make):
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def plant_zero_dummy_slot_mapping():
    """The PR 39444 bug: a step with no real row maps every token to slot 0 instead of PAD."""

    def make(original):
        def planted(self, idx_mapping, query_start_loc, positions, num_tokens_padded):
            slots = original(self, idx_mapping, query_start_loc, positions, num_tokens_padded)
            return jnp.where(jnp.all(idx_mapping < 0), 0, slots)
        return planted

    return patched(BlockTables, "slot_mappings", make)


def plant_stale_dummy_inputs():
    """A dummy step that re-sends the rank's previous step inputs (a staging buffer not reset)."""
    last = {}

    def make(original):
        def planted(self, plans, bucket=None):
            if not isinstance(plans, dict):  # warm-up and release steps
                return original(self, plans, bucket)
            stale = {d: p if p is not None else last.get(d) for d, p in plans.items()}
            last.update({d: p for d, p in plans.items() if p is not None})
            return original(self, stale, bucket)
        return planted

    return patched(Runner, "prepare", make)


def plant_no_zeroing():
    """The mesh hands ``zero_blocks`` all -1 ids: fresh blocks and slots keep what they held."""

    def make(original):
        def planted(self, plan, bucket=None, rank=None):
            inp = original(self, plan, bucket, rank)
            return inp.replace(zero_blocks=np.full_like(inp.zero_blocks, -1),
                               zero_slots=np.full_like(inp.zero_slots, -1))
        return planted

    return patched(Runner, "pack", make)


PLANTS = {"planted": plant_zero_dummy_slot_mapping, "planted_stale": plant_stale_dummy_inputs,
          "planted_nozero": plant_no_zeroing}
# Plants on the host side (packing, preparing): they can reuse a compiled runner.
HOST_PLANTS = ("planted_stale", "planted_nozero")
# Features of the serving loop only (no setting of the RunnerConfig): a case of a mesh, overlapped,
# reuses the runner an earlier case compiled for that mesh and config (the compiled step is the same).
LOOP_FEATURES = {"overlap"}
_RUNNERS: dict = {}


def _runner(cfg, D: int, M: int, *, reuse: bool) -> Runner:
    """A runner for ``cfg`` on a D x M mesh; ``reuse``: the one an earlier case compiled, reset
    (its device state and sanitizer mirrors back to the start)."""
    key = (cfg, D, M)
    if reuse and key in _RUNNERS:
        runner = _RUNNERS[key]
        runner.reset()
        return runner
    runner = Runner(cfg, mesh=make_mesh(D, M), compiler_options=FAST_COMPILE)
    _RUNNERS[key] = runner
    _share_dense_reference(runner)
    return runner


_ORACLES: dict = {}


def _share_dense_reference(runner: Runner) -> None:
    """The dense oracle does not depend on the mesh, the layout or the loop (``Runner.dense_reference``:
    the model's dense_logits of the unsharded params, in the cache's dtype and the matmul precision):
    runners that agree on those share the first one's, compiled once per length, not once per case."""
    c = runner.config
    key = (c.model, c.kv_cache_dtype, c.matmul_precision)
    if key not in _ORACLES:
        _ORACLES[key] = runner
        return
    first = _ORACLES[key]
    same = jax.tree.map(lambda a, b: a.shape == b.shape and bool(np.array_equal(a, b)),
                        first.dense_params, runner.dense_params)
    assert jax.tree.structure(first.dense_params) == jax.tree.structure(runner.dense_params)
    assert all(jax.tree.leaves(same)), "runners of one model must have the same dense params"
    runner.__dict__["dense_reference"] = first.dense_reference


def lower_for_tpu(D: int, M: int) -> list[dict]:
    """Export every bucket's sharded step (TPU kernels, ``backend="pallas_tpu"``) for TPU over a
    ``D x M`` mesh of host devices; per bucket, what the exported module holds."""
    cfg = config((8, 16), backend="pallas_tpu")
    runner = Runner(cfg, mesh=make_mesh(D, M))
    num_state_leaves = len(jax.tree.leaves(runner._rows)) + len(runner.pool_specs)  # rows' arrays, every pool
    found = []
    for bucket in runner.buckets.buckets:
        fn, args, _ = runner.jitted_step(bucket)
        avals = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), args)
        with jax.default_matmul_precision(cfg.matmul_precision):
            exported = tpu_target.export(fn, *avals)
        text = exported.mlir_module()
        found.append({
            "bucket": [bucket.num_tokens, bucket.num_reqs, bucket.num_logits],
            "platforms": list(exported.platforms), "nr_devices": exported.nr_devices,
            "tpu_custom_calls": text.count("stablehlo.custom_call @tpu_custom_call"),
            "kernel_names": sorted(set(re.findall(r'kernel_name = "([^"]*)"', text))),
            "aliased_outputs": text.count("tf.aliasing_output"), "state_leaves": num_state_leaves,
            "host_callbacks": text.count("callback"),
            "collectives": sorted({c for c in ("all_gather", "reduce_scatter", "all_reduce")
                                   if f"stablehlo.{c}" in text}),
        })
    return found


def run(case: str) -> dict:
    if case.startswith("tpu_"):
        D, M = (int(x) for x in case[4:].split("x"))
        return {"case": case, "buckets": lower_for_tpu(D, M)}
    name, *features = case.split("_")
    plant = PLANTS.get(case)
    D, M = (2, 1) if plant else (1, 1) if name == "single" else (int(x) for x in name.split("x"))
    cfg = config((8, 16) if D == 4 else (16,))
    cfg = dataclasses.replace(cfg, kv_cache_dtype="fp8" if "fp8" in features else "auto",
                              num_speculative_tokens=2 if "spec" in features else 0,
                              kv_layout="rpa" if "rpa" in features else "flash")
    out = {"case": case}
    runner = _runner(cfg, D, M, reuse=case in HOST_PLANTS or (bool(features) and set(features) <= LOOP_FEATURES))
    with plant() if plant else contextlib.nullcontext():
        try:
            report, _ = serve(cfg, requests(), mesh=runner.mesh, progress_stream=None,
                              overlap="overlap" in features, runner=runner, compile_workers=COMPILE_WORKERS)
        except SanitizerError as e:
            return {**out, "ok": False, "error": {"step": e.step, "invariant": e.invariant, "array": e.array,
                                                  "rank": e.rank}}
    return {**out, "outputs": {k: v["output"] for k, v in report.requests.items()},
            "all_match": report.all_match, "nan_count": report.nan_count,
            "serving_compiles": report.serving_compiles, "ranks": report.ranks,
            "checked": report.checked, "ok": report.ok}


if __name__ == "__main__":
    for case in sys.argv[1:]:
        print(json.dumps(run(case)), flush=True)
