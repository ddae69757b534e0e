"""Command line: ``python -m kvjax demo | trace | difftest``."""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax

import kvjax
from kvjax.cli import demo as demo_cli
from kvjax.cli.demo import print_summary, serve
from kvjax.cli.trace import run_trace
from kvjax.cli.workload import generate_workload, load_workload, validate_workload
from kvjax.models import TinyHybridConfig, TinyHybridModel
from kvjax.models.hf import loader as hf_loader
from kvjax.models.caches import KV_LAYOUTS
from kvjax.runner import RunnerConfig
from kvjax.runner.compile_guard import check_compiles_ahead
from kvjax.runner.serving import check_overlap_supported
from kvjax.runner.memory import available_memory, check_fits, estimate_memory
from kvjax.runner.mesh import check_mesh_layout, make_mesh, parse_mesh_shape
from kvjax.runner.sanitizer import SanitizerError
from kvjax.testing import difftest as dt
from kvjax.testing.scenarios import OPS
from pallas_kernels.backend import BACKENDS


def _token_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    return sizes


def runner_config(args, model: TinyHybridConfig) -> RunnerConfig:
    """The :class:`RunnerConfig` that ``demo`` options ``args`` describe, for ``model``."""
    return RunnerConfig(
        model=model,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_new_requests_per_step=args.max_new_requests_per_step,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_speculative_tokens=args.num_spec_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_layout=args.kv_layout,
        backend=args.backend,
        seed=args.seed,
        poison=args.poison,
        token_sizes=args.token_sizes or demo_token_sizes(args.max_num_batched_tokens),
    )


def _demo(args, parser) -> int:

    mesh_shape, forced_devices = (1, 1), False
    if args.mesh is not None:
        try:
            mesh_shape = parse_mesh_shape(args.mesh)
            check_mesh_layout(args.kv_layout, mesh_shape[1])
            if args.model is None:
                TinyHybridModel(demo_cli.MESH_MODEL).check_mesh(*mesh_shape)
            forced_devices = demo_cli.start_devices(args, mesh_shape)  # before JAX starts its backends
        except ValueError as e:
            parser.error(f"--mesh: {e}")
    elif args.coordinator or args.num_processes != 1:
        parser.error("--coordinator / --num-processes need --mesh")
    model, params, eos = demo_cli.MESH_MODEL if args.mesh else TinyHybridConfig(), None, ()
    if args.model is not None:
        try:  # config.json only: refused by name before any weight is read
            model = hf_loader.model_from_dir(args.model, _dtype(args))
            eos = _eos_ids(hf_loader.read_config(args.model))
        except ValueError as e:
            print(f"error: --model: {e}", file=sys.stderr)
            return 2
        try:
            getattr(model, "check_mesh", lambda d, m: model.shard(m))(*mesh_shape)
        except ValueError as e:
            parser.error(f"--mesh: {e}")
    elif args.dtype is not None or args.check != "reference":
        parser.error("--dtype / --check transformers need --model")
    stops = () if args.ignore_eos else eos
    try:
        config = runner_config(args, model)
        config.bucket_spec  # validates token sizes
        if args.overlap:
            check_overlap_supported(config.num_speculative_tokens)
        if not args.no_strict:
            check_compiles_ahead(config.backend)
        available = available_memory()
        # Sizes are per data rank; a CPU holds every local rank in its RAM, an accelerator one per device.
        on_host = mesh_shape[0] // args.num_processes if jax.default_backend() == "cpu" else 1
        check_fits(estimate_memory(config, longest_request=0).times(on_host), *available)  # before any host structure
        fits = config.make_scheduler().check_fits
        vocab = config.model.vocab_size
        if args.workload:
            requests = load_workload(args.workload, vocab_size=vocab, max_model_len=config.max_model_len,
                                     check_fits=fits)
        else:
            data = generate_workload(args.requests, args.seed, max_model_len=config.max_model_len,
                                     vocab_size=vocab)
            requests = validate_workload(data, vocab_size=vocab, max_model_len=config.max_model_len,
                                         check_fits=fits)
        for r in requests:
            if not r.stop_token_ids:
                r.stop_token_ids = stops
            r.ignore_eos = r.ignore_eos or args.ignore_eos
        longest = min(config.max_model_len, max(len(r.prompt) + r.max_tokens for r in requests))
        memory = estimate_memory(config, longest_request=longest).times(on_host)
        check_fits(memory, *available)
        if args.model is not None:
            _, params = hf_loader.load_pretrained(args.model, _dtype(args))
    except ValueError as e:  # WorkloadError, config or checkpoint errors, too little memory: before any compile
        print(f"error: {e}", file=sys.stderr)
        return 2
    D, M = mesh_shape
    if forced_devices and jax.default_backend() == "cpu":
        print(f"CPU-only machine: set XLA_FLAGS=--xla_force_host_platform_device_count="
              f"{D * M // jax.process_count()} for --mesh data={D},model={M}", file=sys.stderr)
    try:
        mesh = make_mesh(D, M)
        runner = demo_cli.Runner(config, mesh=mesh, params=params, strict=not args.no_strict)  # compiles nothing
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    where = "" if D * M == 1 else (f" over mesh data={D}, model={M} (process {jax.process_index()} of "
                                   f"{jax.process_count()})")
    if not args.quiet:
        print(f"serving {len(requests)} requests on {config.model.description}{where}; estimated memory "
              f"{memory.describe()}", file=sys.stderr)
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    try:
        report, _ = serve(config, requests, mesh=mesh, params=params, strict=not args.no_strict, runner=runner,
                          progress_stream=None if args.quiet else sys.stderr,
                          compile_workers=args.compile_workers, overlap=args.overlap,
                          extra_check=_transformers_check(args))
    except SanitizerError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    except ValueError as e:  # the processes of a run given different workloads (check_same_everywhere)
        if jax.process_count() == 1:  # nobody to disagree with: a ValueError while serving is a bug,
            raise  # shown as one, not as a usage error (configuration errors are refused above)
        print(f"\nerror: {e}", file=sys.stderr)
        return 2
    print_summary(report, config)
    if args.json:
        report.settings["workload"] = args.workload or f"generated: {args.requests} requests, seed {args.seed}"
        path = args.json if jax.process_count() == 1 else f"{args.json}.{jax.process_index()}"
        with open(path, "w") as f:
            json.dump(report.to_json(), f, indent=1)
    return 0 if report.ok else 1


def demo_token_sizes(max_num_batched_tokens: int) -> tuple[int, ...]:
    """The demo's buckets: powers of 4 from 4 below the token budget, then the budget itself
    (few buckets, so start-up compiles little)."""
    sizes, t = [], 4
    while t < max_num_batched_tokens:
        sizes.append(t)
        t *= 4
    return tuple(sizes) + (max_num_batched_tokens,)


def _dtype(args) -> str:
    """``--dtype``, default float32 on a CPU (parity) and bfloat16 on an accelerator."""
    return args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")


def _eos_ids(cfg: dict) -> tuple[int, ...]:
    """The checkpoint's end-of-sequence token ids (config.json ``eos_token_id``: int, list or absent)."""
    eos = cfg.get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"config.json: eos_token_id must be a token id or a list of them, got {eos!r}")
    return tuple(ids)


def _transformers_check(args):
    """``--check transformers``: the extra oracle of :func:`kvjax.cli.demo.serve`, or None."""
    if args.check != "transformers":
        return None
    import kvjax.testing.transformers_check as transformers_check  # torch, transformers: test deps

    dtype = _dtype(args)
    return "transformers", lambda finished: transformers_check.check_requests(
        args.model, finished, dtype=dtype, kv_cache_dtype=args.kv_cache_dtype, sampler=demo_cli.reference_tokens)


def _ops_list(text: str) -> list[str]:
    return [o for o in text.split(",") if o]


def _difftest(args, parser) -> int:
    ops = [o for group in (args.ops or []) for o in group] or None
    unknown = [o for o in ops or [] if o not in OPS]
    if unknown:
        parser.error(f"unknown op(s) {unknown}; ops are: {', '.join(OPS)}")
    try:
        report = dt.difftest(against=args.against, ops=ops, cases=args.cases, seed=args.seed,
                             backend=args.backend, interpret=True if args.interpret else None,
                             progress=None if args.quiet else sys.stderr)
    except dt.VLLMUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_json(), f, indent=1)
    return 0 if report.ok else 1


def _int_at_least(lowest: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"must be >= {lowest}, got {value}")
        return value
    parse.__name__ = f"int >= {lowest}"
    return parse


_positive, _non_negative = _int_at_least(1), _int_at_least(0)


def _json_out(path: str) -> str:
    """``--json OUT``: its folder must exist and be writable now, not after the run."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"folder {folder!r} of {path!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"folder {folder!r} of {path!r} is not writable")
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path!r} is a folder, expected a file name")
    return path


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: ...)`` for options that have a default value (not for None / off flags)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m kvjax`` parser; every option has help text and shows its default."""
    fmt = _HelpFormatter
    parser = argparse.ArgumentParser(prog="python -m kvjax", description="kvjax demos", formatter_class=fmt)
    parser.add_argument("--version", action="version", version=f"kvjax {kvjax.__version__}",
                        help="print the kvjax version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="serve a seeded workload on the tiny hybrid model and check parity",
                          formatter_class=fmt)
    demo.add_argument("--model", metavar="DIR",
                      help="serve a Hugging Face checkpoint from this local directory (config.json + "
                           "safetensors; kvjax never downloads one): Granite-4.0-H, Bamba, Nemotron-H, "
                           "DeepSeek-V3 (default: the tiny random hybrid model)")
    demo.add_argument("--dtype", choices=("float32", "bfloat16"),
                      help="with --model: weights and activations (default: float32 on a CPU, "
                           "bfloat16 on an accelerator)")
    demo.add_argument("--check", choices=("reference", "transformers"), default="reference",
                      help="oracle besides the model's dense reference: transformers runs the "
                           "checkpoint teacher-forced on each request (needs --model, torch and "
                           "transformers)")
    demo.add_argument("--ignore-eos", action="store_true",
                      help="generate max_tokens even past the model's end-of-sequence token")
    demo.add_argument("--workload", metavar="FILE.json", help="workload file (default: a seeded random one)")
    demo.add_argument("--requests", type=_positive, metavar="N", default=8, help="requests in the generated workload")
    demo.add_argument("--seed", type=int, metavar="N", default=0, help="seed of the workload and the weights")
    demo.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                      help="KV cache storage: auto (float32) or fp8 (float8_e4m3fn)")
    demo.add_argument("--kv-layout", choices=KV_LAYOUTS, default="flash",
                      help="KV cache layout: flash (vLLM's key/value caches) or rpa (JAX's ragged paged "
                           "attention: write_kv_pages + ragged_paged_attention)")
    demo.add_argument("--num-spec-tokens", type=_non_negative, metavar="N", default=0, help="n-gram draft tokens per step")
    demo.add_argument("--num-blocks", type=_positive, metavar="N", default=96, help="KV blocks incl. the null block")
    demo.add_argument("--block-size", type=_positive, metavar="N", default=8, help="tokens per KV block")
    demo.add_argument("--max-num-seqs", type=_positive, metavar="N", default=4, help="request rows (requests in flight)")
    demo.add_argument("--max-new-requests-per-step", type=_positive, metavar="N", default=4,
                      help="requests admitted per step (rows staged for new requests)")
    demo.add_argument("--max-num-batched-tokens", type=_positive, metavar="N", default=32, help="token budget of a step")
    demo.add_argument("--max-model-len", type=_positive, metavar="N", default=96,
                      help="longest request (prompt + output) in tokens")
    demo.add_argument("--token-sizes", type=_token_sizes, metavar="T1,T2,...",
                      help="bucket token sizes, comma-separated (default: 4, 16, 64, ... below "
                           "--max-num-batched-tokens, and it: 4,16,32 for 32)")
    demo.add_argument("--backend", choices=BACKENDS, default="auto",
                      help="kernel backend (auto: Pallas on GPU/TPU, jnp reference on CPU)")
    demo.add_argument("--poison", action="store_true",
                      help="checked mode: fill the null block, free blocks and freed recurrent slots with "
                           "NaN and verify memory on the device after every step (exit 1 on a violation)")
    demo.add_argument("--no-strict", action="store_true", help="count serving-time compiles instead of failing")
    demo.add_argument("--quiet", action="store_true", help="no progress output")
    demo.add_argument("--json", metavar="OUT", type=_json_out,
                      help="write the report, with the settings it ran with, as JSON")
    demo.add_argument("--compile-cache", metavar="DIR",
                      help="JAX persistent compilation cache directory (reused across runs)")
    demo.add_argument("--compile-workers", type=_positive, metavar="N", default=2,
                      help="threads compiling the buckets in parallel")
    demo.add_argument("--overlap", action="store_true",
                      help="plan and dispatch each step while the previous one runs on the device "
                           "(needs --num-spec-tokens 0)")
    demo.add_argument("--mesh", metavar="data=D,model=M",
                      help="serve over a device mesh: D data-parallel ranks, M-way tensor parallel; the "
                           "model gains an MoE block with experts sharded over 'data'")
    demo.add_argument("--coordinator", metavar="HOST:PORT",
                      help="with --mesh: jax.distributed coordinator; run one command per process")
    demo.add_argument("--num-processes", type=_positive, metavar="N", default=1,
                      help="with --coordinator: how many processes")
    demo.add_argument("--process-id", type=_non_negative, metavar="I", default=0,
                      help="with --coordinator: this process")
    trace = sub.add_parser("trace", help="a scheduling trace through the state functions (no model)",
                           formatter_class=fmt)
    trace.add_argument("--seed", type=int, metavar="N", default=0, help="seed of the trace's arrivals and lengths")
    trace.add_argument("--requests", type=_positive, metavar="N", default=4, help="requests in the trace")
    diff = sub.add_parser("difftest", help="compare kvjax with the torch reference / vLLM on seeded "
                                           "scenarios (exit 1 on any mismatch)", formatter_class=fmt)
    diff.add_argument("--against", choices=("torch", "vllm", "all"), default="torch",
                      help="what to compare with; vllm needs `bash scripts/install_vllm_oracle.sh`")
    diff.add_argument("--ops", nargs="+", type=_ops_list, metavar="OP",
                      help="ops to run, space- or comma-separated (default: all)")
    diff.add_argument("--cases", type=_non_negative, metavar="N", default=4,
                      help="random scenarios per op, besides the adversarial ones")
    diff.add_argument("--seed", type=int, metavar="N", default=0, help="base seed of the scenarios")
    diff.add_argument("--backend", choices=("reference", "pallas", "auto"), default="auto",
                      help="kvjax kernels: jnp reference, Pallas, or auto")
    diff.add_argument("--interpret", action="store_true", help="run the Pallas kernels in interpret mode")
    diff.add_argument("--json", metavar="OUT", type=_json_out, help="write the report as JSON")
    diff.add_argument("--quiet", action="store_true", help="no progress output")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "difftest":
        return _difftest(args, parser)
    if args.command == "demo":
        return _demo(args, parser)
    if args.command == "trace":
        summary = run_trace(seed=args.seed, num_requests=args.requests)
        return 0 if all(summary["checks"].values()) else 1
    return 2
