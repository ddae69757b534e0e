"""``python -m kvjax demo --mesh data=D,model=M``: the serving demo over a device mesh.

Each data rank has its own scheduler and block pool; requests are placed on
arrival on the least loaded rank (:func:`kvjax.host.placement.least_loaded`).
Every step, the ranks agree on whether anyone has work and on the bucket (the
largest any rank needs), then run one SPMD step in which ranks with nothing
scheduled run the dummy step. The report counts, per rank, real and dummy
steps, and (when checked) every step's null-block / idle-rank flags.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections import deque

import jax

from kvjax.cli.demo import ServeReport, print_summary, run_settings, serve_report_fields
from kvjax.testing.progress import Progress
from kvjax.host.placement import least_loaded
from kvjax.host.scheduler import Request
from kvjax.models import TinyHybridConfig
from kvjax.runner.mesh import DATA, MODEL, MeshRunner, MeshStepResult, force_host_device_count, make_mesh, parse_mesh_shape
from kvjax.runner.runner import RunnerConfig

__all__ = ["MESH_MODEL", "MeshServeReport", "main", "parse_mesh_shape", "print_mesh_summary", "serve_mesh",
           "start_devices"]

# The demo model over a mesh: attention, Mamba2, and an MoE block of 8 experts (top-2)
# whose experts are sharded over "data", so every step needs every data rank.
MESH_MODEL = TinyHybridConfig(layer_types=("attn", "mamba", "moe"))


@dataclasses.dataclass
class MeshServeReport(ServeReport):
    """:class:`ServeReport` plus the mesh, per-rank step counts and check results.

    ``ranks[d]``: ``real_steps`` (the rank had work), ``dummy_steps`` (it ran the
    dummy step because another rank had work), ``requests`` (ids placed on it).
    ``check_failures``: one entry per (step, rank, flag) that failed.
    """

    mesh: dict = dataclasses.field(default_factory=dict)
    process_index: int = 0
    ranks: dict = dataclasses.field(default_factory=dict)
    checked: bool = False
    check_failures: list = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (self.all_match and self.nan_count == 0 and self.serving_compiles == 0
                and not self.check_failures)


def serve_mesh(config: RunnerConfig, mesh, requests: list[Request], *, strict: bool = True,
               progress_stream=sys.stderr, runner: MeshRunner | None = None, compile_workers: int = 2,
               check: bool | None = None) -> tuple[MeshServeReport, MeshRunner]:
    """Serve ``requests`` (every process passes the same list) over ``mesh``; returns this process's report."""
    runner = runner or MeshRunner(config, mesh, strict=strict, check=check)
    runner.precompile(workers=compile_workers)
    failures = []

    def record(step, res: MeshStepResult, plans):
        for d in runner.local_ranks:
            for name, value in res.flags.get(d, {}).items():
                expected = (plans.get(d) is None) if name == "idle" else True
                if value != expected:
                    failures.append({"step": step, "rank": d, "flag": name, "value": value})

    for res in runner.warm_up():  # checked too: the first dummy step meets the initial memory
        record("warm-up", res, {})
    D = runner.num_ranks
    buckets = list(config.bucket_spec.buckets)
    scheds = {d: config.make_scheduler() for d in runner.local_ranks}
    pending = deque(sorted(requests, key=lambda r: r.arrival_step))
    placed = {d: [] for d in range(D)}
    real, dummy = [0] * D, [0] * D
    bar = Progress(len(requests), progress_stream, unit="requests finished")
    step = steps_run = 0
    t0 = time.perf_counter()
    while True:
        g = runner.agree({d: (len(s.waiting) + len(s.running), int(s.has_work)) for d, s in scheds.items()})
        loads = [int(x) for x in g[:, 0]]
        if not pending and not g[:, 1].any():
            break
        while pending and pending[0].arrival_step <= step:
            req = pending.popleft()
            d = least_loaded(loads)
            loads[d] += 1
            placed[d].append(req.req_id)
            if d in scheds:
                scheds[d].add_request(req)
        plans = {}
        for d, s in scheds.items():
            s.step_count = step  # the mesh drives every rank's clock
            plans[d] = s.schedule()
        g = runner.agree({d: (-1 if p is None else buckets.index(p.bucket), 0) for d, p in plans.items()})
        b = int(g[:, 0].max())
        step += 1
        if b < 0:  # nobody has anything to run yet
            continue
        res = runner.execute_ranks(plans, buckets[b])
        steps_run += 1
        for d, plan in plans.items():
            if plan is None:
                dummy[d] += 1
            else:
                real[d] += 1
                out = res.outputs[d]
                scheds[d].update(plan, out.sampled, out.num_sampled, out.logits)
        record(step - 1, res, plans)
        bar.update(sum(len(s.finished) for s in scheds.values()), f"step {steps_run}")
    serving = time.perf_counter() - t0
    bar.close()
    report = MeshServeReport(
        **serve_report_fields(runner, config, list(scheds.values()), steps=steps_run, serving=serving,
                              buckets=buckets),
        settings=run_settings(config, strict=runner.guard.strict, compile_workers=compile_workers,
                              mesh=f"data={D},model={runner.mesh.shape[MODEL]}",
                              processes=jax.process_count()),
        mesh={DATA: D, MODEL: runner.mesh.shape[MODEL]},
        process_index=jax.process_index(),
        ranks={d: {"real_steps": real[d], "dummy_steps": dummy[d], "requests": placed[d]}
               for d in runner.local_ranks},
        checked=runner.check,
        check_failures=failures,
    )
    return report, runner


def print_mesh_summary(report: MeshServeReport, config: RunnerConfig, out=sys.stdout) -> None:
    print_summary(report, config, out)
    m = report.mesh
    lines = [f"mesh                    data={m[DATA]}, model={m[MODEL]} (process {report.process_index})"]
    for d, r in sorted(report.ranks.items()):
        lines.append(f"rank {d:<3}                real steps {r['real_steps']}, dummy steps {r['dummy_steps']}, "
                     f"requests {len(r['requests'])}")
    if report.checked:
        verdict = "ok" if not report.check_failures else f"{len(report.check_failures)} FAILED"
        lines.append(f"null block/slot + idle  {verdict} (bitwise, every rank, every step)")
    print("\n".join(lines), file=out)


def start_devices(args, mesh_shape: tuple[int, int]) -> bool:
    """Before JAX starts its backends: the host device count and ``jax.distributed``.

    Returns whether ``XLA_FLAGS`` was changed (a CPU-only machine then gets the devices).
    Raises ValueError for an impossible process layout.
    """
    D, M = mesh_shape
    nproc = args.num_processes
    if not 0 <= args.process_id < nproc:
        raise ValueError(f"--process-id must be in [0, {nproc}) with --num-processes {nproc}")
    if D % nproc:
        raise ValueError(f"--mesh data={D},model={M} must give each of the {nproc} processes whole data ranks")
    if nproc > 1 and not args.coordinator:
        raise ValueError("--num-processes > 1 needs --coordinator HOST:PORT")
    local_devices = D * M // nproc
    forced = local_devices > 1 and force_host_device_count(local_devices)
    if args.coordinator:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, num_processes=nproc, process_id=args.process_id)
    return forced


def main(args, config: RunnerConfig, requests: list[Request], mesh_shape: tuple[int, int],
         forced_devices: bool) -> int:
    """The ``demo --mesh`` command after :func:`start_devices`; exit status."""
    D, M = mesh_shape
    if forced_devices and jax.default_backend() == "cpu":
        print(f"CPU-only machine: set XLA_FLAGS=--xla_force_host_platform_device_count={D * M // jax.process_count()} "
              f"for --mesh data={D},model={M}", file=sys.stderr)
    try:
        mesh = make_mesh(D, M)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"serving {len(requests)} requests on the tiny hybrid model "
          f"({len(config.model.layer_types)} layers: {', '.join(config.model.layer_types)}) "
          f"over mesh data={D}, model={M} (process {jax.process_index()} of {jax.process_count()})",
          file=sys.stderr)
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    report, _ = serve_mesh(config, mesh, requests, strict=not args.no_strict,
                           progress_stream=None if args.quiet else sys.stderr,
                           compile_workers=max(1, args.compile_workers))
    print_mesh_summary(report, config)
    if args.json:
        report.settings["workload"] = args.workload or f"generated: {args.requests} requests, seed {args.seed}"
        path = args.json if jax.process_count() == 1 else f"{args.json}.{jax.process_index()}"
        with open(path, "w") as f:
            json.dump(report.to_json(), f, indent=1)
    return 0 if report.ok else 1
