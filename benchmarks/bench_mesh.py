"""Real-width models over several GPUs of one host (issue 27).

    PYTHONPATH=. python benchmarks/bench_mesh.py --gpu-run OUTDIR     # 2+ GPUs
    PYTHONPATH=. python benchmarks/bench_mesh.py --cpu-smoke OUTDIR   # 2 fake CPU devices, tiny presets

Six parts, each writing its rows as it finishes (``OUTDIR/rows.jsonl``, then
``OUTDIR/<date>-<gpu>-mesh.json``):

1. ``tp_decode``: the Granite-4.0-H-Micro-like hybrid (``bench_model``'s preset, real widths,
   ``--layers`` of its 40 layers, attention kept in the same 1:9 proportion) with tensor
   parallelism over N GPUs (``data=1, model=N``) against one GPU in the same process: the
   compiled decode step at batch 1 / 64 / 256 over a 1k context (``bench_model.Bench``'s
   fabricated state and timing), with the byte floor per GPU (the one-GPU byte floor / N: every
   weight, KV and state byte split evenly -- an optimistic floor, embeddings and norms are
   replicated).
2. ``tp_parity``: the same model served end to end (``kvjax.cli.demo.serve``: scheduler, packing,
   the Runner's step, sampling on the device) on one GPU and on ``model=N``, greedy and sampled
   requests with staggered arrivals: each run's parity with the dense reference, and the tokens of
   the two runs compared request by request. ``--overlap`` on the mesh: its serving rate beside
   the lockstep one (the same executables).
3. ``dp_mla``: the DeepSeek-V2-Lite-like MLA + MoE model (real widths, ``--mla-layers`` layers, the
   first dense) with ``data=N`` (routed experts over "data", idle ranks running the dummy step),
   checked mode (``poison``: every rank's null block, freed blocks and idle state checked bitwise
   by the sanitizer each step), against one GPU: parity, per-rank real / dummy step counts, tokens
   compared. ``dp_mla_f32``: the same in float32, where the dense reference is exact: a bf16
   MoE's reference misses by a logit wherever a token's top-k expert set flips between the two
   paths' roundings (``benchmarks/probe_moe_bf16_parity.py``), so the float32 run is the parity
   check of the expert-parallel path.
4. ``dp_decode``: that model's compiled decode step over a 1k context with N / 64 / 256 requests
   on one GPU and split evenly over ``data=N`` (each rank compiled for its own share), with the
   byte floor per GPU (the dense weights, which every rank holds, 1/N of the experts the batch
   touches, and the rank's own KV).
5. ``tp_overlap_gap``: the hybrid at ``--overlap-layers`` (default all 40) served by
   ``bench_overlap``'s steady-decode measurement at 16 and 64 requests on one GPU and on
   ``model=N``: the device step alone, the served step lockstep and with ``--overlap``, and the
   GPU's idle gap between overlapped steps.

Bf16 throughout. Token equality between one GPU and the mesh is reported, not asserted: tensor
parallelism sums partial products in another order, so a greedy near-tie can flip in bf16 (each
run's own parity with the dense reference is the correctness check).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import gc
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DECODE_BATCHES = (1, 64, 256)
DECODE_CONTEXT = 1024


def log(*a):
    print(*a, flush=True)


def truncated(preset: str, layers: int) -> dict:
    """``preset``'s config.json with ``layers`` layers (widths unchanged)."""
    import bench_model as bm

    cfg = bm.hf_config(preset)
    if cfg["model_type"] == "granitemoehybrid":
        n_attn = max(1, round(layers / 10))
        types = ["mamba"] * layers
        for i in range(n_attn):  # spread like the real 5 / 15 / 25 / 35
            types[min(layers - 1, i * 10 + min(5, layers // 2))] = "attention"
        cfg.update(num_hidden_layers=layers, layer_types=types)
    elif cfg["model_type"] == "deepseek_v3":
        cfg.update(num_hidden_layers=layers, first_k_dense_replace=min(1, layers - 1))
    else:
        raise ValueError(f"no truncation rule for {cfg['model_type']!r}")
    return cfg


def build(cfg: dict, dtype: str = "bfloat16"):
    from kvjax.models.hf import loader

    module = loader.architecture_module(cfg["architectures"][0])
    config = module.config_from_hf(cfg)
    if dataclasses.is_dataclass(config) and any(f.name == "dtype" for f in dataclasses.fields(config)):
        config = dataclasses.replace(config, dtype=dtype)
    return loader._make_model(module, config, dtype)


def host_params(model, seed: int = 0):
    """Random params (``bench_model.device_params``) drawn on the first device, copied to the host:
    the same logical params for every mesh (the Runner lays them out and shards them)."""
    import bench_model as bm
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from kvjax.runner.mesh import make_mesh

    params = bm.device_params(model, seed, NamedSharding(make_mesh(1, 1), P()))
    host = jax.device_get(params)
    del params
    return host


def _free():
    import jax

    gc.collect()
    jax.clear_caches()


# ------------------------------------------------------------------------------------ parts


def mesh_decode(part: str, model, hp, n: int, emit, *, preset: str, batches, context: int, ceil: dict) -> None:
    """The compiled decode step of ``batches`` requests on one GPU and on ``n``: ``tp_decode``
    over ``model=n`` (every rank all the requests; per-GPU floor: one GPU's / n), ``dp_decode``
    split evenly over ``data=n`` (each mesh compiled for its own per-rank batch; per-GPU floor: the
    dense weights, which every rank holds, 1/n of the experts the batch touches, the rank's own KV)."""
    import bench_model as bm

    from kvjax.runner.mesh import make_mesh

    dp = part == "dp_decode"
    info = bm.count_params(model)
    for m in (1, n):
        per_rank = {b: b // m if dp else b for b in batches}
        name = f"data={m},model=1" if dp else f"data=1,model={m}"
        matrix = {"decode": [(context, tuple(per_rank.values()))], "prefill": ()}
        t0 = time.perf_counter()
        bench = bm.Bench(preset, matrix, model=model, mesh=make_mesh(m, 1) if dp else make_mesh(1, m), params=hp)
        bench.compile_all()
        log(f"[{part}] {name}: runner + {len(bench.compile_s)} compiles in {time.perf_counter() - t0:.1f} s")
        for b in batches:
            try:
                plans = bench.fabricate_decode_ranks(b, context) if dp else {0: bench.fabricate_decode(b, context)}
                t = bench.time_plan(plans)
                fl = bm.floors(dict(info, routed=info["routed"] / m) if dp else info, model, phase="decode",
                               batch=per_rank[b], context=context, tokens=b, bw=ceil["copy_bw_Bps"],
                               tflops=bm.NOMINAL_BF16_TFLOPS)
                per_gpu = fl["byte_floor_us"] if dp else fl["byte_floor_us"] / m
                row = {"part": part, "preset": preset, "mesh": name, "gpus": m, "phase": "decode", "batch": b,
                       "batch_per_gpu": per_rank[b], "context": context, "device_us": t["device_us"],
                       "host_us": t["host_us"], "byte_floor_us_per_gpu": per_gpu,
                       "floor_ratio": t["device_us"] / per_gpu, "tokens_per_s": b / t["device_us"] * 1e6,
                       "compile_s": bench.compile_s.get(plans[0].bucket), "memory_gb_dev0": bench.memory_gb()}
                if not dp:
                    row["byte_floor_us_one_gpu"] = fl["byte_floor_us"]
                emit(row)
                log(f"  {name} b={b:4d} ({per_rank[b]}/GPU): {t['device_us']:9.1f} us (floor/GPU {per_gpu:8.1f} us, "
                    f"{row['floor_ratio']:.1f}x), {row['tokens_per_s']:.0f} tok/s")
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                emit({"part": part, "preset": preset, "gpus": m, "batch": b,
                      "note": f"failed: {type(e).__name__}: {e}"[:400]})
        del bench
        _free()


def tp_overlap_gap(model, hp, n: int, emit, *, preset: str, requests, steps: int) -> None:
    """``bench_overlap``'s steady-decode measurement (``PresetBench.measure``: the device step
    alone, then served lockstep and with ``--overlap``) on one GPU and on ``model=n``: the GPU's
    idle gap between overlapped steps."""
    import bench_overlap as bo

    from kvjax.runner.mesh import make_mesh

    for m in (1, n):
        pb = bo.PresetBench(preset, list(requests), prompt_len=16, steps=steps, skip=3, max_new=None, seed=0,
                            workers=4, model=model, mesh=make_mesh(1, m), params=hp)
        for r in requests:
            try:
                row = pb.measure(r)
                emit({"part": "tp_overlap_gap", "mesh": f"data=1,model={m}", "gpus": m, **row})
                log(f"[tp_overlap_gap] model={m} N={r}: device {row['device_us']:.0f} us, overlap "
                    f"{row['overlap_us']:.0f} us/step, gap {100 * row['gap_fraction']:.1f}% (lockstep gap "
                    f"{100 * row['lockstep_gap_fraction']:.1f}%)")
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                emit({"part": "tp_overlap_gap", "mesh": f"data=1,model={m}", "gpus": m, "requests": r,
                      "note": f"failed: {type(e).__name__}: {e}"[:400]})
        del pb
        _free()


def workload(vocab: int, n: int = 8, seed: int = 0):
    """``n`` requests, staggered arrivals, mixed prompt lengths; every third sampled (seeded)."""
    import numpy as np

    from kvjax.host.scheduler import Request

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = [int(t) for t in rng.integers(1, vocab, int(rng.integers(8, 48)))]
        kw = dict(temperature=0.8, top_k=50, top_p=0.95, seed=100 + i) if i % 3 == 2 else {}
        out.append(Request(f"q{i}", prompt, int(rng.integers(6, 14)), arrival_step=i // 2 + (3 if i == n - 1 else 0),
                           ignore_eos=True, **kw))
    return out


def serve_on(model, hp, data: int, model_size: int, requests, *, poison: bool = False, overlap: bool = False,
             runner=None):
    """``(report, runner, seconds)``: ``requests`` served on a ``data x model_size`` mesh."""
    from kvjax.cli.demo import serve
    from kvjax.runner import RunnerConfig
    from kvjax.runner.mesh import make_mesh

    if runner is None:
        config = RunnerConfig(model=model, block_size=16, num_blocks=64, max_model_len=128, max_num_seqs=4,
                              max_num_batched_tokens=64, token_sizes=(4, 64), max_new_requests_per_step=2,
                              poison=poison, seed=0)
        mesh = make_mesh(data, model_size)
    else:
        config, mesh = runner.config, runner.mesh
    t0 = time.perf_counter()
    with open(os.devnull, "w") as devnull:
        report, runner = serve(config, copy.deepcopy(requests), mesh=mesh, params=hp, runner=runner,
                               compile_workers=4, progress_stream=devnull, overlap=overlap)
    return report, runner, time.perf_counter() - t0


def _summary(report) -> dict:
    return {"all_match": report.all_match, "nan_count": report.nan_count, "steps": report.steps,
            "generated_tokens": report.generated_tokens, "tokens_per_s": report.tokens_per_s,
            "serving_compiles": report.serving_compiles, "compile_seconds": report.compile_seconds,
            "preemptions": report.preemptions, "checked": report.checked,
            "ranks": {str(d): {k: v for k, v in r.items()} for d, r in report.ranks.items()},
            "near_tie_rows": sum(r.get("near_tie_rows", 0) for r in report.requests.values()),
            "max_logit_err": max((r.get("max_logit_error", 0.0) or 0.0 for r in report.requests.values()), default=None)}


def _compare(a, b) -> dict:
    same = {rid: a.requests[rid]["output"] == b.requests[rid]["output"] for rid in a.requests}
    return {"requests": len(same), "same_tokens": sum(same.values()),
            "differ": sorted(rid for rid, ok in same.items() if not ok)}


def tp_parity(model, hp, n: int, emit, *, preset: str) -> None:
    reqs = workload(model.vocab_size)
    one, r1, s1 = serve_on(model, hp, 1, 1, reqs)
    del r1
    _free()
    tp, rt, st = serve_on(model, hp, 1, n, reqs)
    emit({"part": "tp_parity", "preset": preset, "one_gpu": _summary(one), f"model={n}": _summary(tp),
          "compare": _compare(one, tp), "wall_s": [s1, st]})
    log(f"[tp_parity] one GPU parity {one.all_match}, model={n} parity {tp.all_match}, "
        f"same tokens {_compare(one, tp)}")
    ov, _, so = serve_on(model, hp, 1, n, reqs, overlap=True, runner=rt)
    emit({"part": "tp_overlap", "preset": preset, "mesh": f"data=1,model={n}", "lockstep": _summary(tp),
          "overlap": _summary(ov), "compare": _compare(tp, ov), "wall_s": so})
    log(f"[tp_overlap] overlap parity {ov.all_match}, {ov.tokens_per_s:.1f} tok/s vs lockstep "
        f"{tp.tokens_per_s:.1f}; same tokens {_compare(tp, ov)}")
    del rt
    _free()


def dp_mla(model, hp, n: int, emit, *, preset: str, part: str = "dp_mla") -> None:
    from kvjax.cli.demo import model_dtype

    reqs = workload(model.vocab_size, n=6, seed=1)
    one, r1, s1 = serve_on(model, hp, 1, 1, reqs, poison=True)
    del r1
    _free()
    dp, rd, sd = serve_on(model, hp, n, 1, reqs, poison=True)
    emit({"part": part, "preset": preset, "mesh": f"data={n},model=1", "dtype": model_dtype(model),
          "one_gpu": _summary(one), f"data={n}": _summary(dp), "compare": _compare(one, dp), "wall_s": [s1, sd]})
    log(f"[{part}] one GPU parity {one.all_match}, data={n} parity {dp.all_match} checked {dp.checked}, "
        f"ranks {dp.ranks}, same tokens {_compare(one, dp)}")
    del rd
    _free()


# ----------------------------------------------------------------------------------- driver


def run(outdir: str, *, cpu: bool, layers: int, mla_layers: int, budget_s: float, parts,
        dtype: str = "bfloat16", overlap_layers: int = 40) -> int:
    import bench_model as bm
    import jax
    import jax.numpy as jnp

    os.makedirs(outdir, exist_ok=True)
    t_start = time.perf_counter()
    n = len(jax.devices())
    if n < 2:
        log(f"needs 2+ devices, found {jax.devices()}")
        return 2
    n = 2 if cpu else n
    rows_path = os.path.join(outdir, "rows.jsonl")
    rows = []

    def emit(row):
        rows.append(row)
        with open(rows_path, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")

    log(f"devices: {jax.devices()}")
    ceil = bm.measure_ceilings(jax, jnp)
    hybrid = "tiny" if cpu else "granite-4.0-h-micro"
    mla = "tiny-mla" if cpu else "deepseek-v2-lite"
    batches = (1, 4) if cpu else DECODE_BATCHES  # dp_decode: the first is the rank count (one request each)
    context = 24 if cpu else DECODE_CONTEXT
    status = 0
    for part in parts:
        if time.perf_counter() - t_start > budget_s:
            log(f"budget spent: {part} not run")
            emit({"part": part, "note": "not run: budget spent"})
            continue
        try:
            if part in ("tp_decode", "tp_parity", "tp_overlap_gap"):
                keep = overlap_layers if part == "tp_overlap_gap" else layers
                cfg = bm.hf_config(hybrid) if cpu else truncated(hybrid, keep)
                model = build(cfg, dtype)
                hp = host_params(model)
                log(f"[{part}] {model.description} ({cfg['num_hidden_layers']} layers)")
                if part == "tp_decode":
                    mesh_decode(part, model, hp, n, emit, preset=hybrid, batches=batches, context=context, ceil=ceil)
                elif part == "tp_overlap_gap":
                    tp_overlap_gap(model, hp, n, emit, preset=hybrid, requests=(4, 8) if cpu else (16, 64),
                                   steps=8 if cpu else 30)
                else:
                    tp_parity(model, hp, n, emit, preset=hybrid)
            elif part in ("dp_mla", "dp_mla_f32", "dp_decode"):
                cfg = bm.hf_config(mla) if cpu else truncated(mla, mla_layers)
                model = build(cfg, "float32" if part == "dp_mla_f32" else dtype)
                hp = host_params(model)
                log(f"[{part}] {model.description} ({cfg['num_hidden_layers']} layers)")
                if part in ("dp_mla", "dp_mla_f32"):
                    dp_mla(model, hp, n, emit, preset=mla, part=part)
                else:
                    mesh_decode(part, model, hp, n, emit, preset=mla, batches=(n,) + batches[1:], context=context,
                                ceil=ceil)
            _free()
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            emit({"part": part, "note": f"failed: {type(e).__name__}: {e}"[:600]})
            status = 1
    meta = {"date": datetime.date.today().isoformat(), "devices": [str(d) for d in jax.devices()],
            "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__, "layers": layers,
            "mla_layers": mla_layers, "overlap_layers": overlap_layers, "dtype": dtype,
            "copy_bw_TBps": ceil["copy_bw_Bps"] / 1e12,
            "wall_s": time.perf_counter() - t_start}
    kind = "cpu" if cpu else jax.devices()[0].device_kind.lower().replace(" ", "-")
    out = os.path.join(outdir, f"{meta['date']}-{kind}-x{len(jax.devices())}-mesh.json")
    with open(out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    log(f"wrote {out} ({len(rows)} rows) in {meta['wall_s']:.1f} s")
    return status


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--gpu-run", metavar="OUTDIR")
    g.add_argument("--cpu-smoke", metavar="OUTDIR")
    ap.add_argument("--layers", type=int, default=4, help="hybrid layers kept (real widths)")
    ap.add_argument("--mla-layers", type=int, default=3, help="MLA + MoE layers kept (the first dense)")
    ap.add_argument("--overlap-layers", type=int, default=40, help="tp_overlap_gap: hybrid layers kept (40: all)")
    ap.add_argument("--budget-s", type=float, default=400.0, help="start no part after this")
    ap.add_argument("--parts", default="tp_parity,dp_mla,dp_mla_f32,tp_decode,dp_decode,tp_overlap_gap")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = ap.parse_args(argv)
    cpu = args.cpu_smoke is not None
    if cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    return run(args.cpu_smoke or args.gpu_run, cpu=cpu, layers=args.layers, mla_layers=args.mla_layers,
               budget_s=args.budget_s, parts=args.parts.split(","), dtype=args.dtype,
               overlap_layers=args.overlap_layers)


if __name__ == "__main__":
    sys.exit(main())
