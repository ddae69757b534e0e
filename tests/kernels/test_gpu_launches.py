"""The GPU flavour of ``selective_state_update`` and ``combine_sampled_and_draft_tokens``
is one launch per call, and still masks like the reference.

On a GPU every XLA op outside a ``pallas_call`` (index checks, tables, a zero fill,
a cast) becomes a kernel of its own. These tests trace the public op with traced
arguments, as inside a jitted step, and require that the jaxpr holds one
``pallas_call`` and nothing else but free reshapes. They also lower the kernels
for CUDA (possible on a CPU) and verify the Triton modules, so a primitive the
Triton lowering lacks, or a module the GPU's XLA would reject, fails here,
and compare the interpreted kernel bitwise with the reference where the kernel
now does what XLA did before: the logits rows' zeros and the tokens outside every
sequence.
"""

from __future__ import annotations

import collections

import jax
import numpy as np
import pytest

from pallas_kernels import combine_sampled_and_draft_tokens, selective_state_update
from tests.cuda_lowering import lower_for_cuda

#: Primitives that cost no launch: XLA turns them into bitcasts.
FREE = {"reshape", "squeeze"}


def outside_ops(closed_jaxpr) -> collections.Counter:
    """Primitives of a jaxpr outside every ``pallas_call`` (nested jits opened)."""
    ops = collections.Counter()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name in ("pjit", "jit", "closed_call"):
                walk(eqn.params["jaxpr"].jaxpr)
            elif name == "broadcast_in_dim" and (
                    np.prod(eqn.invars[0].aval.shape) == np.prod(eqn.outvars[0].aval.shape)):
                continue  # only adds unit axes: a reshape
            elif name not in FREE:
                ops[name] += 1

    walk(closed_jaxpr.jaxpr)
    return ops


def assert_one_launch(fn, *args):
    ops = outside_ops(jax.make_jaxpr(fn)(*args))
    assert ops == {"pallas_call": 1}, f"ops outside the kernel (each a launch on a GPU): {dict(ops)}"


f32, i32 = np.float32, np.int32
H, P, NS, G, L = 4, 8, 16, 2, 9


def _ssu_inputs(T, heads=True):
    rng = np.random.default_rng(T)
    x = rng.normal(size=(T, H, P)).astype(f32)
    a = dict(x=x, dt=rng.normal(size=(T, H, 1)).astype(f32),
             A=-np.exp(rng.normal(size=(H, 1, 1))).astype(f32),
             B=rng.normal(size=(T, G, NS)).astype(f32), C=rng.normal(size=(T, G, NS)).astype(f32),
             D=rng.normal(size=(H, 1)).astype(f32), dt_bias=rng.normal(size=(H, 1)).astype(f32),
             z=rng.normal(size=(T, H, P)).astype(f32))
    state = rng.normal(size=(L, H, P, NS)).astype(f32)
    if not heads:
        a = dict(x=x[:, 0], dt=a["dt"][:, 0], A=np.full((P, NS), -1.0, f32), B=a["B"][:, 0],
                 C=a["C"][:, 0], D=a["D"][0], dt_bias=a["dt_bias"][0], z=a["z"][:, 0])
        state = state[:, 0]
    return state, a


# Index arguments of each SSU form; None = not passed.
SSU_FORMS = {
    "decode": dict(T=3, sbi=np.array([4, 0, 2], i32)),
    "decode-no-heads": dict(T=3, sbi=np.array([4, 0, 2], i32), heads=False),
    "no-indices": dict(T=3),
    "src-dst": dict(T=3, sbi=np.array([[4], [0], [2]], i32), dsbi=np.array([5, 6, 0], i32)),
    "spec": dict(T=2, sbi=np.array([[3, 4], [5, 6]], i32), na=np.array([2, 1], i32)),
    "varlen-spec": dict(T=6, sbi=np.array([[3, 4, 0], [5, 6, 7]], i32), na=np.array([1, 3], i32),
                        cu=np.array([1, 3, 5], i32)),
    "varlen": dict(T=6, sbi=np.array([3, 5, 0], i32), dsbi=np.array([6, 7, 8], i32),
                   cu=np.array([0, 2, 2, 5], i32)),
}


def _ssu_call(form, backend, interpret):
    f = SSU_FORMS[form]
    state, a = _ssu_inputs(f["T"], f.get("heads", True))
    idx = {k: f[k] for k in ("sbi", "dsbi", "na", "cu") if k in f}

    def call(state, a, idx):
        return selective_state_update(
            state, a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], a["dt_bias"], a["z"], True,
            idx.get("sbi"), idx.get("dsbi"), 0, idx.get("na"), idx.get("cu"),
            backend=backend, interpret=interpret)

    return call, (state, a, idx)


@pytest.mark.parametrize("form", sorted(SSU_FORMS))
def test_ssu_gpu_is_one_launch(form):
    call, args = _ssu_call(form, "pallas_gpu", False)
    assert_one_launch(call, *args)


def test_ssu_gpu_lowers_for_cuda(verified_triton_modules):
    for form in SSU_FORMS:
        call, args = _ssu_call(form, "pallas_gpu", False)
        assert lower_for_cuda(call, *args).count("custom_call") == 1, form
    assert len(verified_triton_modules) == len(SSU_FORMS)


def _ssu_varlen_spec(backend, interpret):
    state, a = _ssu_inputs(6)
    sbi, na = np.array([[3, 4, 0], [5, 6, 7]], i32), np.array([1, 3], i32)
    return jax.jit(lambda st, cu: selective_state_update(
        st, a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], a["dt_bias"], a["z"], True,
        sbi, None, 0, na, cu, backend=backend, interpret=interpret)), state


_SSU_JIT = {b: _ssu_varlen_spec(b, i) for b, i in (("reference", None), ("pallas_gpu", True))}


@pytest.mark.parametrize("cu", [[1, 3, 5], [2, 2, 6], [0, 7, 1], [-1, 2, 4]], ids=str)
def test_ssu_gpu_tokens_outside_sequences_read_zero(cu):
    """Tokens before the first sequence, after the last real one, or after a bad offset."""
    (want_out, want_st), (got_out, got_st) = (
        [np.asarray(v) for v in f(state, np.array(cu, i32))] for f, state in _SSU_JIT.values())
    assert got_out.tobytes() == want_out.tobytes()
    assert got_st.tobytes() == want_st.tobytes()


# combine_sampled_and_draft_tokens: R rows, MR request rows, S drafts, T tokens, NL logits.
R, MR, S = 4, 6, 2
T, NL = R * (S + 1) + 2, R * (S + 1) + 3


def _combine_args(cu, idx=(0, 1, 2, 3), drafts=S):
    qsl = np.arange(R + 1, dtype=i32) * (S + 1)
    return (np.arange(T, dtype=i32) + 9000, np.array(idx, i32), 100 + np.arange(MR, dtype=i32),
            qsl, np.full((R,), 50, i32), np.full((MR,), 10, i32),
            (1000 + np.arange(MR * drafts, dtype=i32)).reshape(MR, drafts), np.array(cu, i32))


def _combine(backend, interpret, args):
    return combine_sampled_and_draft_tokens(*args, NL, backend=backend, interpret=interpret)


_COMBINE_JIT = {b: jax.jit(lambda *a, b=b: _combine(b, True if b == "pallas_gpu" else None, a))
                for b in ("reference", "pallas_gpu")}


@pytest.mark.parametrize("drafts", [S, 0])
def test_combine_gpu_is_one_launch(drafts):
    cu = np.arange(R + 1) * (drafts + 1)
    assert_one_launch(lambda *a: _combine("pallas_gpu", False, a), *_combine_args(cu, drafts=drafts))


@pytest.mark.parametrize("drafts", [S, 0])
def test_combine_gpu_lowers_for_cuda(drafts, verified_triton_modules):
    args = _combine_args(np.arange(R + 1) * (drafts + 1), drafts=drafts)
    assert lower_for_cuda(lambda *a: _combine("pallas_gpu", False, a), *args).count("custom_call") == 1
    assert len(verified_triton_modules) == 1


def test_planted_op_is_caught():
    """The check can fail: one cheap op added after the kernel is reported."""
    args = _combine_args(np.arange(R + 1) * (S + 1))
    with pytest.raises(AssertionError, match="'add': 1"):
        assert_one_launch(lambda *a: _combine("pallas_gpu", False, a)[1] + 1, *args)


@pytest.mark.parametrize("cu, idx", [
    ([2, 5, 5, 8, 9], (0, -1, 2, 3)),  # zeros before cu[0] and after cu[R], a padded row
    ([0, 3, 12, 12, 15], (0, 1, 2, 3)),  # row 1 has 9 logits: malformed, zeros over its range
    ([0, 3, 0, 6, 9], (0, -1, -1, 3)),  # decreasing at padded rows: row 2's range covers row 0's
    ([0, 3, 1, 4, 7], (-1, 1, 2, 3)),  # decreasing at a malformed row; a live row overlaps a padded one
    ([-3, 3, 6, 9, 20], (0, 1, 2, 3)),  # offsets outside [0, NL]
], ids=["head-tail", "long-row", "unordered-padded", "unordered-live", "outside"])
def test_combine_gpu_logits_match_the_reference_under_jit(cu, idx):
    args = _combine_args(cu, idx)
    got, want = (_COMBINE_JIT[b](*args) for b in ("pallas_gpu", "reference"))
    for g, w, name in zip(got, want, ("input_ids", "logits_indices")):
        assert np.asarray(g).tolist() == np.asarray(w).tolist(), name


def _scan_call(dot_dtype):
    import jax.numpy as jnp

    from pallas_kernels import selective_scan_varlen

    rng = np.random.default_rng(5)
    T, Hs, Ps, Ns = 48, 2, 16, 16
    x, z = rng.standard_normal((T, Hs, Ps)).astype(f32), rng.standard_normal((T, Hs, Ps)).astype(f32)
    dt, A = rng.standard_normal((T, Hs)).astype(f32), -np.ones(Hs, f32)
    B, C = rng.standard_normal((T, 1, Ns)).astype(f32), rng.standard_normal((T, 1, Ns)).astype(f32)
    state = np.zeros((5, Hs, Ps, Ns), f32)
    qsl, ci, his = np.array([0, 20, 40], i32), np.array([1, 3], i32), np.array([True, False])
    dd = None if dot_dtype is None else jnp.bfloat16
    x, z, B, C = (v if dd is None else jnp.asarray(v).astype(dd) for v in (x, z, B, C))

    def call(state, x, z, B, C):
        return selective_scan_varlen(x, dt, A, B, C, state, qsl, ci, his, z=z, dt_softplus=True,
                                     chunk_size=16, dot_dtype=dd, backend="pallas_gpu", interpret=False)

    return call, (state, x, z, B, C)


def test_scan_gpu_lowers_for_cuda_as_three_verified_kernels(verified_triton_modules):
    """bf16 products: the scan's three Triton kernels (chunk states, the state pass, chunk outputs)
    lower for CUDA and verify; float32 products lower to the jnp chunked form (no kernel)."""
    call, args = _scan_call("bf16")
    assert _triton_count(lower_for_cuda(call, *args)) == 3
    assert len(verified_triton_modules) == 3
    call, args = _scan_call(None)
    assert _triton_count(lower_for_cuda(call, *args)) == 0


def _triton_count(text: str) -> int:
    return text.count('custom_call @"__gpu$xla.gpu.triton"') + text.count("custom_call @__gpu$xla.gpu.triton")
