"""GPU check of the KV write and block-zeroing kernels (compiled, not interpreted).

Run on a machine with an NVIDIA GPU, from the repository root:

    PYTHONPATH=. python benchmarks/gpu_check_kv_write.py

For every case it runs the GPU flavour (``backend="pallas_gpu"``, compiled
through the Pallas GPU lowering) and the jnp reference on the GPU, and
compares whole caches bit for bit against an expectation computed on the host
with numpy / ml_dtypes (fp8: saturate(x / scale) in float32, round to nearest
even). Caches are random with a NaN-filled null block 0. One PASS/FAIL line
per case; exit status 1 if any case fails.

Then it checks that a donated cache is updated in place: the output buffer is
the donated input buffer, the compiled module aliases it, and the compiled
temporary memory is far below one cache. A diagnosis of XLA's own float32
division and fp8 conversion on the device, and a short decode-sized timing
(informational, not a benchmark), close the run.

Last run, 2026-11-22, NVIDIA H100 80GB HBM3, driver 580.159.04, jax/jaxlib
0.11.2 (CUDA 13), Pallas Triton lowering, the kernels of BENCHMARKS.md (several
tokens per program, slot check in the kernel, per-head fp8 scales): 17/17
checks passed (all flash, MLA, fp8 and zero_blocks cases bitwise equal to
numpy for both the GPU kernel and the reference; donated caches updated in
place, GPU kernel temp 16 B (auto) / 288 B (fp8) for a 128 MiB / 64 MiB cache;
the first kernels: 512 B / 4.6 KB). Diagnosis: plain XLA float32 x / s
differed from IEEE in 259615 of 1048576 elements (div.full.f32), ieee_divide
in 0, f32 -> fp8 conversion in 0. Decode write T=64, H=8, D=128, 8192 blocks
of 16, median host-synchronised call: auto 87 us kernel vs 94 us reference,
fp8 84 us vs 81 us (dispatch-dominated, and run beside the other two checks;
no claim: device-side figures are in BENCHMARKS.md, from bench_kernels.py).
"""

from __future__ import annotations

import sys
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from kvjax.constants import PAD_SLOT_ID
from pallas_kernels.block_zero import ZeroBlocksConfig, zero_blocks
from pallas_kernels.kv_write import concat_and_cache_mla, reshape_and_cache_flash
from _gpu_check import RESULTS, case, on_gpu_or_allowed, run_cases, summary  # noqa: E402

FP8 = ml_dtypes.float8_e4m3fn
GPU = "pallas_gpu"


# --------------------------------------------------------------------------
# host-side expectations
# --------------------------------------------------------------------------


def bits(x):
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


def same_bits(a, b) -> str:
    """'' when bitwise equal, else a description of the first difference."""
    a, b = bits(a), bits(b)
    if a.shape != b.shape:
        return f"shape {a.shape} != {b.shape}"
    diff = np.argwhere(a != b)
    if diff.size == 0:
        return ""
    i = tuple(int(k) for k in diff[0])
    return f"{len(diff)} elements differ, first at {i}: {a[i]:#x} vs {b[i]:#x}"


def np_quantize(x, scale):
    y = np.asarray(x).astype(np.float32) / np.asarray(scale, np.float32)
    y = np.where(y > 448.0, np.float32(448.0), y)
    y = np.where(y < -448.0, np.float32(-448.0), y)
    return y.astype(FP8)


def poisoned(rng, shape, dtype):
    if np.dtype(dtype) == np.dtype(FP8):
        c = rng.integers(0, 256, size=shape, dtype=np.uint8)
        c[0] = 0x7F
        return c.view(FP8)
    c = rng.standard_normal(shape).astype(dtype)
    c[0] = np.nan
    return c


def expect_rows(cache, slots, rows_of):
    """Copy of ``cache`` with ``rows_of(t)`` written at slot ``slots[t]`` (>= 0, in range)."""
    out = cache.copy()
    bs = cache.shape[1]
    num_slots = cache.shape[0] * bs
    for t, s in enumerate(np.asarray(slots).tolist()):
        if 0 <= s < num_slots:
            out[s // bs, s % bs] = rows_of(t)
    return out


def slot_mapping(rng, n, num_slots, pad_frac, avoid_block0_of=None):
    lo = avoid_block0_of or 0
    slots = rng.choice(np.arange(lo, num_slots), size=n, replace=False).astype(np.int32)
    slots[rng.random(n) < pad_frac] = PAD_SLOT_ID
    return slots


# --------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------




def check_flash(seed, *, T, H, D, nb, bs, n=None, dtype=np.float32, fp8=False, k_scale=1.0,
                v_scale=1.0, slots=None, pad_frac=0.25, edges=None, jit=False, int64=False):
    rng = np.random.default_rng(seed)
    n = T if n is None else n
    key = (rng.standard_normal((T, H, D)) * (100 if fp8 else 1)).astype(dtype)
    value = (rng.standard_normal((T, H, D)) * (100 if fp8 else 1)).astype(dtype)
    if edges is not None:
        key.reshape(-1)[: len(edges)] = edges
    cdt = FP8 if fp8 else dtype
    kc, vc = poisoned(rng, (nb, bs, H, D), cdt), poisoned(rng, (nb, bs, H, D), cdt)
    if slots is None:
        slots = slot_mapping(rng, n, nb * bs, pad_frac, avoid_block0_of=bs)
    args = ("fp8", k_scale, v_scale) if fp8 else ()
    ks = np.reshape(np.asarray(k_scale, np.float32), (-1, 1))
    vs = np.reshape(np.asarray(v_scale, np.float32), (-1, 1))
    conv_k = (lambda t: np_quantize(key[t], ks)) if fp8 else (lambda t: key[t])
    conv_v = (lambda t: np_quantize(value[t], vs)) if fp8 else (lambda t: value[t])
    want = expect_rows(kc, slots, conv_k), expect_rows(vc, slots, conv_v)
    problems = []
    for backend in (GPU, "reference"):
        def call(k, v, a, b, s, backend=backend):
            return reshape_and_cache_flash(k, v, a, b, s, *args, backend=backend)

        fn = jax.jit(call) if jit else call
        s_in = slots
        if int64:
            with jax.enable_x64(True):
                got = fn(key, value, kc, vc, jnp.asarray(slots, jnp.int64))
                got = [np.asarray(g) for g in got]
        else:
            got = [np.asarray(g) for g in fn(key, value, kc, vc, s_in)]
        for label, g, w in (("key_cache", got[0], want[0]), ("value_cache", got[1], want[1])):
            d = same_bits(g, w)
            if d:
                problems.append(f"{backend} {label}: {d}")
    return "; ".join(problems)


NB, BS = 1024, 16
SAT_EDGES = [448.0, -448.0, 449.0, -449.0, 464.0, -480.0, 1e5, -1e5, np.inf, -np.inf, np.nan,
             1.0625, 1.1875, -0.0, 90.0, -90.0, 2.0**-10, 2.0**-9 * 1.5]


@case("flash bf16 decode T=64 H=8 D=128, PAD mixed in")
def _():
    return check_flash(0, T=64, H=8, D=128, nb=NB, bs=BS, dtype=ml_dtypes.bfloat16)


@case("flash f32 prefill T=4096 H=4 D=64, PAD mixed in")
def _():
    return check_flash(1, T=4096, H=4, D=64, nb=NB, bs=BS, dtype=np.float32, pad_frac=0.1)


@case("flash fp16 H=3 D=80 (H*D=240, not a power of two)")
def _():
    return check_flash(2, T=37, H=3, D=80, nb=64, bs=16, dtype=np.float16)


@case("flash all PAD: caches bitwise unchanged (block 0 stays NaN)")
def _():
    return check_flash(3, T=64, H=8, D=128, nb=64, bs=BS, dtype=ml_dtypes.bfloat16,
                       slots=np.full((64,), PAD_SLOT_ID, np.int32))


@case("flash N < T (slot mapping shorter than key)")
def _():
    return check_flash(4, T=64, H=8, D=128, nb=64, bs=BS, n=23, dtype=ml_dtypes.bfloat16)


@case("flash last slot of the last block, negative non -1 slots")
def _():
    slots = np.asarray([64 * BS - 1, -2, (64 - 1) * BS, -(2**31), 17, -1, 5 * BS + 3, -7], np.int32)
    return check_flash(5, T=8, H=8, D=128, nb=64, bs=BS, dtype=ml_dtypes.bfloat16, slots=slots)


@case("flash under jit: out-of-range slots write nothing")
def _():
    slots = np.asarray([64 * BS, 20, 64 * BS + 5, 2**31 - 1, 33, -1, 64 * BS * 4, 40], np.int32)
    return check_flash(6, T=8, H=8, D=128, nb=64, bs=BS, dtype=ml_dtypes.bfloat16, slots=slots, jit=True)


@case("flash int64 slot mapping (x64), incl. 2**32 + 5 under jit")
def _():
    slots = np.asarray([2**32 + 5, 20, -1, 33, 2**40, 40, -(2**33), 41], np.int64)
    return check_flash(7, T=8, H=8, D=128, nb=64, bs=BS, dtype=ml_dtypes.bfloat16, slots=slots,
                       jit=True, int64=True)


@case("flash fp8 per-head scales, saturation/NaN/inf/ties, bf16 input")
def _():
    k_scale = np.linspace(0.5, 1.5, 8).astype(np.float32)
    k_scale[0] = 0.9  # +-90 / 0.9 == +-100: an fp8 tie
    v_scale = np.full((8,), 0.3, np.float32)
    return check_flash(8, T=64, H=8, D=128, nb=NB, bs=BS, dtype=ml_dtypes.bfloat16, fp8=True,
                       k_scale=k_scale, v_scale=v_scale, edges=SAT_EDGES)


@case("flash fp8 scalar scales, f32 input, 4096 tokens")
def _():
    return check_flash(9, T=4096, H=8, D=128, nb=NB, bs=BS, dtype=np.float32, fp8=True,
                       k_scale=np.float32(0.37), v_scale=np.asarray([1.9], np.float32),
                       edges=SAT_EDGES, pad_frac=0.05)


def check_mla(seed, *, T, L, R, nb, bs, dtype, fp8, n=None):
    rng = np.random.default_rng(seed)
    n = T if n is None else n
    kv_c = (rng.standard_normal((T, L)) * 100).astype(dtype)
    k_pe = (rng.standard_normal((T, R)) * 100).astype(dtype)
    k_pe[0, :5] = [np.inf, -np.inf, np.nan, 1000.0, -90.0]
    cache = poisoned(rng, (nb, bs, L + R), FP8 if fp8 else dtype)
    slots = slot_mapping(rng, n, nb * bs, 0.2, avoid_block0_of=bs)
    scale = np.asarray([0.9], np.float32)
    args = ("fp8", scale) if fp8 else ()

    def row(t):
        r = np.concatenate([kv_c[t], k_pe[t]])
        return np_quantize(r, scale) if fp8 else r

    want = expect_rows(cache, slots, row)
    problems = []
    for backend in (GPU, "reference"):
        got = np.asarray(concat_and_cache_mla(kv_c, k_pe, cache, slots, *args, backend=backend))
        d = same_bits(got, want)
        if d:
            problems.append(f"{backend}: {d}")
    return "; ".join(problems)


@case("mla bf16 L=512 R=64")
def _():
    return check_mla(10, T=64, L=512, R=64, nb=256, bs=BS, dtype=ml_dtypes.bfloat16, fp8=False)


@case("mla fp8 L=512 R=64, N < T")
def _():
    return check_mla(11, T=64, L=512, R=64, nb=256, bs=BS, dtype=ml_dtypes.bfloat16, fp8=True, n=50)


def check_zero(seed, *, r, ids, jit=False, config=ZeroBlocksConfig()):
    rng = np.random.default_rng(seed)
    nkb = 64
    specs = [((nkb, BS, 8, 128), ml_dtypes.bfloat16), ((nkb, BS, 8, 128), ml_dtypes.bfloat16),
             ((nkb, BS, 576), FP8), ((nkb, 7), np.float32), ((nkb, 3, 5), np.int32)]
    arrays = []
    for shape, dt in specs:
        if np.dtype(dt) == np.int32:
            a = rng.integers(1, 100, size=shape).astype(np.int32)
            a[0] = -1
        else:
            a = poisoned(rng, shape, dt)
            if np.dtype(dt) == np.dtype(FP8):
                a.view(np.uint8)[a.view(np.uint8) == 0] = 1  # no zero bytes to start with
        arrays.append(a)
    ids = np.asarray(ids, np.int32)
    want = [a.copy() for a in arrays]
    for b in ids.tolist():
        if 0 <= b < nkb // r:
            for w in want:
                w[b * r : b * r + r] = 0
    problems = []
    for backend in (GPU, "reference"):
        def call(a, i, backend=backend):
            return zero_blocks(a, i, kernel_blocks_per_block=r, backend=backend, config=config)

        got = (jax.jit(call) if jit else call)(arrays, ids)
        for k, (g, w) in enumerate(zip(got, want)):
            d = same_bits(np.asarray(g), w)
            if d:
                problems.append(f"{backend} caches[{k}]: {d}")
    return "; ".join(problems)


@case("zero_blocks r=1, padding ids, 5 arrays of 4 dtypes")
def _():
    return check_zero(12, r=1, ids=[3, -1, 63, 17, -1, -1])


@case("zero_blocks r=4, repeated id, last logical block")
def _():
    return check_zero(13, r=4, ids=[15, 2, 2, -1])


@case("zero_blocks all padding: arrays bitwise unchanged")
def _():
    return check_zero(14, r=2, ids=[-1, -1, -1])


@case("zero_blocks under jit: out-of-range ids zero nothing")
def _():
    return check_zero(15, r=2, ids=[32, 5, 2**31 - 1, -1], jit=True)


@case("zero_blocks with 3 programs a call: each loops over every 3rd column tile")
def _():
    return check_zero(16, r=4, ids=[-1, 9, 2, -1], config=ZeroBlocksConfig(gpu_max_programs=3,
                                                                          gpu_tile_bytes=512))


# --------------------------------------------------------------------------
# in place: donation, aliasing, temporary memory
# --------------------------------------------------------------------------


def in_place_report():
    """Donated caches must come back in the same buffers, with no cache-sized temporaries."""
    print("\n-- in-place check (donated caches) --", flush=True)
    ok = True
    T, H, D, nb = 64, 8, 128, 4096
    rng = np.random.default_rng(20)
    key = jnp.asarray(rng.standard_normal((T, H, D)), jnp.bfloat16)
    slots = jnp.asarray(slot_mapping(rng, T, nb * BS, 0.2, avoid_block0_of=BS))
    for backend in (GPU, "reference"):
        for mode, cdt in (("auto", jnp.bfloat16), ("fp8", jnp.float8_e4m3fn)):
            def call(k, v, kc, vc, s, backend=backend, mode=mode):
                return reshape_and_cache_flash(k, v, kc, vc, s, mode, 1.0, 1.0, backend=backend)

            fn = jax.jit(call, donate_argnums=(2, 3))
            kc = jnp.zeros((nb, BS, H, D), cdt)
            vc = jnp.zeros((nb, BS, H, D), cdt)
            cache_bytes = kc.size * kc.dtype.itemsize
            compiled = fn.lower(key, key, kc, vc, slots).compile()
            mem = compiled.memory_analysis()
            aliased = "input_output_alias" in compiled.as_text()
            before = (kc.unsafe_buffer_pointer(), vc.unsafe_buffer_pointer())
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = fn(key, key, kc, vc, slots)
                jax.block_until_ready(out)
            after = (out[0].unsafe_buffer_pointer(), out[1].unsafe_buffer_pointer())
            donate_warn = [str(w.message)[:120] for w in caught if "donat" in str(w.message).lower()]
            temp = mem.temp_size_in_bytes if mem is not None else -1
            good = before == after and aliased and 0 <= temp < cache_bytes // 8 and not donate_warn
            if backend == GPU:
                ok &= good
            tag = "PASS" if good else ("FAIL" if backend == GPU else "INFO")
            print(
                f"{tag} in-place {backend:10s} {mode:4s}: same buffers={before == after} "
                f"hlo input_output_alias={aliased} temp={temp} B alias={getattr(mem, 'alias_size_in_bytes', -1)} B "
                f"cache={cache_bytes} B donation warnings={donate_warn}",
                flush=True,
            )
    # zero_blocks
    for backend in (GPU, "reference"):
        arrays = [jnp.zeros((4096, BS, H, D), jnp.bfloat16), jnp.zeros((4096, BS, 576), jnp.float8_e4m3fn)]
        fn = jax.jit(lambda a, i, backend=backend: zero_blocks(a, i, kernel_blocks_per_block=2, backend=backend),
                     donate_argnums=0)
        ids = jnp.asarray([5, -1, 9], jnp.int32)
        mem = fn.lower(arrays, ids).compile().memory_analysis()
        before = [a.unsafe_buffer_pointer() for a in arrays]
        out = fn(arrays, ids)
        jax.block_until_ready(out)
        after = [o.unsafe_buffer_pointer() for o in out]
        smallest = 4096 * BS * 576
        good = before == after and mem.temp_size_in_bytes < smallest // 8
        if backend == GPU:
            ok &= good
        tag = "PASS" if good else ("FAIL" if backend == GPU else "INFO")
        print(f"{tag} in-place zero_blocks {backend}: same buffers={before == after} "
              f"temp={mem.temp_size_in_bytes} B smallest array={smallest} B", flush=True)
    RESULTS.append(("in-place", ok, ""))


def timing_report():
    """Decode-sized write, GPU kernel vs reference (median of 50 synchronised calls). Informational."""
    print("\n-- decode timing (informational) --", flush=True)
    T, H, D, nb = 64, 8, 128, 8192
    rng = np.random.default_rng(30)
    key = jnp.asarray(rng.standard_normal((T, H, D)), jnp.bfloat16)
    slots = jnp.asarray(slot_mapping(rng, T, nb * BS, 0.0, avoid_block0_of=BS))
    for mode, cdt in (("auto", jnp.bfloat16), ("fp8", jnp.float8_e4m3fn)):
        for backend in (GPU, "reference"):
            fn = jax.jit(lambda k, v, kc, vc, s, b=backend, m=mode: reshape_and_cache_flash(
                k, v, kc, vc, s, m, 1.0, 1.0, backend=b), donate_argnums=(2, 3))
            kc, vc = jnp.zeros((nb, BS, H, D), cdt), jnp.zeros((nb, BS, H, D), cdt)
            for _ in range(5):
                kc, vc = fn(key, key, kc, vc, slots)
            jax.block_until_ready(kc)
            times = []
            for _ in range(50):
                t0 = time.perf_counter()
                kc, vc = fn(key, key, kc, vc, slots)
                jax.block_until_ready(kc)
                times.append(time.perf_counter() - t0)
            print(f"time {mode:4s} {backend:10s}: median {np.median(times) * 1e6:8.1f} us "
                  f"(host-synchronised, includes dispatch)", flush=True)


def fp8_reference_diagnosis():
    """Where plain XLA on this device departs from saturate(x / scale) -> fp8 (informational).

    Counts elements whose bits differ from numpy/ml_dtypes for each step,
    each compiled alone: float32 division (plain, and by a broadcast scale,
    which XLA rewrites as a multiply by the reciprocal), kv_write's integer
    ieee_divide, and the float32 -> float8_e4m3fn conversion. The first two
    are why the reference divides with ieee_divide.
    """
    from pallas_kernels.kv_write import ieee_divide, quantize_fp8

    print("\n-- reference fp8 diagnosis (informational) --", flush=True)
    rng = np.random.default_rng(40)
    n, h = 1 << 20, 8
    x32 = (rng.standard_normal((n // h, h)) * 100).astype(np.float32)
    xbf = x32.astype(ml_dtypes.bfloat16)
    s_head = np.asarray([0.5, 0.642857, 0.9, 0.37, 1.0714, 1.2142, 1.3571, 1.5], np.float32)
    s_full = np.broadcast_to(s_head, x32.shape).copy()

    def count(name, got, want):
        d = int((bits(np.asarray(got)) != bits(np.asarray(want))).sum())
        print(f"INFO diag {name:58s}: {d} of {np.asarray(want).size} differ", flush=True)

    exact_f32 = lambda x: np.asarray(x, np.float32) / s_full  # noqa: E731
    count("f32 x / s, s a same-shape argument (no broadcast)",
          jax.jit(lambda x, s: x / s)(x32, s_full), exact_f32(x32))
    count("f32 x / broadcast(s)",
          jax.jit(lambda x, s: x / s[None, :])(x32, s_head), exact_f32(x32))
    count("f32 ieee_divide(x, broadcast(s)) (integer long division)",
          jax.jit(ieee_divide)(x32, s_head[None, :]), exact_f32(x32))
    xr = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    sr = rng.integers(0x00800000, 0x7F800000, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    with np.errstate(all="ignore"):
        want_r = xr / sr
    got_r = np.asarray(jax.jit(ieee_divide)(xr, sr))
    same = (bits(got_r) == bits(want_r)) | (np.isnan(got_r) & np.isnan(want_r))
    print(f"INFO diag {'f32 ieee_divide on random bit patterns':58s}: {int((~same).sum())} of {n} differ",
          flush=True)
    # Conversion alone: values at, and 1-3 ulps around, every fp8 midpoint, plus random ones.
    mids = (np.arange(0, 0x7E, dtype=np.uint8).view(FP8).astype(np.float32)
            + np.arange(1, 0x7F, dtype=np.uint8).view(FP8).astype(np.float32)) / 2
    near = (mids[:, None].view(np.int32) + np.arange(-3, 4, dtype=np.int32)[None, :]).view(np.float32)
    y = np.concatenate([near.ravel(), -near.ravel(), x32.ravel()[:65536] / 4]).astype(np.float32)
    y = np.clip(y, -448, 448)
    count("f32 -> float8_e4m3fn convert (near midpoints + random)",
          jax.jit(lambda v: v.astype(jnp.float8_e4m3fn))(y), y.astype(FP8))
    want = np.clip(exact_f32(xbf.astype(np.float32)), -448, 448).astype(FP8)
    count("quantize_fp8(bf16 x, per-head s) as in the reference",
          jax.jit(quantize_fp8)(xbf, s_head[None, :]), want)
    want32 = np.clip(exact_f32(x32), -448, 448).astype(FP8)
    count("quantize_fp8(f32 x, per-head s) as in the reference",
          jax.jit(quantize_fp8)(x32, s_head[None, :]), want32)


def main() -> int:
    if not on_gpu_or_allowed("the compiled GPU kernels"):
        return 1
    run_cases()
    try:
        in_place_report()
    except Exception:  # noqa: BLE001
        print("FAIL in-place check:\n" + traceback.format_exc(limit=6), flush=True)
        RESULTS.append(("in-place", False, "exception"))
    try:
        fp8_reference_diagnosis()
    except Exception:  # noqa: BLE001
        print("diagnosis failed (informational):\n" + traceback.format_exc(limit=4), flush=True)
    try:
        timing_report()
    except Exception:  # noqa: BLE001
        print("timing failed (informational):\n" + traceback.format_exc(limit=4), flush=True)
    return summary()


if __name__ == "__main__":
    sys.exit(main())
