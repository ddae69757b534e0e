"""The GPU flavour of ``combine_sampled_and_draft_tokens``
is one launch per call, and still masks like the reference.

On a GPU every XLA op outside a ``pallas_call`` (index checks, tables, a zero fill,
a cast) becomes a kernel of its own. These tests trace the public op with traced
arguments, as inside a jitted step, and require that the jaxpr holds one
``pallas_call`` and nothing else but free reshapes. They also lower the kernels
for CUDA (possible on a CPU), so a primitive the Triton lowering lacks fails here,
and compare the interpreted kernel bitwise with the reference where the kernel
now does what XLA did before: the logits rows' zeros and the tokens outside every
sequence.
"""

from __future__ import annotations

import collections

import jax
import numpy as np
import pytest

from pallas_kernels import combine_sampled_and_draft_tokens

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


i32 = np.int32


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


def test_combine_gpu_lowers_for_cuda():
    args = _combine_args(np.arange(R + 1) * (S + 1))
    text = jax.jit(lambda *a: _combine("pallas_gpu", False, a)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call") == 1


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
