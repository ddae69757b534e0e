"""TPU check: every TPU kernel against its jnp reference on a TPU, then timed.

Run on a TPU VM (``pip install "jax[tpu]"``) from the repository root:

    PYTHONPATH=. python benchmarks/tpu_check.py

For every case it runs the TPU flavour (``backend="pallas_tpu"``, compiled by
Mosaic) and the jnp reference on the chip from the same inputs and compares all
outputs: bitwise for the copies (KV writes without fp8, block zeroing, token
combine); for fp8 writes, every stored value within one float8_e4m3fn step of
the reference's (the kernel divides with Mosaic's float32 division, the
reference with exact IEEE division; the count of differing bytes is printed);
with a dtype tolerance for the Mamba math. Caches and state pools start random
with NaN in the null block / row 0, so a stray write shows. One PASS/FAIL line
per case, an in-place line (a donated call's outputs are the donated buffers:
no cache copy), then a TIME line per case (median per call over donated, chained
calls; the kernel and the reference); exit status 1 if any check failed.

``--dry-run`` (implied on a host without a TPU) runs the kernels through the TPU
interpreter instead (race detector on, uninitialised memory NaN), exports each
case for TPU to check that Mosaic lowers it (``tpu_custom_call`` in the module,
for the target of :func:`pallas_kernels.tpu_target.resolve` or ``--target``),
and skips the timings; it keeps the smallest size of each op (``--smallest`` does
that on a TPU too). ``--only TEXT`` keeps the cases whose name contains ``TEXT``.

Not yet run on a TPU: there is no recorded TPU result.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import pallas_kernels as pk
from kvjax.testing.asserts import races_found
from pallas_kernels import tpu_target

FP8 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16


@dataclasses.dataclass(frozen=True)
class Case:
    """``run(backend, interpret, mutable, fixed) -> (new_mutable, other_outputs)``.

    ``mutable`` (caches, state pools, ``input_ids``) is donated when timed; ``compare``
    names the comparison of each output of ``new_mutable + other_outputs``.
    """

    name: str
    run: Callable
    mutable: tuple
    fixed: tuple
    compare: tuple[str, ...]  # "bits", "fp8" or "close"
    size: str  # "small" or "serving"


def _poisoned(rng, shape, dtype):
    a = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    a[0] = np.nan  # the null block / row: never written, never read
    return a


def _slots(rng, n, num_blocks, bs):
    """``n`` distinct slots outside block 0, every fourth one PAD (-1)."""
    s = rng.choice(np.arange(bs, num_blocks * bs), n, replace=False).astype(np.int32)
    s[::4] = pk.PAD_SLOT_ID
    return s


# --------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------


def flash_case(rng, size, *, T, H, D, bs, nb, dtype=BF16, fp8=False):
    k, v = (rng.standard_normal((T, H, D)).astype(dtype) for _ in range(2))
    cache = FP8 if fp8 else dtype
    kc, vc = (_poisoned(rng, (nb, bs, H, D), cache) for _ in range(2))
    mode = ("fp8", np.float32(0.5), np.full((H,), 0.25, np.float32)) if fp8 else ("auto",)

    def run(backend, interpret, mutable, fixed):
        out = pk.reshape_and_cache_flash(*fixed[:2], *mutable, fixed[2], *mode,
                                         backend=backend, interpret=interpret)
        return tuple(out), ()

    name = f"reshape_and_cache_flash T={T} H={H} D={D} bs={bs} {'fp8' if fp8 else np.dtype(dtype)}"
    kind = "fp8" if fp8 else "bits"
    return Case(name, run, (kc, vc), (k, v, _slots(rng, T, nb, bs)), (kind, kind), size)


def mla_case(rng, size, *, T, Lr, R, bs, nb, fp8=False):
    kv_c, k_pe = rng.standard_normal((T, Lr)).astype(BF16), rng.standard_normal((T, R)).astype(BF16)
    cache = _poisoned(rng, (nb, bs, Lr + R), FP8 if fp8 else BF16)
    mode = ("fp8", np.float32(0.5)) if fp8 else ("auto",)

    def run(backend, interpret, mutable, fixed):
        out = pk.concat_and_cache_mla(fixed[0], fixed[1], mutable[0], fixed[2], *mode,
                                      backend=backend, interpret=interpret)
        return (out,), ()

    name = f"concat_and_cache_mla T={T} L={Lr} R={R} bs={bs} {'fp8' if fp8 else 'bf16'}"
    return Case(name, run, (cache,), (kv_c, k_pe, _slots(rng, T, nb, bs)),
                ("fp8" if fp8 else "bits",), size)


def pages_case(rng, size, *, T, H, D, bs, nb):
    k, v = (rng.standard_normal((T, H, D)).astype(BF16) for _ in range(2))
    pages = _poisoned(rng, (nb, bs, 2 * H, D), BF16)

    def run(backend, interpret, mutable, fixed):
        out = pk.write_kv_pages(fixed[0], fixed[1], mutable[0], fixed[2],
                                backend=backend, interpret=interpret)
        return (out,), ()

    return Case(f"write_kv_pages T={T} H={H} D={D} bs={bs} bf16", run, (pages,),
                (k, v, _slots(rng, T, nb, bs)), ("bits",), size)


def zero_case(rng, size, *, n, nb, bs, r=1):
    arrays = (_poisoned(rng, (nb * r, bs, 8, 128), BF16), _poisoned(rng, (nb * r, 4, 64, 16), np.float32))
    ids = rng.choice(np.arange(1, nb), n, replace=False).astype(np.int32)
    ids[::3] = -1

    def run(backend, interpret, mutable, fixed):
        out = pk.zero_blocks(list(mutable), fixed[0], kernel_blocks_per_block=r,
                             backend=backend, interpret=interpret)
        return tuple(out), ()

    return Case(f"zero_blocks ids={n} blocks={nb} r={r}", run, arrays, (ids,), ("bits", "bits"), size)


def ssu_case(rng, size, *, n, H, P, Ns, G, state_dtype=np.float32):
    L = 2 * n + 1
    state = _poisoned(rng, (L, H, P, Ns), state_dtype)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    x, z = f(n, H, P).astype(BF16), f(n, H, P).astype(BF16)
    dt = rng.uniform(-1, 1, (n, H, 1)).astype(BF16)
    A = -np.exp(rng.uniform(-1, 1, (H, 1, 1))).astype(np.float32)
    B, C = f(n, G, Ns).astype(BF16), f(n, G, Ns).astype(BF16)
    D, dt_bias = f(H, P), f(H, 1)
    idx = rng.choice(np.arange(1, L), n, replace=False).astype(np.int32)
    idx[-1] = pk.NULL_BLOCK_ID  # a sequence without state: reads zeros, writes nothing

    def run(backend, interpret, mutable, fixed):
        out, st = pk.selective_state_update(mutable[0], *fixed[:8], True, fixed[8],
                                            backend=backend, interpret=interpret)
        return (st,), (out,)

    return Case(f"selective_state_update n={n} H={H} P={P} N={Ns} G={G} state {np.dtype(state_dtype)}",
                run, (state,), (x, dt, A, B, C, D, dt_bias, z, idx), ("close", "close"), size)


def conv_case(rng, size, *, b, dim, width):
    L = 2 * b + 1
    cs = _poisoned(rng, (L, dim, width - 1), BF16)
    x = rng.standard_normal((b, dim)).astype(BF16)
    w = rng.standard_normal((dim, width)).astype(BF16)
    bias = rng.standard_normal((dim,)).astype(BF16)
    idx = rng.choice(np.arange(1, L), b, replace=False).astype(np.int32)
    idx[-1] = pk.NULL_BLOCK_ID

    def run(backend, interpret, mutable, fixed):
        out, new = pk.causal_conv1d_update(fixed[0], mutable[0], fixed[1], fixed[2], "silu", fixed[3],
                                           backend=backend, interpret=interpret)
        return (new,), (out,)

    return Case(f"causal_conv1d_update b={b} dim={dim} width={width} bf16", run, (cs,),
                (x, w, bias, idx), ("close", "close"), size)


def combine_case(rng, size, *, R, MR, S):
    """``R - 1`` decode rows (windows of ``1 + S``), the last row padded."""
    nl = 1 + S
    rows = rng.choice(MR, R, replace=False).astype(np.int32)
    rows[-1] = -1
    q = np.where(rows >= 0, nl, 0)
    qsl = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    cu = qsl.copy()
    prefill = rng.integers(1, 50, MR).astype(np.int32)
    seq_lens = (prefill[np.maximum(rows, 0)] + 10 + nl).astype(np.int32)
    T = int(qsl[-1]) + 8
    input_ids = (9000 + np.arange(T)).astype(np.int32)
    last = rng.integers(0, 1000, (MR, 1)).astype(np.int32)
    drafts = rng.integers(0, 1000, (MR, S)).astype(np.int32)
    num_logits = R * nl

    def run(backend, interpret, mutable, fixed):
        ids, li = pk.combine_sampled_and_draft_tokens(mutable[0], *fixed, num_logits,
                                                      backend=backend, interpret=interpret)
        return (ids,), (li,)

    return Case(f"combine_sampled_and_draft_tokens R={R} MR={MR} S={S}", run, (input_ids,),
                (rows, last, qsl, seq_lens, prefill, drafts, cu), ("bits", "bits"), size)


# (builder, size, arguments): the small sizes are the dry run's.
SPECS = [
    (flash_case, "small", dict(T=4, H=2, D=128, bs=16, nb=4)),
    (flash_case, "serving", dict(T=2048, H=8, D=128, bs=16, nb=1024)),
    (flash_case, "serving", dict(T=64, H=4, D=80, bs=128, nb=64, dtype=np.float32)),
    (flash_case, "small", dict(T=4, H=2, D=128, bs=16, nb=4, fp8=True)),
    (flash_case, "serving", dict(T=2048, H=8, D=128, bs=16, nb=1024, fp8=True)),
    (mla_case, "small", dict(T=4, Lr=128, R=64, bs=16, nb=4)),
    (mla_case, "serving", dict(T=1024, Lr=512, R=64, bs=16, nb=512)),
    (mla_case, "serving", dict(T=256, Lr=512, R=64, bs=128, nb=64, fp8=True)),
    (pages_case, "small", dict(T=4, H=2, D=128, bs=16, nb=4)),
    (pages_case, "serving", dict(T=2048, H=8, D=128, bs=16, nb=1024)),
    (zero_case, "small", dict(n=3, nb=4, bs=16)),
    (zero_case, "serving", dict(n=256, nb=1024, bs=16, r=2)),
    (ssu_case, "small", dict(n=2, H=2, P=8, Ns=16, G=1)),
    (ssu_case, "serving", dict(n=64, H=32, P=64, Ns=128, G=8)),
    (ssu_case, "serving", dict(n=16, H=8, P=80, Ns=48, G=2, state_dtype=BF16)),
    (conv_case, "small", dict(b=2, dim=16, width=4)),
    (conv_case, "serving", dict(b=64, dim=4352, width=4)),
    (combine_case, "small", dict(R=3, MR=4, S=1)),
    (combine_case, "serving", dict(R=256, MR=512, S=4)),
]


def all_cases(sizes=("small", "serving"), seed: int = 0) -> list[Case]:
    """The cases of the given sizes (each with its own seeded inputs)."""
    return [build(np.random.default_rng([seed, i]), size, **kw)
            for i, (build, size, kw) in enumerate(SPECS) if size in sizes]


# --------------------------------------------------------------------------
# comparing and timing
# --------------------------------------------------------------------------


def _bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def compare(kind: str, got, want) -> str:
    """'' when ``got`` matches ``want`` under ``kind``, else what differs."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape/dtype {got.shape} {got.dtype} != {want.shape} {want.dtype}"
    differ = _bits(got) != _bits(want)
    if kind == "bits" or not differ.any():
        return "" if not differ.any() else f"{int(differ.sum())} elements differ bitwise"
    g, w = got.astype(np.float32), want.astype(np.float32)
    if kind == "fp8":  # a rounding-boundary difference moves a value by one e4m3 step
        step = np.maximum(np.abs(w) * 2.0**-3, 2.0**-9)
        bad = ~((np.abs(g - w) <= step) | (np.isnan(g) & np.isnan(w)))
        note = f"{int(differ.sum())} bytes differ from the reference"
        return f"{note}, {int(bad.sum())} by more than one step" if bad.any() else ""
    tol = 2e-2 if got.dtype.itemsize < 4 else 1e-4
    bad = ~(np.isclose(g, w, rtol=tol, atol=tol) | (np.isnan(g) & np.isnan(w)))
    return f"{int(bad.sum())} elements outside rtol=atol={tol}" if bad.any() else ""


def call(case: Case, backend: str, interpret):
    mutable = tuple(jnp.asarray(m) for m in case.mutable)
    new, other = case.run(backend, interpret, mutable, tuple(jnp.asarray(f) for f in case.fixed))
    return [np.asarray(o) for o in jax.block_until_ready(new + other)]


def check(case: Case, interpret: bool) -> str:
    want = call(case, "reference", None)
    got = call(case, "pallas_tpu", interpret)
    if interpret and races_found():
        return "the TPU interpreter found a data race"
    msgs = [f"output {i}: {m}" for i, (k, g, w) in enumerate(zip(case.compare, got, want))
            if (m := compare(k, g, w))]
    return "; ".join(msgs)


def lowers(case: Case, target) -> str:
    def f(mutable, fixed):
        return case.run("pallas_tpu", False, mutable, fixed)

    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (case.mutable, case.fixed))
    text = tpu_target.export(jax.jit(f, donate_argnums=0), *args, target=target).mlir_module()
    return "" if "tpu_custom_call" in text else "no Mosaic kernel in the exported module"


def in_place(case: Case, backend: str) -> str:
    """'' when a donated call writes its outputs into the donated input buffers."""
    fixed = tuple(jnp.asarray(f) for f in case.fixed)
    mutable = tuple(jnp.asarray(m) for m in case.mutable)
    before = [m.unsafe_buffer_pointer() for m in mutable]
    step = jax.jit(lambda m, f: case.run(backend, None, m, f)[0], donate_argnums=0)
    after = [o.unsafe_buffer_pointer() for o in jax.block_until_ready(step(mutable, fixed))]
    moved = [i for i, (a, b) in enumerate(zip(after, before)) if a != b]
    return f"outputs {moved} are not the donated buffers (a copy was made)" if moved else ""


def time_us(case: Case, backend: str, iters: int = 20, repeats: int = 5) -> float:
    """Median microseconds per call over donated, chained calls."""
    fixed = tuple(jnp.asarray(f) for f in case.fixed)
    step = jax.jit(lambda m, f: case.run(backend, None, m, f)[0], donate_argnums=0)
    mutable = jax.block_until_ready(step(tuple(jnp.asarray(m) for m in case.mutable), fixed))
    per_call = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            mutable = step(mutable, fixed)
        jax.block_until_ready(mutable)
        per_call.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(per_call)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="interpret mode + Mosaic export, no timing")
    p.add_argument("--smallest", action="store_true", help="only the smallest case of each op")
    p.add_argument("--only", default="", help="only the cases whose name contains this")
    p.add_argument("--target", default=None, help=f"TPU target for the export ({sorted(tpu_target.TARGETS)})")
    args = p.parse_args(argv)
    on_tpu = jax.default_backend() == "tpu"
    dry = args.dry_run or not on_tpu
    target = tpu_target.resolve(args.target)
    print(f"jax {jax.__version__}, devices {jax.devices()}, target {target.name}"
          f"{' (dry run: TPU interpreter + Mosaic export)' if dry else ''}", flush=True)
    cases = all_cases(("small",) if args.smallest or dry else ("small", "serving"))
    cases = [c for c in cases if args.only in c.name]
    failed = []
    for case in cases:
        steps = [("check", lambda: check(case, interpret=dry))]
        steps += [("lower", lambda: lowers(case, target))] if dry else [
            ("in-place", lambda: in_place(case, "pallas_tpu"))]
        for what, fn in steps:
            try:
                msg = fn()
            except Exception as e:  # noqa: BLE001 - report and carry on
                msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"{'PASS' if not msg else 'FAIL'} {what} {case.name}{': ' + msg if msg else ''}",
                  flush=True)
            if msg:
                failed.append(f"{what} {case.name}")
    if not dry:
        for case in cases:
            kernel, ref = time_us(case, "pallas_tpu"), time_us(case, "reference")
            print(f"TIME {case.name}: kernel {kernel:.1f} us, reference {ref:.1f} us", flush=True)
    n = 2 * len(cases)
    print(f"\n{n - len(failed)}/{n} checks passed" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
