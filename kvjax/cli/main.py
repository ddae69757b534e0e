"""Command line: ``python -m kvjax demo | trace | difftest``."""

from __future__ import annotations

import argparse
import json
import sys

import jax

from kvjax.cli.demo import print_summary, serve
from kvjax.cli.trace import run_trace
from kvjax.cli.workload import WorkloadError, generate_workload, load_workload, validate_workload
from kvjax.models import TinyHybridConfig
from kvjax.runner import RunnerConfig
from kvjax.testing import difftest as dt
from kvjax.testing.scenarios import OPS


def _token_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    return sizes


def _demo(args, parser) -> int:

    model = TinyHybridConfig()
    try:
        config = RunnerConfig(
            model=model,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_speculative_tokens=args.num_spec_tokens,
            kv_cache_dtype=args.kv_cache_dtype,
            backend=args.backend,
            seed=args.seed,
            poison=args.poison,
            token_sizes=args.token_sizes,
        )
        config.bucket_spec  # validates token sizes
        if args.workload:
            requests = load_workload(args.workload, vocab_size=model.vocab_size, max_model_len=config.max_model_len)
        else:
            if args.requests <= 0:
                raise WorkloadError(f"--requests must be positive, got {args.requests}")
            data = generate_workload(args.requests, args.seed, max_model_len=config.max_model_len,
                                     vocab_size=model.vocab_size)
            requests = validate_workload(data, vocab_size=model.vocab_size, max_model_len=config.max_model_len)
    except ValueError as e:  # WorkloadError and config errors: before any compile
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"serving {len(requests)} requests on the tiny hybrid model "
          f"({len(model.layer_types)} layers: {', '.join(model.layer_types)})", file=sys.stderr)
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    report, _ = serve(config, requests, strict=not args.no_strict,
                      progress_stream=None if args.quiet else sys.stderr,
                      compile_workers=max(1, args.compile_workers))
    print_summary(report, config)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_json(), f, indent=1)
    ok = report.all_match and report.nan_count == 0 and report.serving_compiles == 0
    return 0 if ok else 1


def _ops_list(text: str) -> list[str]:
    return [o for o in text.split(",") if o]


def _difftest(args, parser) -> int:
    ops = [o for group in (args.ops or []) for o in group] or None
    unknown = [o for o in ops or [] if o not in OPS]
    if unknown:
        parser.error(f"unknown op(s) {unknown}; ops are: {', '.join(OPS)}")
    if args.cases < 0:
        parser.error(f"--cases must be >= 0, got {args.cases}")
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvjax", description="kvjax demos")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="serve a seeded workload on the tiny hybrid model and check parity")
    demo.add_argument("--workload", metavar="FILE.json", help="workload file (default: a seeded random one)")
    demo.add_argument("--requests", type=int, default=8, help="requests in the generated workload (8)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the workload and the weights (0)")
    demo.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    demo.add_argument("--num-spec-tokens", type=int, default=0, help="n-gram draft tokens per step (0)")
    demo.add_argument("--num-blocks", type=int, default=96, help="KV blocks incl. the null block (96)")
    demo.add_argument("--block-size", type=int, default=8)
    demo.add_argument("--max-num-seqs", type=int, default=4)
    demo.add_argument("--max-num-batched-tokens", type=int, default=32)
    demo.add_argument("--max-model-len", type=int, default=96)
    demo.add_argument("--token-sizes", type=_token_sizes, default=(4, 16, 32),
                      help="bucket token sizes, comma-separated (4,16,32)")
    demo.add_argument("--backend", default="auto", help="kernel backend: auto|reference|pallas (auto)")
    demo.add_argument("--poison", action="store_true",
                      help="fill the null block, free blocks and freed recurrent slots with NaN")
    demo.add_argument("--no-strict", action="store_true", help="count serving-time compiles instead of failing")
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.add_argument("--json", metavar="OUT", help="write the report as JSON")
    demo.add_argument("--compile-cache", metavar="DIR",
                      help="JAX persistent compilation cache directory (reused across runs)")
    demo.add_argument("--compile-workers", type=int, default=2,
                      help="threads compiling the buckets in parallel (2)")
    trace = sub.add_parser("trace", help="a scheduling trace through the state functions (no model)")
    trace.add_argument("--seed", type=int, default=0)
    trace.add_argument("--requests", type=int, default=4)
    diff = sub.add_parser("difftest", help="compare kvjax with the torch reference / vLLM on seeded "
                                           "scenarios (exit 1 on any mismatch)")
    diff.add_argument("--against", choices=("torch", "vllm", "all"), default="torch",
                      help="what to compare with (torch); vllm needs `bash scripts/install_vllm_oracle.sh`")
    diff.add_argument("--ops", nargs="+", type=_ops_list, metavar="OP",
                      help="ops to run, space- or comma-separated (default: all)")
    diff.add_argument("--cases", type=int, default=4, help="random scenarios per op, besides the adversarial ones (4)")
    diff.add_argument("--seed", type=int, default=0, help="base seed of the scenarios (0)")
    diff.add_argument("--backend", choices=("reference", "pallas", "auto"), default="auto",
                      help="kvjax kernels: jnp reference, Pallas, or auto (auto)")
    diff.add_argument("--interpret", action="store_true", help="run the Pallas kernels in interpret mode")
    diff.add_argument("--json", metavar="OUT", help="write the report as JSON")
    diff.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.command == "difftest":
        return _difftest(args, parser)
    if args.command == "demo":
        return _demo(args, parser)
    if args.command == "trace":
        if args.requests <= 0:
            parser.error(f"--requests must be positive, got {args.requests}")
        summary = run_trace(seed=args.seed, num_requests=args.requests)
        return 0 if all(summary["checks"].values()) else 1
    return 2

