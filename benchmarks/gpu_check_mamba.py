"""GPU check of the Mamba kernels: compiled GPU flavour vs the jnp reference, on the device.

Run on the GPU machine from the repository root:

    PYTHONPATH=. python benchmarks/gpu_check_mamba.py

Prints one ``PASS``/``FAIL`` line per case and exits non-zero if any case failed.
Cases: random shapes (power-of-two and not), grouped B/C, per-head dt/A, the
speculative and varlen paths, bf16 state, out-of-range indices under jit, and
NaN-poisoned null / unused state rows that must stay bitwise unchanged. Then a
few timings (informational lines, ``TIME``) and an in-place check (no whole-pool
copy per call when the pool is donated).

``--interpret`` runs the GPU kernels through the generic Pallas interpreter (on a
CPU), with smaller sizes, to dry-run this script without a GPU.

Recorded runs (NVIDIA H100 80GB HBM3, jax 0.11.2, Pallas Triton lowering): all 15
checks PASS (13 correctness cases, 2 in-place checks), with the first SSU kernel and,
on 2026-11-22, with the one of BENCHMARKS.md; on 2026-11-28, 18/18 with the case of the
decode operands as ``Columns`` of one projection (``benchmarks/results/2026-11-28-h100-checks-mamba-columns.log``) (32 rows of dim per program, no zero-filled
output). Timings, per call, donated pool, 20 iterations, host-synchronised (the
device-side figures are in BENCHMARKS.md):

* ssu decode b=64 H=32 P=64 N=128 (L=256): first kernel: reference 111 / 116 us, GPU
  kernel 88 / 86 us; 2026-11-22 (run beside the other two checks): reference 117 us,
  GPU kernel 97 us. GPU kernel temp memory 512 B vs a 256 MiB pool (in place).
* conv decode b=64 dim=4352 W=4: reference 47 / 41 / 59 us, GPU kernel 47 / 77 / 50 us
  (noisy; not settled).
* prefill scan T=2048 R=8 H=8 P=64 N=128: token scan 16.6 / 17.0 ms; chunked 0.63 /
  0.58 ms (Q=64), 0.42 / 0.43 ms (Q=128), 0.43 / 0.44 ms (Q=256).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.mamba_scan import ScanConfig
from pallas_kernels.mamba import (
    Columns,
    causal_conv1d_update,
    causal_conv1d_varlen,
    selective_scan_varlen,
    selective_state_update,
)

NULL = 0
RESULTS: list[tuple[str, bool]] = []


def bits(a):
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def close(got, want, rtol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(1.0, float(np.nanmax(np.abs(want))) if want.size else 1.0)
    err = np.abs(got - want)
    ok = bool(np.all(err <= rtol * scale + rtol * np.abs(want)))
    return ok, float(np.max(err) / scale) if err.size else 0.0


def case(name):
    """Decorator that runs the decorated function at once as check `name`, recording PASS/FAIL."""
    def deco(fn):
        try:
            msg = fn()
            RESULTS.append((name, True))
            print(f"PASS {name}" + (f"  ({msg})" if msg else ""), flush=True)
        except Exception as e:  # noqa: BLE001 - report every failure and go on
            RESULTS.append((name, False))
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(limit=3)
        return fn
    return deco


def require(cond, what):
    if not cond:
        raise AssertionError(what)


def f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def poison(a, rows):
    a = np.array(a)
    for r in rows:
        a[r] = np.nan
    return a


def check_state(new, ref, old, touched, rtol, what="state"):
    """Touched rows close to the reference; every other row bitwise equal to the input."""
    new, ref, old = np.asarray(new), np.asarray(ref), np.asarray(old)
    worst = 0.0
    for r in range(old.shape[0]):
        if r in touched:
            ok, e = close(new[r], ref[r], rtol)
            require(ok, f"{what} row {r} differs from reference (rel err {e:.2e})")
            worst = max(worst, e)
        else:
            require(np.array_equal(bits(new[r]), bits(old[r])), f"{what} row {r} (untouched) changed")
    return worst


# --------------------------------------------------------------------------- #
# selective_state_update
# --------------------------------------------------------------------------- #


def ssu_inputs(rng, T, H, P, N, G, L, tied=False, heads=True):
    c = dict(
        x=f32(rng, T, H, P), dt=f32(rng, T, H, 1 if tied else P, scale=0.5),
        A=-np.exp(f32(rng, H, 1 if tied else P, 1 if tied else N, scale=0.5)),
        B=f32(rng, T, G, N), C=f32(rng, T, G, N), D=f32(rng, H, 1 if tied else P),
        dt_bias=f32(rng, H, 1 if tied else P, scale=0.5), z=f32(rng, T, H, P))
    state = f32(rng, L, H, P, N)
    if not heads:
        c = {k: v[:, 0] if k in ("x", "dt", "z", "B", "C") else v[0] for k, v in c.items()}
        state = state[:, 0]
    return c, state


def run_ssu(backend, interpret, state, c, **kw):
    out, st = selective_state_update(jnp.asarray(state), c["x"], c["dt"], c["A"], c["B"], c["C"],
                                     D=c["D"], dt_bias=c["dt_bias"], z=c["z"], dt_softplus=True,
                                     backend=backend, interpret=interpret, **kw)
    return jax.block_until_ready((out, st))


def ssu_compare(name, rng, interp, *, T, H, P, N, G, L, sbi=None, dsbi=None, na=None, cu=None,
                tied=False, heads=True, dtype=np.float32, rtol=2e-5, srtol=2e-5):
    @case(name)
    def _():
        c, state = ssu_inputs(rng, T, H, P, N, G, L, tied, heads)
        used = set(np.asarray(sbi).ravel().tolist()) | set(np.asarray(dsbi if dsbi is not None else sbi).ravel().tolist())
        unused = [r for r in range(L) if r not in used or r == NULL]
        state = poison(state.astype(dtype), unused)
        kw = dict(state_batch_indices=sbi, dst_state_batch_indices=dsbi, num_accepted_tokens=na,
                  cu_seqlens=cu)
        o_ref, s_ref = run_ssu("reference", None, state, c, **kw)
        o_gpu, s_gpu = run_ssu("pallas_gpu", interp, state, c, **kw)
        require(np.isfinite(np.asarray(o_gpu)).all(), "non-finite output (null row read the poisoned row?)")
        ok, e = close(o_gpu, o_ref, rtol)
        require(ok, f"out differs (rel err {e:.2e})")
        touched = set(range(L)) - set(unused)
        e2 = check_state(s_gpu, s_ref, state, touched, srtol)
        return f"out err {e:.1e}, state err {e2:.1e}"


def ssu_cases(rng, interp, big):
    L = 64 if big else 12
    b = 32 if big else 4
    rows = rng.permutation(np.arange(1, L))
    sbi = rows[:b].astype(np.int32)
    sbi[rng.random(b) < 0.25] = NULL
    H, P, N = (8, 64, 128) if big else (2, 8, 16)
    ssu_compare("ssu mamba2 decode (tied dt/A, null padding)", rng, interp, T=b, H=H, P=P, N=N,
                G=1, L=L, sbi=sbi, tied=True)
    ssu_compare("ssu untied, grouped B/C", rng, interp, T=b, H=H, P=P, N=N, G=2, L=L, sbi=sbi)
    ssu_compare("ssu non-pow2 dim/dstate, no heads", rng, interp, T=b, H=1, P=5 if not big else 48,
                N=7 if not big else 100, G=1, L=L, sbi=sbi, heads=False)
    ssu_compare("ssu bf16 state", rng, interp, T=b, H=H, P=P, N=N, G=1, L=L, sbi=sbi,
                dtype=jnp.bfloat16, srtol=1e-2)
    # speculative varlen: num_accepted 0, 1, max; null dst columns; padded row; empty sequence
    W = 3
    lens = np.array([3, 0, 2, 3, 1])
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    n = len(lens)
    src = np.zeros((n, W), np.int32)
    dst = np.zeros((n, W), np.int32)
    na = np.array([0, 1, 3, 2, 1], np.int32)
    fresh = iter(rng.permutation(np.arange(1, L)).tolist())
    for i in range(n):
        if i == 4:
            continue  # padded row: all null
        src[i, max(na[i] - 1, 0)] = next(fresh)
        for j in range(lens[i]):
            dst[i, j] = next(fresh) if (i, j) != (3, 1) else NULL
    ssu_compare("ssu spec varlen num_accepted 0/1/max", rng, interp, T=int(cu[-1]), H=H, P=P, N=N,
                G=1, L=L, sbi=src, dsbi=dst, na=na, cu=cu, tied=True)

    @case("ssu jit out-of-range indices masked")
    def _():
        c, state = ssu_inputs(rng, 4, H, P, N, 1, 8, tied=True)
        state = poison(state, [0, 2, 4, 5, 6, 7])
        fn = jax.jit(lambda s, i: selective_state_update(
            s, c["x"], c["dt"], c["A"], c["B"], c["C"], D=c["D"], state_batch_indices=i,
            backend="pallas_gpu", interpret=interp))
        ref = jax.jit(lambda s, i: selective_state_update(
            s, c["x"], c["dt"], c["A"], c["B"], c["C"], D=c["D"], state_batch_indices=i,
            backend="reference"))
        idx = jnp.array([3, 8 + 100, -1, 1], jnp.int32)
        o, s = jax.block_until_ready(fn(jnp.asarray(state), idx))
        o2, s2 = ref(jnp.asarray(state), idx)
        require(np.isfinite(np.asarray(o)).all(), "non-finite output")
        ok, e = close(o, o2, 2e-5)
        require(ok, f"out differs (rel err {e:.2e})")
        check_state(s, s2, state, {1, 3}, 2e-5)

    @case("ssu varlen under jit: tokens outside every sequence are 0 (out is not pre-filled)")
    def _():
        T = 8
        c, state = ssu_inputs(rng, T, H, P, N, 1, 8, tied=True)
        state = poison(state, [0, 1, 2, 3, 6, 7])
        sbi = np.array([4, 5], np.int32)
        outs = {}
        for backend, interpret in (("pallas_gpu", interp), ("reference", None)):
            outs[backend] = jax.jit(lambda s, cu, be=backend, it=interpret: selective_state_update(
                s, c["x"], c["dt"], c["A"], c["B"], c["C"], D=c["D"], z=c["z"],
                state_batch_indices=sbi, dst_state_batch_indices=sbi, cu_seqlens=cu,
                backend=be, interpret=it))
        # before cu[0]; after cu[N]; after a bad offset (past T, decreasing, negative)
        for cu in ([2, 4, 5], [0, 3, 3], [0, 3, 20], [1, 4, 2], [-1, 3, 4]):
            cu = np.array(cu, np.int32)
            o, s = jax.block_until_ready(outs["pallas_gpu"](jnp.asarray(state), cu))
            o2, s2 = outs["reference"](jnp.asarray(state), cu)
            o, o2 = np.asarray(o, np.float32), np.asarray(o2, np.float32)
            zero = ~np.asarray(o2 != 0).any(axis=(1, 2))
            require(not o[zero].any(), f"cu={cu.tolist()}: tokens outside the sequences not 0")
            ok, e = close(o, o2, 2e-5)
            require(ok, f"cu={cu.tolist()}: out differs (rel err {e:.2e})")
            check_state(s, s2, state, {4, 5}, 2e-5)


# --------------------------------------------------------------------------- #
# causal_conv1d_update
# --------------------------------------------------------------------------- #


def conv_compare(name, rng, interp, x, cs, w, bias, act, rows, na=None, qsl=None, mql=-1,
                 rtol=2e-5):
    @case(name)
    def _():
        used = set(np.asarray(rows).ravel().tolist())
        unused = [r for r in range(cs.shape[0]) if r not in used or r == NULL]
        cs_p = poison(cs, unused)
        args = (x, None, w, bias, act, rows, na, qsl, mql)

        def go(backend, interpret):
            a = list(args)
            a[1] = jnp.asarray(cs_p)
            return jax.block_until_ready(causal_conv1d_update(*a, backend=backend, interpret=interpret))

        o_ref, s_ref = go("reference", None)
        o_gpu, s_gpu = go("pallas_gpu", interp)
        ok, e = close(o_gpu, o_ref, rtol)
        require(ok, f"out differs (rel err {e:.2e})")
        # outputs of null sequences (and varlen pad tokens) must equal x bitwise
        r0 = np.asarray(rows) if np.ndim(rows) == 1 else np.asarray(rows)[:, 0]
        keep = np.zeros(np.shape(x)[0], bool)
        if qsl is None:
            keep[r0 == NULL] = True
        else:
            keep[int(qsl[-1]):] = True
            for i in np.flatnonzero(r0 == NULL):
                keep[qsl[i]:qsl[i + 1]] = True
        require(np.array_equal(bits(np.asarray(o_gpu)[keep]), bits(np.asarray(x)[keep])),
                "null-row / pad outputs differ from x")
        e2 = check_state(s_gpu, s_ref, cs_p, set(range(cs.shape[0])) - set(unused), rtol, "conv_state")
        return f"out err {e:.1e}, state err {e2:.1e}"


def conv_cases(rng, interp, big):
    dim = 1000 if big else 12
    W, L = 4, 40 if big else 10
    b = 32 if big else 4
    rows = rng.permutation(np.arange(1, L))[:b].astype(np.int32)
    rows[rng.random(b) < 0.25] = NULL
    w, bias = f32(rng, dim, W), f32(rng, dim)
    conv_compare("conv 1 token, null padding, silu", rng, interp, f32(rng, b, dim),
                 f32(rng, L, dim, W - 1), w, bias, "silu", rows)
    conv_compare("conv seqlen 3, wide state, no bias", rng, interp, f32(rng, b, dim, 3),
                 f32(rng, L, dim, W + 2), w, None, None, rows)
    conv_compare("conv bf16 state", rng, interp, f32(rng, b, dim),
                 np.asarray(jnp.asarray(f32(rng, L, dim, W - 1)).astype(jnp.bfloat16)), w, bias,
                 "silu", rows, rtol=2e-2)
    q = 3
    lens = np.array([3, 0, 2, 1, 3])
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    x = f32(rng, int(qsl[-1]) + 2, dim)  # + 2 pad tokens
    vrows = np.array([5, 2, NULL, 7, 3], np.int32)
    na = np.array([3, 1, 1, 0, 2], np.int32)
    conv_compare("conv spec varlen num_accepted 0/1/max", rng, interp, x,
                 f32(rng, L, dim, W - 1 + q - 1), w, bias, True, vrows, na=na, qsl=qsl, mql=q)

    @case("conv jit out-of-range indices masked")
    def _():
        x = f32(rng, 3, dim)
        cs = poison(f32(rng, 5, dim, W - 1), [0, 1, 3, 4])
        fn = jax.jit(lambda s, r: causal_conv1d_update(x, s, w, bias, "silu", r,
                                                       backend="pallas_gpu", interpret=interp))
        o, s = jax.block_until_ready(fn(jnp.asarray(cs), jnp.array([50, 2, -2], jnp.int32)))
        o2, s2 = causal_conv1d_update(x, jnp.asarray(cs), w, bias, "silu", np.array([0, 2, 0], np.int32),
                                      backend="reference")
        require(np.array_equal(bits(np.asarray(o)[[0, 2]]), bits(x[[0, 2]])), "masked rows changed out")
        ok, e = close(np.asarray(o)[1], np.asarray(o2)[1], 2e-5)
        require(ok, f"out differs ({e:.2e})")
        check_state(s, s2, cs, {2}, 2e-5, "conv_state")


def columns_cases(rng, interp, big):
    """The decode-only step's operands as Columns of one projection ``[z | xBC | dt]`` (Granite's
    head shapes when ``big``): conv and SSM under one jit with the projection donated, bitwise
    what the same kernels give for the sliced arrays; the columns no operand names unchanged."""
    H, P, N, G = (48, 64, 128, 1) if big else (2, 4, 8, 1)
    T, W, L = (16, 4, 40) if big else (3, 4, 6)
    di, cd = H * P, H * P + 2 * G * N
    width = di + cd + H
    parent = f32(rng, T, width)
    rows = rng.permutation(np.arange(1, L))[:T].astype(np.int32)
    rows[rng.random(T) < 0.25] = NULL
    cs, st = f32(rng, L, cd, W - 1), f32(rng, L, H, P, N)
    w, bias = f32(rng, cd, W), f32(rng, cd)
    A, D, dtb = -np.exp(f32(rng, H, 1, 1, scale=0.5)), f32(rng, H, 1), f32(rng, H, 1, scale=0.5)

    def step(par, cs, st, views):
        xbc = Columns(par, di, (T, cd)) if views else par[:, di:di + cd]
        out, cs = causal_conv1d_update(xbc, cs, w, bias, "silu", rows, backend="pallas_gpu", interpret=interp)
        if views:
            p = out.parent
            ops = (Columns(p, di, (T, H, P)), Columns(p, di + cd, (T, H, 1)), Columns(p, 2 * di, (T, G, N)),
                   Columns(p, 2 * di + G * N, (T, G, N)), Columns(p, 0, (T, H, P)))
        else:
            p = par
            ops = (out[:, :di].reshape(T, H, P), par[:, di + cd:].reshape(T, H, 1),
                   out[:, di:di + G * N].reshape(T, G, N), out[:, di + G * N:].reshape(T, G, N),
                   par[:, :di].reshape(T, H, P))
        x, dt, B, C, z = ops
        # A: column 1 of a [H, 3] table of rates (as the hybrid hands each layer its column)
        a = Columns(jnp.concatenate([jnp.full((H, 1), jnp.nan), jnp.asarray(A).reshape(H, 1),
                                     jnp.full((H, 1), jnp.nan)], 1), 1, (H, 1, 1)) if views else A
        y, st = selective_state_update(st, x, dt, a, B, C, D=D, dt_bias=dtb, z=z, dt_softplus=True,
                                       state_batch_indices=rows, backend="pallas_gpu", interpret=interp)
        return (out.parent if views else out), cs, st, y

    @case(f"columns of one projection read in place (T={T} H={H} P={P} N={N})")
    def _():
        got = jax.jit(lambda a, b, c: step(a, b, c, True), donate_argnums=(0, 1, 2))(
            jnp.asarray(parent), jnp.asarray(cs), jnp.asarray(st))
        want = jax.jit(lambda a, b, c: step(a, b, c, False))(jnp.asarray(parent), jnp.asarray(cs), jnp.asarray(st))
        got_par, got_cs, got_st, got_y = (np.asarray(v) for v in got)
        want_out, want_cs, want_st, want_y = (np.asarray(v) for v in want)
        require(np.array_equal(bits(got_par[:, di:di + cd]), bits(want_out)), "conv out differs")
        keep = np.r_[0:di, di + cd:width]
        require(np.array_equal(bits(got_par[:, keep]), bits(parent[:, keep])), "z / dt columns changed")
        require(np.array_equal(bits(got_cs), bits(want_cs)), "conv_state differs")
        require(np.array_equal(bits(got_st), bits(want_st)), "ssm state differs")
        require(np.array_equal(bits(got_y), bits(want_y)), "ssm out differs")


# --------------------------------------------------------------------------- #
# prefill (jnp on the device): chunked scan vs token scan, conv varlen
# --------------------------------------------------------------------------- #


def prefill_cases(rng, big):
    T, H, P, N, L = (600, 8, 64, 64, 16) if big else (40, 2, 4, 8, 8)

    @case("scan chunked vs token scan (fresh NaN slot, null row, pad)")
    def _():
        x, dt = f32(rng, T, H, P), f32(rng, T, H, scale=0.5)
        A = -np.exp(f32(rng, H, scale=0.5))
        B, C = f32(rng, T, 2, N), f32(rng, T, 2, N)
        state = f32(rng, L, H, P, N)
        cuts = np.sort(rng.choice(np.arange(1, T - 5), 4, replace=False))
        qsl = np.concatenate([[0], cuts, [T - 5]]).astype(np.int32)  # 5 pad tokens
        ci = np.array([3, NULL, 5, 6, 2], np.int32)
        his = np.array([False, True, True, False, True])
        state = poison(state, [0, 1, 3, 4, 6] + list(range(7, L)))  # 3, 6: fresh requests
        args = (x, dt, A, B, C)
        D = f32(rng, H)
        o1, s1 = selective_scan_varlen(*args, jnp.asarray(state), qsl, ci, his, D=D,
                                       dt_softplus=True, backend="reference")
        o2, s2 = selective_scan_varlen(*args, jnp.asarray(state), qsl, ci, his, D=D,
                                       dt_softplus=True, backend="pallas_gpu")
        o3, s3 = selective_scan_varlen(*args, jnp.asarray(state), qsl, ci, his, D=D,
                                       dt_softplus=True, backend="pallas_tpu")  # the jnp chunked form
        ok3, e3 = close(o2, o3, 1e-4)
        require(ok3, f"kernel and jnp chunked form differ ({e3:.2e})")
        require(np.isfinite(np.asarray(o2)).all(), "non-finite output")
        require(not np.asarray(o2)[qsl[1]:qsl[2]].any() and not np.asarray(o2)[T - 5:].any(),
                "null-row / pad outputs not zero")
        ok, e = close(o2, o1, 1e-4)
        require(ok, f"out differs ({e:.2e})")
        e2 = check_state(s2, s1, state, {2, 3, 5, 6}, 1e-4)
        return f"out err {e:.1e}, state err {e2:.1e}, vs jnp chunked {e3:.1e}"

    @case("scan kernel, bf16 products: the jnp chunked form's rounding, near the token scan")
    def _():
        Tb, Hb, Pb, Nb = (1000, 8, 64, 128) if big else (40, 2, 4, 8)
        x, dt = f32(rng, Tb, Hb, Pb), f32(rng, Tb, Hb, scale=0.5)
        A = -np.exp(f32(rng, Hb, scale=0.5))
        B, C = f32(rng, Tb, 1, Nb), f32(rng, Tb, 1, Nb)
        z = f32(rng, Tb, Hb, Pb)
        state = f32(rng, L, Hb, Pb, Nb)
        qsl = np.array([0, 300, 310, Tb - 7], np.int32) if big else np.array([0, 10, 12, Tb - 3], np.int32)
        ci = np.array([3, 5, 6], np.int32)
        his = np.array([True, False, True])
        kw = dict(D=f32(rng, Hb), z=z, dt_softplus=True)
        run = lambda be, dd: selective_scan_varlen(x, dt, A, B, C, jnp.asarray(state), qsl, ci, his,
                                                  backend=be, dot_dtype=dd, **kw)
        o1, s1 = run("reference", None)
        o2, s2 = run("pallas_gpu", jnp.bfloat16)
        o3, s3 = run("pallas_tpu", jnp.bfloat16)
        ok, e = close(o2, o3, 2e-3)
        require(ok, f"kernel and jnp chunked form differ ({e:.2e})")
        ok, e_out = close(o2, o1, 3e-2)
        require(ok, f"bf16 products too far from the token scan ({e_out:.2e})")
        e_state = check_state(s2, s1, state, {3, 5, 6}, 3e-2)
        return f"kernel vs jnp {e:.1e}; vs token scan: out {e_out:.1e}, state {e_state:.1e}"

    @case("conv varlen vs numpy (fresh NaN slot, null row, pad)")
    def _():
        dim, W = (256, 4) if big else (6, 4)
        x = f32(rng, dim, 30)
        w, bias = f32(rng, dim, W), f32(rng, dim)
        cs = poison(f32(rng, 6, dim, W - 1), [0, 1, 3])
        qsl = np.array([0, 2, 10, 14, 20], np.int32)
        ci = np.array([2, 3, NULL, 5], np.int32)
        his = np.array([True, False, True, True])
        o, s = causal_conv1d_varlen(x, w, bias, jnp.asarray(cs), qsl, ci, his, None)
        o, s = np.asarray(o), np.asarray(s)
        want = x.astype(np.float64).copy()
        for r in (0, 1, 3):
            s0, e0 = qsl[r], qsl[r + 1]
            init = cs[ci[r]].astype(np.float64) if his[r] else np.zeros((dim, W - 1))
            seq = np.concatenate([init, x[:, s0:e0]], 1)
            for i in range(e0 - s0):
                want[:, s0 + i] = (w * seq[:, i:i + W]).sum(1) + bias
            ok, e = close(s[ci[r]], seq[:, -(W - 1):], 2e-5)
            require(ok, f"state row {ci[r]} differs")
        ok, e = close(o, want, 2e-5)
        require(ok, f"out differs ({e:.2e})")
        require(np.array_equal(bits(o[:, 10:14]), bits(x[:, 10:14])) and np.array_equal(bits(o[:, 20:]), bits(x[:, 20:])),
                "skipped tokens changed")
        require(np.array_equal(bits(s[[0, 1, 4]]), bits(cs[[0, 1, 4]])), "untouched rows changed")


# --------------------------------------------------------------------------- #
# timings and in-place check
# --------------------------------------------------------------------------- #


def bench(fn, state, n=20):
    state = fn(state)[1]
    jax.block_until_ready(state)
    t = time.perf_counter()
    for _ in range(n):
        state = fn(state)[1]
    jax.block_until_ready(state)
    return (time.perf_counter() - t) / n * 1e6


def scan_inputs(rng, T, Hs, G):
    xs, dts = jnp.asarray(f32(rng, T, Hs, 64)), jnp.asarray(f32(rng, T, Hs, scale=0.5))
    zs = jnp.asarray(f32(rng, T, Hs, 64))
    A = jnp.asarray(-np.exp(f32(rng, Hs, scale=0.5)))
    B, C = jnp.asarray(f32(rng, T, G, 128)), jnp.asarray(f32(rng, T, G, 128))
    Dv = jnp.asarray(f32(rng, Hs))
    st = f32(rng, 4, Hs, 64, 128)
    qsl, ci, his = jnp.array([0, T], jnp.int32), jnp.array([1], jnp.int32), jnp.zeros((1,), bool)
    return xs, dts, zs, A, B, C, Dv, st, qsl, ci, his


SWEEP = ((1, 64, 256, 4, 2), (4, 64, 256, 4, 2), (1, 32, 256, 4, 2), (1, 128, 256, 4, 2), (1, 128, 256, 8, 2),
         (1, 64, 256, 8, 2), (2, 64, 256, 4, 2), (1, 64, 256, 4, 3), (1, 32, 256, 2, 2), (1, 64, 512, 4, 2))


def scan_sweep(make):
    """The scan kernels' knobs at Granite's 8k prefill (bf16 products and inputs, as a bf16
    model runs them): (heads per program, rows, state block, warps, stages)."""
    xs, dts, zs, A, B, C, Dv, st, qsl, ci, his = make(8192, 64, 1)
    xb, zb, Bb, Cb = (v.astype(jnp.bfloat16) for v in (xs, zs, B, C))
    for hb, bq, be, warps, stages in SWEEP:
        cfg = ScanConfig(gpu_heads_per_program=hb, gpu_block_q=bq, gpu_block_state=be, gpu_num_warps=warps,
                         gpu_num_stages=stages)
        fn = jax.jit(lambda s, cfg=cfg: selective_scan_varlen(
            xb, dts, A, Bb, Cb, s, qsl, ci, his, D=Dv, z=zb, dt_softplus=True,
            dot_dtype=jnp.bfloat16, config=cfg, backend="pallas_gpu"), donate_argnums=0)
        us = bench(fn, jnp.asarray(st), n=5)
        print(f"TIME prefill scan granite T=8192 bf16 inputs kernel heads/program {hb} rows {bq} "
              f"state block {be} warps {warps} stages {stages}: {us / 1e3:.2f} ms", flush=True)


def timings(rng, interp):
    if interp:
        return
    L, b, H, P, N = 256, 64, 32, 64, 128
    c, state = ssu_inputs(rng, b, H, P, N, 1, L, tied=True)
    sbi = jnp.asarray(rng.permutation(np.arange(1, L))[:b].astype(np.int32))
    for backend in ("reference", "pallas_gpu"):
        fn = jax.jit(lambda s, be=backend: selective_state_update(
            s, c["x"], c["dt"], c["A"], c["B"], c["C"], D=c["D"], dt_bias=c["dt_bias"], z=c["z"],
            dt_softplus=True, state_batch_indices=sbi, backend=be), donate_argnums=0)
        us = bench(fn, jnp.asarray(state))
        print(f"TIME ssu decode b={b} H={H} P={P} N={N} {backend}: {us:.1f} us", flush=True)
        mem = fn.lower(jnp.asarray(state)).compile().memory_analysis()
        if mem is not None:
            ok = mem.temp_size_in_bytes < state.nbytes
            RESULTS.append((f"ssu in place ({backend})", ok))
            print(f"{'PASS' if ok else 'FAIL'} ssu in place ({backend}): temp {mem.temp_size_in_bytes} B "
                  f"vs pool {state.nbytes} B", flush=True)
    dim, W = 4352, 4
    x = f32(rng, b, dim)
    cs = f32(rng, L, dim, W - 1)
    w, bias = f32(rng, dim, W), f32(rng, dim)
    for backend in ("reference", "pallas_gpu"):
        fn = jax.jit(lambda s, be=backend: causal_conv1d_update(x, s, w, bias, "silu", sbi, backend=be),
                     donate_argnums=0)
        us = bench(fn, jnp.asarray(cs))
        print(f"TIME conv decode b={b} dim={dim} W={W} {backend}: {us:.1f} us", flush=True)
    T, R, Hs, Ps, Ns = 2048, 8, 8, 64, 128
    xs, dts = jnp.asarray(f32(rng, T, Hs, Ps)), jnp.asarray(f32(rng, T, Hs, scale=0.5))
    A = jnp.asarray(-np.exp(f32(rng, Hs, scale=0.5)))
    B, C = jnp.asarray(f32(rng, T, 1, Ns)), jnp.asarray(f32(rng, T, 1, Ns))
    st = f32(rng, 32, Hs, Ps, Ns)  # a fresh device copy per run below (the pool is donated)
    cuts = np.sort(rng.choice(np.arange(1, T), R - 1, replace=False))
    qsl = jnp.asarray(np.concatenate([[0], cuts, [T]]).astype(np.int32))
    ci = jnp.arange(1, R + 1, dtype=jnp.int32)
    his = jnp.ones((R,), bool)
    for backend, chunk in (("reference", 64), ("pallas_tpu", 128), ("pallas_gpu", 64), ("pallas_gpu", 128)):
        fn = jax.jit(lambda s, be=backend, ch=chunk: selective_scan_varlen(
            xs, dts, A, B, C, s, qsl, ci, his, dt_softplus=True, chunk_size=ch, backend=be),
            donate_argnums=0)
        us = bench(fn, jnp.asarray(st), n=5)
        name = {"reference": "token scan", "pallas_tpu": f"jnp chunked Q={chunk}"}.get(backend, f"kernel Q={chunk}")
        print(f"TIME prefill scan T={T} R={R} H={Hs} P={Ps} N={Ns} {name}: {us / 1e3:.2f} ms", flush=True)
    # one request's prefill at the real presets' shapes (Granite-4.0-H-Micro: 64 heads, 1 group;
    # Nemotron-H-8B: 128 heads, 8 groups); first the kernels' knobs (bf16 products and inputs, as a
    # bf16 model runs them), then each form at float32 and bf16 products
    for label, T, Hs, G in (("granite", 8192, 64, 1), ("nemotron", 8192, 128, 8)):
        xs, dts, zs, A, B, C, Dv, st, qsl, ci, his = scan_inputs(rng, T, Hs, G)
        # float32 products: the jnp form (the GPU flavour's choice); bf16: the kernels
        for backend, dd in (("pallas_tpu", None), ("pallas_gpu", jnp.bfloat16)):
            fn = jax.jit(lambda s, be=backend, dd=dd: selective_scan_varlen(
                xs, dts, A, B, C, s, qsl, ci, his, D=Dv, z=zs, dt_softplus=True, dot_dtype=dd,
                backend=be), donate_argnums=0)
            us = bench(fn, jnp.asarray(st), n=5)
            name = ("jnp chunked" if backend == "pallas_tpu" else "kernel") + (" bf16" if dd else " f32")
            print(f"TIME prefill scan {label} T={T} H={Hs} G={G} {name}: {us / 1e3:.2f} ms", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--interpret", action="store_true", help="run the GPU kernels in interpret mode (CPU dry run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scan-sweep", action="store_true", help="only the prefill scan kernels' knob sweep")
    a = p.parse_args()
    plat = jax.default_backend()
    print(f"jax {jax.__version__}, backend {plat}, devices {jax.devices()}", flush=True)
    if plat not in ("gpu", "cuda", "rocm") and not a.interpret:
        print("FAIL no GPU found (use --interpret for a CPU dry run)")
        return 2
    interp = True if a.interpret else False
    big = not a.interpret
    rng = np.random.default_rng(a.seed)
    if a.scan_sweep:
        scan_sweep(lambda *shape: scan_inputs(rng, *shape))
        return 0
    ssu_cases(rng, interp, big)
    conv_cases(rng, interp, big)
    columns_cases(rng, interp, big)
    prefill_cases(rng, big)
    try:
        timings(rng, interp)
    except Exception as e:  # noqa: BLE001
        RESULTS.append(("timings", False))
        print(f"FAIL timings: {type(e).__name__}: {e}", flush=True)
        traceback.print_exc(limit=3)
    failed = [n for n, ok in RESULTS if not ok]
    print(f"{len(RESULTS) - len(failed)}/{len(RESULTS)} passed" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
