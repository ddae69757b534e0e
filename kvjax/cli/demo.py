"""``python -m kvjax demo``: serve a seeded workload on the tiny hybrid model, on one device or a mesh.

Start-up compiles every bucket ahead of time; serving then runs the schedulers
and the runner step by step with no compile (strict mode), and the run ends
with each request checked against the dense reference (one request, no cache,
no padding, full recompute): the reference's tokens (a greedy one may differ from its argmax
only by a near tie within twice that position's logits error) and logits within
``LOGITS_ATOL`` (a bf16 model: ``LOGITS_ATOL_BF16``) at every generated position (with an fp8
KV cache: of the reference or of one that rounds K/V near an fp8 rounding boundary the other
way, :mod:`kvjax.testing.fp8_rounding`; with a bf16 model whose router has a choice bias: or of
one whose router chooses otherwise at a near-tie, :mod:`kvjax.testing.routing_variants`).

With ``--mesh data=D,model=M`` each data rank has its own scheduler and block
pool; requests are placed on arrival on the least loaded rank, ranks with
nothing scheduled run the dummy step in the same SPMD program
(:mod:`kvjax.runner.serving`), and the report counts each rank's real and dummy
steps. The mesh model gains an MoE block whose experts are sharded over "data".
"""

from __future__ import annotations

import dataclasses
import sys
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.testing.asserts import greedy_match
from kvjax.testing.fp8_rounding import RoundingVariants
from kvjax.testing.routing_variants import RoutingVariants
from kvjax.testing.progress import Progress
from kvjax.models import TinyHybridConfig
from kvjax.runner import Runner, RunnerConfig
from kvjax.runner.mesh import DATA, MODEL, force_host_device_count
from kvjax.runner.sampling import sample_rows
from kvjax.runner.serving import check_same_everywhere, run_to_completion
from kvjax.runner.memory import dense_reference_length
from kvjax.host.scheduler import Request

# The demo model over a mesh: attention, Mamba2, and an MoE block of 8 experts (top-2)
# whose experts are sharded over "data", so every step needs every data rank.
MESH_MODEL = TinyHybridConfig(layer_types=("attn", "mamba", "moe"))

LOGITS_ATOL = 1e-4
# fp8 caches use the same tolerance: a paged row may instead match a reference variant that rounds
# the K/V elements within a few float32 ulps of an fp8 rounding boundary the other way (one such
# flip moves logits by up to ~0.1 on the tiny model, so no fixed tolerance covers it without
# hiding bugs; see kvjax.testing.fp8_rounding).


# bfloat16 weights and activations: the paged path and the reference round products in a
# different order (about 2**-8 relative each); 0.034 seen on an H100 for a tiny Granite.
LOGITS_ATOL_BF16 = 0.1


def model_dtype(model) -> str:
    """The dtype a model computes in: its config's ``dtype`` (float32 when it has none)."""
    cfg = getattr(model, "config", None)
    return str(getattr(model, "dtype", None) or getattr(cfg, "dtype", None) or "float32")


def logits_tolerance(kv_cache_dtype: str, dtype: str = "float32") -> float:
    """Max abs logits difference to the dense reference counted as a match (with a float32 model
    and an fp8 cache, to the reference or to one of its fp8 rounding variants)."""
    if dtype == "bfloat16":
        return LOGITS_ATOL_BF16
    return LOGITS_ATOL


def uses_routing_variants(dtype: str) -> bool:
    """Whether the parity check also tries the routing near-tie variants of the reference
    (:mod:`kvjax.testing.routing_variants`): a bfloat16 model, whose router scores the two sides
    round apart by ~1e-3 (a float32 model's by ~1e-6: no variants)."""
    return dtype == "bfloat16"


def uses_rounding_variants(kv_cache_dtype: str, dtype: str = "float32") -> bool:
    """Whether the parity check also tries the fp8 rounding variants of the reference
    (:mod:`kvjax.testing.fp8_rounding`): an fp8 cache under a float32 model (a bfloat16 model
    is checked against its own, wider tolerance)."""
    return kv_cache_dtype != "auto" and dtype != "bfloat16"


def run_settings(config: RunnerConfig, **extra) -> dict:
    """What a run was configured with, JSON-ready: every :class:`RunnerConfig` field (the model
    as a dict), the platform, the JAX version, and ``extra`` (e.g. ``strict``)."""
    def plain(v):
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        return str(v)  # e.g. a device mesh

    settings = plain(config)
    settings.update(platform=jax.default_backend(), jax_version=jax.__version__)
    settings.update({k: plain(v) for k, v in extra.items()})
    return settings


@dataclasses.dataclass
class ServeReport:
    """What :func:`serve` did: per-request results, counts and timings, and ``settings`` (:func:`run_settings`).

    ``mesh``: the mesh's axis sizes; ``ranks[d]``: this process's rank ``d``'s ``real_steps`` (it
    had work), ``dummy_steps`` (it ran the dummy step because another rank had work) and
    ``requests`` (ids placed on it); ``checked``: the sanitizer verified every step on every rank.
    """

    requests: dict
    steps: int
    generated_tokens: int
    tokens_per_s: float
    serving_seconds: float
    buckets: list
    executables: int
    compile_seconds: float
    serving_compiles: int
    nan_count: int
    preemptions: int
    drafts_proposed: int
    drafts_accepted: int
    all_match: bool
    settings: dict = dataclasses.field(default_factory=dict)
    mesh: dict = dataclasses.field(default_factory=lambda: {DATA: 1, MODEL: 1})
    process_index: int = 0
    ranks: dict = dataclasses.field(default_factory=dict)
    checked: bool = False

    @property
    def ok(self) -> bool:
        return self.all_match and self.nan_count == 0 and self.serving_compiles == 0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def serve(config: RunnerConfig, requests: list[Request], *, mesh=None, params=None, strict: bool = True,
          progress_stream=sys.stderr, runner: Runner | None = None, compile_workers: int = 2, drafter=None,
          overlap: bool = False, extra_check=None) -> tuple[ServeReport, Runner]:
    """Run ``requests`` to completion (every process passes the same list); returns this
    process's report and the runner (for inspection).

    ``mesh``: a ``("data", "model")`` mesh (None: one device); ``params``: the model's (None:
    its random init of ``config.seed``).
    ``extra_check``: ``(name, check)``: ``check(finished requests) -> {id: {..., "matches_" + name:
    bool}}``, merged into each request's result (e.g. transformers as a second oracle).
    ``drafter``: ``(tokens, k) -> drafts`` for speculative decoding (default: n-gram lookup).
    ``overlap``: plan and pack each step while the previous one runs
    (:mod:`kvjax.runner.serving`; needs ``num_speculative_tokens == 0``).
    Checked mode (``config.poison``): a memory violation on any rank raises
    :class:`~kvjax.runner.sanitizer.SanitizerError`.
    """
    runner = runner or Runner(config, mesh=mesh, params=params, strict=strict)
    check_same_everywhere(runner, requests)  # before compiling: a disagreement is refused at once
    runner.precompile(workers=compile_workers)
    runner.warm_up()
    scheds = {d: config.make_scheduler(drafter) for d in runner.local_ranks}
    bar = Progress(len(requests), progress_stream, unit="requests finished")
    t0 = time.perf_counter()

    def progress(step, plans):
        bar.update(sum(len(s.finished) for s in scheds.values()), f"step {step + 1}")

    stats = run_to_completion(scheds, runner, arrivals=requests, overlap=overlap, on_step=progress)
    serving = time.perf_counter() - t0
    bar.close()
    D, M = runner.num_ranks, runner.model_size
    fields = serve_report_fields(runner, config, list(scheds.values()), steps=stats.steps, serving=serving,
                                 buckets=config.bucket_spec.buckets)
    if extra_check is not None:
        name, check = extra_check
        extra = check([r for s in scheds.values() for r in s.finished])
        for rid, res in fields["requests"].items():
            res[name] = extra[rid]
        fields["all_match"] = fields["all_match"] and all(v[f"matches_{name}"] for v in extra.values())
    report = ServeReport(
        **fields,
        settings=run_settings(config, strict=strict, compile_workers=compile_workers, overlap=overlap,
                              mesh=f"data={D},model={M}", processes=jax.process_count()),
        mesh={DATA: D, MODEL: M},
        process_index=jax.process_index(),
        ranks={d: {"real_steps": stats.real_steps[d], "dummy_steps": stats.dummy_steps[d],
                   "requests": stats.placed[d]} for d in runner.local_ranks},
        checked=config.poison,
    )
    return report, runner


def _bucket_sizes(buckets) -> str:
    """``"4, 16, 32 tokens; decode-only 4, 16"`` from the report's bucket dicts."""
    mixed = [str(b["num_tokens"]) for b in buckets if not b.get("decode_only")]
    dec = [str(b["num_tokens"]) for b in buckets if b.get("decode_only")]
    return f"{', '.join(mixed)} tokens" + (f"; decode-only {', '.join(dec)}" if dec else "")


def serve_report_fields(runner: Runner, config: RunnerConfig, schedulers, *, steps: int,
                        serving: float, buckets) -> dict:
    """The :class:`ServeReport` fields every run reports: parity with the dense reference,
    token and step counts, speed, compiles, preemptions and drafts, summed over
    ``schedulers`` (one per local data rank)."""
    finished = [r for s in schedulers for r in s.finished]
    results, nan_count = check_against_reference(runner, config, finished)
    generated = sum(len(r.output) for r in finished)
    return dict(
        requests=results,
        steps=steps,
        generated_tokens=generated,
        tokens_per_s=generated / serving if serving > 0 else 0.0,
        serving_seconds=serving,
        buckets=[dataclasses.asdict(b) for b in buckets],
        executables=len(runner.executables),
        compile_seconds=runner.compile_seconds,
        serving_compiles=runner.guard.serving_compiles + runner.guard.serving_traces,
        nan_count=nan_count,
        preemptions=sum(s.num_preemptions for s in schedulers),
        drafts_proposed=sum(s.num_drafts_proposed for s in schedulers),
        drafts_accepted=sum(s.num_drafts_accepted for s in schedulers),
        all_match=bool(results) and all(r["matches_reference"] for r in results.values()),
    )


def reference_tokens(req: Request, ref_logits: np.ndarray) -> np.ndarray:
    """The tokens ``req``'s sampler draws from the reference's logits rows (one per output): the
    device's own sampler (:func:`kvjax.runner.sampling.sample_rows`) with the request's parameters,
    seed and positions, so a sampled request is checked token for token like a greedy one."""
    n = ref_logits.shape[0]
    if req.temperature == 0:
        return ref_logits.argmax(-1)
    full = lambda v, dt: jnp.full((n,), v, dt)  # noqa: E731
    positions = jnp.arange(len(req.prompt), len(req.prompt) + n, dtype=jnp.int32)
    return np.asarray(sample_rows(jnp.asarray(ref_logits), full(req.temperature, jnp.float32),
                                  full(req.top_k, jnp.int32), full(req.top_p, jnp.float32),
                                  full(req.seed, jnp.int32), positions))


def _tokens_match(req: Request, ref_logits: np.ndarray, out: np.ndarray,
                  row_err: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per output row ``(ok, near_tie)``: a sampled token is what the sampler draws from the
    reference's row; a greedy one is the reference's argmax or a near tie within ``2 * row_err``
    (with every logit within ``row_err`` of the reference's, the served argmax can only be such a
    token)."""
    if req.temperature == 0:
        return greedy_match(ref_logits, out, 2 * row_err)
    ok = reference_tokens(req, ref_logits) == out
    return ok, np.zeros_like(ok)


def check_against_reference(runner: Runner, config: RunnerConfig, finished: list[Request]):
    """Per request: output tokens and logits vs the dense forward of prompt + output.

    A request matches when every generated position has logits within :func:`logits_tolerance`
    and the reference's token: for a greedy position its argmax, or a near tie within twice that
    position's logits error (``near_tie_rows`` counts them). With an fp8 cache (float32 model) a
    position may instead match one of the reference's fp8 rounding variants
    (:class:`kvjax.testing.fp8_rounding.RoundingVariants`); with a bf16 model, one of its routing
    near-tie variants (:class:`kvjax.testing.routing_variants.RoutingVariants`: one expert's
    choice bias nudged; none for a model without such a router). Variants are tried only for
    requests whose rows do not all match the reference itself.
    ``max_logit_error``: the largest difference from the reference; ``fp8_rounding_rows`` /
    ``routing_tie_rows``: the positions matched by a rounding / routing variant instead,
    ``max_logit_error_vs_match`` the largest difference from whichever reference each position
    matched (as ``max_logit_error`` when none)."""
    dense = runner.dense_reference
    results, nan_count = {}, 0
    dtype = model_dtype(config.model)
    atol = logits_tolerance(config.kv_cache_dtype, dtype)
    for r in sorted(finished, key=lambda r: r.req_id):
        seq = r.prompt + r.output
        # Padded to a power of two, not to max_model_len (the oracle is quadratic in its length);
        # causal model: the zero tail does not change earlier logits.
        toks = np.zeros((dense_reference_length(len(seq), config.max_model_len),), np.int32)
        toks[: len(seq)] = seq
        rows = slice(len(r.prompt) - 1, len(seq) - 1)
        ref = np.asarray(dense(jnp.asarray(toks)))[rows]
        got = np.stack(r.logits) if r.logits else np.zeros((0, ref.shape[1]), np.float32)
        nan_count += int(np.isnan(got).sum())
        out = np.array(r.output)
        rounding_rows, routing_rows, ties, err, matched_err, ok = 0, 0, 0, float("inf"), float("inf"), False
        if got.shape == ref.shape:
            row_err = _row_errors(ref, got)
            tok_ok, near = _tokens_match(r, ref, out, row_err)
            row_ok = (row_err <= atol) & tok_ok
            ties = int((row_ok & near).sum())
            err = float(row_err.max()) if row_err.size else 0.0
            if not row_ok.all() and uses_rounding_variants(config.kv_cache_dtype, dtype):
                rounding_rows = _match_variants(_variants(runner, config, "fp8")(toks), rows, r, out, got,
                                                atol, row_ok, row_err)
            if not row_ok.all() and uses_routing_variants(dtype):
                routing_rows = _match_variants(_variants(runner, config, "routing")(toks), rows, r, out, got,
                                               atol, row_ok, row_err)
            ok = bool(row_ok.all())
            matched_err = float(row_err.max()) if row_err.size else 0.0
        results[r.req_id] = {
            "output": r.output,
            "matches_reference": ok,
            "max_logit_error": err,
            "max_logit_error_vs_match": matched_err,
            "fp8_rounding_rows": rounding_rows,
            "routing_tie_rows": routing_rows,
            "near_tie_rows": ties,
            "preemptions": r.num_preemptions,
        }
    return results, nan_count


_VARIANTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_VARIANT_KINDS = {"fp8": RoundingVariants, "routing": RoutingVariants}


def _variants(runner, config: RunnerConfig, kind: str):
    """The runner's variants of its dense reference, ``"fp8"`` (:class:`RoundingVariants`) or
    ``"routing"`` (:class:`RoutingVariants`), made once per runner: one compile per length. They
    read the reference's own device copy of the params (``Runner.dense_device_params``): no
    second copy of the model on the device, and no host-to-device transfer of it per call."""
    made = _VARIANTS.setdefault(runner, {})
    if kind not in made:
        made[kind] = _VARIANT_KINDS[kind](runner.model, runner.dense_device_params, config.kv_cache_dtype,
                                          config.matmul_precision)
    return made[kind]


def _match_variants(variants, rows: slice, req: Request, out: np.ndarray, got: np.ndarray, atol: float,
                    row_ok: np.ndarray, row_err: np.ndarray) -> int:
    """Marks the rows of ``req`` (``row_ok``, in place) that a logits array of ``variants``
    matches: within ``atol`` and with the same token. A newly matched row's ``row_err`` becomes
    its error from that variant. Stops once every row matches; returns how many it matched."""
    before = row_ok.copy()
    for logits in variants:
        cand = logits[rows]
        cand_err = _row_errors(cand, got)
        cand_ok = (cand_err <= atol) & _tokens_match(req, cand, out, cand_err)[0]
        row_err[:] = np.where(cand_ok & ~before, np.minimum(row_err, cand_err), row_err)
        row_ok |= cand_ok
        if row_ok.all():
            break
    return int((row_ok & ~before).sum())


def _row_errors(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    """Largest absolute difference of each logits row (NaN counts as infinitely far)."""
    d = np.abs(ref - got)
    return np.where(np.isnan(d), np.inf, d).max(axis=-1) if d.size else np.zeros(d.shape[:1])


def _tokens_note(report: ServeReport) -> str:
    ties = sum(r.get("near_tie_rows", 0) for r in report.requests.values())
    return "tokens identical" if not ties else f"tokens identical but {ties} greedy near ties"


def print_summary(report: ServeReport, config: RunnerConfig, out=None) -> None:
    """The demo's summary lines, to ``out`` (default: the current ``sys.stdout``)."""
    out = sys.stdout if out is None else out
    n_ok = sum(r["matches_reference"] for r in report.requests.values())
    lines = [
        f"platform                {jax.default_backend()} (kernels: {config.backend})",
        f"requests                {len(report.requests)}",
        f"steps                   {report.steps}",
        f"generated tokens        {report.generated_tokens}",
        f"tokens/s                {report.tokens_per_s:.1f}",
        f"buckets compiled        {report.executables} ({_bucket_sizes(report.buckets)}) in {report.compile_seconds:.1f} s",
        f"serving-time compiles   {report.serving_compiles}",
        f"preemptions             {report.preemptions}",
        f"parity with reference   {n_ok}/{len(report.requests)} requests ({_tokens_note(report)}, logits within "
        f"{logits_tolerance(config.kv_cache_dtype, model_dtype(config.model)):g}{_rounding_note(report, config)})",
        f"NaN count               {report.nan_count}",
    ]
    checked = [r["transformers"] for r in report.requests.values() if "transformers" in r]
    if checked:
        ok = sum(c["matches_transformers"] for c in checked)
        ties = sum(c["near_ties"] for c in checked)
        err = max(c["max_logit_error"] for c in checked)
        lines.insert(-1, f"parity with transformers {ok}/{len(checked)} requests (teacher-forced; "
                         f"{ties} near ties; max logit error {err:.2g})")
    if config.kv_layout != "flash":
        lines.insert(1, f"KV layout               {config.kv_layout}")
    if config.num_speculative_tokens:
        lines.insert(-2, f"draft tokens accepted   {report.drafts_accepted}/{report.drafts_proposed}")
    print("\n".join(lines), file=out)
    m = report.mesh
    if m[DATA] * m[MODEL] > 1:
        lines = [f"mesh                    data={m[DATA]}, model={m[MODEL]} (process {report.process_index})"]
        for d, r in sorted(report.ranks.items()):
            lines.append(f"rank {d:<3}                real steps {r['real_steps']}, dummy steps "
                         f"{r['dummy_steps']}, requests {len(r['requests'])}")
        if report.checked:
            lines.append("sanitizer               ok (every rank, every step: null block/slot, fresh memory, "
                         "idle ranks bitwise unchanged)")
        print("\n".join(lines), file=out)


def _rounding_note(report: ServeReport, config: RunnerConfig) -> str:
    """The summary's word on fp8 rounding variants, when the check could use them, and on
    routing near-tie variants, when one matched."""
    note = ""
    if uses_rounding_variants(config.kv_cache_dtype, model_dtype(config.model)):
        n = sum(r.get("fp8_rounding_rows", 0) for r in report.requests.values())
        note += f", or of an fp8 rounding variant: {n} positions"
    n = sum(r.get("routing_tie_rows", 0) for r in report.requests.values())
    if n:
        note += f", or of a routing near-tie variant: {n} positions"
    return note


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
