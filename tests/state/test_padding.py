"""The padding rules (kvjax.state.padding) and step_progress, the one rule of how a step moves a
request, on the host (numpy) and on the device (RequestState.post_update)."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from kvjax import PAD_ROW_ID, NewRequests, RequestState
from kvjax.state import gather_index, is_real_row, is_real_slot, scatter_index, step_progress, token_rows


def test_row_rule():
    idx = np.array([0, 3, PAD_ROW_ID, 4, -7])
    np.testing.assert_array_equal(is_real_row(idx, 4), [True, True, False, False, False])
    np.testing.assert_array_equal(gather_index(idx, 4), [0, 3, 0, 0, 0])
    np.testing.assert_array_equal(scatter_index(idx, 4), [0, 3, 4, 4, 4])
    assert PAD_ROW_ID == -1


def test_token_rows_skip_empty_rows_and_mark_the_tail():
    # rows: 2 tokens, 0 tokens, 3 tokens; 2 pad tokens
    np.testing.assert_array_equal(token_rows(np.array([0, 2, 2, 5]), 7), [0, 0, 2, 2, 2, 3, 3])
    np.testing.assert_array_equal(token_rows(jnp.array([0, 0]), 2), [1, 1])


def test_slot_rule():
    np.testing.assert_array_equal(is_real_slot(np.array([-1, 0, 5, -3])), [False, True, True, False])


def test_step_progress_cases():
    # mid-prefill chunk: nothing kept, num_computed advances by the chunk
    assert step_progress(0, 10, 4, 1) == (0, 4)
    # chunk that finishes prefill: one sample, every prompt token computed
    assert step_progress(8, 10, 2, 1) == (1, 10)
    # decode window with 2 drafts, 1 accepted (2 sampled): the rejected draft is not computed
    assert step_progress(10, 10, 3, 2) == (2, 12)
    # no tokens: nothing moves
    assert step_progress(10, 10, 0, 1) == (0, 10)


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.integers(0, 12), st.integers(0, 3), st.integers(0, 3)),
                min_size=4, max_size=4))
def test_host_rule_matches_the_device_post_update(rows):
    """Host copies (scheduler, trace driver) and the device state move identically."""
    R, L, S = 4, 16, 4
    ncs = [min(nc, prefill) for prefill, nc, _, _ in rows]
    new = NewRequests.from_lists(list(range(R)), [list(range(1, p + 1)) for p, *_ in rows],
                                 max_model_len=L, num_computed_tokens=ncs)
    s = RequestState.create(R, L, num_speculative_tokens=S - 1).add_requests(new)
    qlens = [1 + nd if nc >= p else min(1 + nd, p - nc) for (p, _, nd, _), nc in zip(rows, ncs)]
    # a decode window samples 1 + accepted drafts; a prefill chunk has no drafts: 1 (its window)
    nss = [1 + min(acc, nd) if nc >= p else 1 for (p, _, nd, acc), nc in zip(rows, ncs)]
    after = s.post_update(np.arange(R), np.array(qlens), np.ones((R, S), np.int32), np.array(nss))
    kept, nc = step_progress(np.array(ncs), np.array([p for p, *_ in rows]), np.array(qlens), np.array(nss))
    np.testing.assert_array_equal(after.num_computed_tokens, nc)
    np.testing.assert_array_equal(after.total_len, [p + k for (p, *_), k in zip(rows, kept)])
    for (p, *_), c, q, n, k, got in zip(rows, ncs, qlens, nss, kept, nc):  # the rule, spelled out
        want = (0, c + q) if c + q < p else (n, c + n) if c >= p else (n, c + q - 1 + n)
        assert (int(k), int(got)) == want


def test_scatter_rows_is_one_bit_exact_scatter_per_field():
    """scatter_rows equals field.at[dest].set(values, mode="drop") field by field, bitwise
    (float32 NaN payloads included), with padding rows dropped and zero-width fields kept."""
    import jax
    import pytest
    from kvjax.state.padding import scatter_rows

    rng = np.random.default_rng(0)
    R = 6
    nan_bits = np.array([0x7FC00001, 0x7FA00002, 0xFFC00003], np.uint32).view(np.float32)
    fields = {
        "a": (jnp.asarray(rng.integers(-9, 9, R), jnp.int32), jnp.asarray([7, 8, 9], jnp.int32)),
        "f": (jnp.asarray(rng.standard_normal(R), jnp.float32), jnp.asarray(nan_bits)),
        "m": (jnp.asarray(rng.integers(0, 99, (R, 4)), jnp.int32), jnp.asarray(rng.integers(100, 200, (3, 4)), jnp.int32)),
        "z": (jnp.zeros((R, 0), jnp.int32), 0),
        "s": (jnp.asarray(rng.standard_normal(R), jnp.float32), 2.5),
        # wider than JOIN_MAX_WORDS: scattered alone (a token table; float32 NaN payloads too)
        "w": (jnp.asarray(rng.integers(0, 99, (R, 40)), jnp.int32), jnp.asarray(rng.integers(100, 200, (3, 40)), jnp.int32)),
        "wf": (jnp.asarray(rng.standard_normal((R, 5, 4)), jnp.float32),
               jnp.asarray(np.resize(nan_bits, (3, 5, 4)))),
    }
    dest = scatter_index(jnp.asarray([4, PAD_ROW_ID, 1]), R)
    got = jax.jit(scatter_rows)(dest, fields)
    for name, (field, values) in fields.items():
        want = field.at[dest].set(jnp.broadcast_to(jnp.asarray(values, field.dtype), (3,) + field.shape[1:]),
                                  mode="drop")
        assert got[name].dtype == field.dtype and got[name].shape == field.shape, name
        np.testing.assert_array_equal(np.asarray(got[name]).view(np.uint8), np.asarray(want).view(np.uint8),
                                      err_msg=name)
    with pytest.raises(TypeError, match="'b'.*32-bit"):
        scatter_rows(dest, {"b": (jnp.zeros((R,), jnp.bool_), True)})


def test_scatter_rows_leaves_wide_fields_out_of_the_joined_table():
    """A field wider than JOIN_MAX_WORDS is never concatenated with the others: joined, each step
    would rewrite the whole token table (``R x max_model_len``) to update a few rows."""
    import jax
    from kvjax.state.padding import JOIN_MAX_WORDS, scatter_rows

    R, W = 6, JOIN_MAX_WORDS + 1
    fields = {"n": (jnp.zeros((R,), jnp.int32), 1), "t": (jnp.zeros((R, W), jnp.int32), 2),
              "k": (jnp.zeros((R, 2), jnp.float32), 0.5)}
    jaxpr = jax.make_jaxpr(scatter_rows)(jnp.asarray([1, R], jnp.int32), fields)
    joined = [e.outvars[0].aval.shape for e in jaxpr.eqns if e.primitive.name == "concatenate"]
    assert joined and all(shape[-1] <= 3 for shape in joined), joined
