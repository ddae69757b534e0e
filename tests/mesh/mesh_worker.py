"""Mesh cases run in a fresh process (XLA_FLAGS must be set before JAX starts).

Usage: ``python tests/mesh/mesh_worker.py CASE [CASE ...]``, a case being
``DxM`` (serve the workload over that mesh), ``single`` (the plain single-device
runner) or ``planted`` (a 2x1 run whose dummy steps get an all-zero slot
mapping, as in vLLM PR 39444) or ``planted_stale`` (a 2x1 run whose dummy steps
re-send the rank's previous inputs). Prints one JSON line per case.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp  # noqa: E402

from kvjax.cli.demo import serve  # noqa: E402
from kvjax.cli.mesh_demo import MESH_MODEL, serve_mesh  # noqa: E402
from kvjax.cli.workload import validate_workload  # noqa: E402
from kvjax.runner import Runner, RunnerConfig  # noqa: E402
from kvjax.runner.mesh import MeshRunner, make_mesh  # noqa: E402
from kvjax.state.block_tables import BlockTables  # noqa: E402

FAST_COMPILE = {"xla_backend_optimization_level": 0}


def config(token_sizes=(16,)) -> RunnerConfig:
    return RunnerConfig(model=MESH_MODEL, block_size=8, num_blocks=24, max_model_len=48, max_num_seqs=4,
                        max_num_batched_tokens=max(token_sizes), token_sizes=token_sizes, poison=True)


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
        def planted(self, plans, bucket):
            stale = {d: p if p is not None else last.get(d) for d, p in plans.items()}
            last.update({d: p for d, p in plans.items() if p is not None})
            return original(self, stale, bucket)
        return planted

    return patched(MeshRunner, "execute_ranks", make)


def run(case: str) -> dict:
    if case == "single":
        cfg = config()
        report, _ = serve(cfg, requests(), progress_stream=None,
                          runner=Runner(cfg, compiler_options=FAST_COMPILE))
        return {"case": case, "outputs": {k: v["output"] for k, v in report.requests.items()},
                "all_match": report.all_match, "nan_count": report.nan_count,
                "serving_compiles": report.serving_compiles}
    plant = {"planted": plant_zero_dummy_slot_mapping, "planted_stale": plant_stale_dummy_inputs}.get(case)
    D, M = (2, 1) if plant else (int(x) for x in case.split("x"))
    cfg = config((8, 16) if D == 4 else (16,))
    mesh = make_mesh(D, M)
    with plant() if plant else contextlib.nullcontext():
        report, _ = serve_mesh(cfg, mesh, requests(), progress_stream=None,
                               runner=MeshRunner(cfg, mesh, compiler_options=FAST_COMPILE))
    return {"case": case, "outputs": {k: v["output"] for k, v in report.requests.items()},
            "all_match": report.all_match, "nan_count": report.nan_count,
            "serving_compiles": report.serving_compiles, "ranks": report.ranks,
            "checked": report.checked, "check_failures": report.check_failures, "ok": report.ok}


if __name__ == "__main__":
    for case in sys.argv[1:]:
        print(json.dumps(run(case)), flush=True)
