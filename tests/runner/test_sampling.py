"""Sampling on the device (kvjax.runner.sampling): greedy at temperature 0, the noise keyed by
(seed, position) only, top-k / top-p as stated, exact draft verification."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.runner.sampling import sample_and_verify, sample_rows


def _rows(logits, temperature=1.0, top_k=0, top_p=1.0, seed=0, position=None):
    L = logits.shape[0]
    pos = np.arange(L) if position is None else position
    full = lambda v, dt: jnp.full((L,), v, dt)  # noqa: E731
    return np.asarray(sample_rows(jnp.asarray(logits, jnp.float32), full(temperature, jnp.float32),
                                  full(top_k, jnp.int32), full(top_p, jnp.float32), full(seed, jnp.int32),
                                  jnp.asarray(pos, jnp.int32)))


def test_temperature_zero_and_top_k_one_are_greedy():
    logits = np.random.default_rng(0).normal(size=(6, 50)).astype(np.float32)
    np.testing.assert_array_equal(_rows(logits, temperature=0.0), logits.argmax(-1))
    np.testing.assert_array_equal(_rows(logits, temperature=5.0, top_k=1), logits.argmax(-1))


def test_noise_depends_on_seed_and_position_only():
    """The same (seed, position) gives the same token wherever the row sits in the batch; another
    seed or position gives another draw."""
    rng = np.random.default_rng(1)
    logits = np.tile(rng.normal(size=(1, 64)).astype(np.float32), (8, 1))
    pos = np.arange(100, 108)
    a = _rows(logits, position=pos, seed=7)
    perm = rng.permutation(8)
    b = _rows(logits[perm], position=pos[perm], seed=7)
    np.testing.assert_array_equal(a[perm], b)
    assert len(set(a.tolist())) > 1  # different positions draw differently
    assert (_rows(logits, position=pos, seed=8) != a).any()


def test_frequencies_follow_the_filtered_softmax():
    probs = np.array([0.5, 0.3, 0.2, 0.0])
    logits = np.log(np.maximum(probs, 1e-30))[None].repeat(4000, 0).astype(np.float32)
    freq = np.bincount(_rows(logits, seed=3), minlength=4) / 4000
    np.testing.assert_allclose(freq, probs, atol=0.03)
    # top_p 0.5: the largest token alone reaches it; 0.6: the two largest, renormalised
    assert (_rows(logits, top_p=0.5, seed=3) == 0).all()
    freq = np.bincount(_rows(logits, top_p=0.6, seed=3), minlength=4) / 4000
    np.testing.assert_allclose(freq, [0.625, 0.375, 0, 0], atol=0.03)
    freq = np.bincount(_rows(logits, top_k=2, seed=4), minlength=4) / 4000
    np.testing.assert_allclose(freq, [0.625, 0.375, 0, 0], atol=0.03)
    # temperature 2 flattens: p ~ probs ** 0.5
    flat = np.sqrt(probs) / np.sqrt(probs).sum()
    freq = np.bincount(_rows(logits, temperature=2.0, seed=5), minlength=4) / 4000
    np.testing.assert_allclose(freq, flat, atol=0.03)


def _filtered_by_sorting(x, top_k, top_p):
    """The stated rule in numpy on the sorted row, float64 probabilities."""
    out = np.full_like(x, -np.inf)
    V = x.shape[1]
    for i in range(x.shape[0]):
        o = np.sort(x[i])[::-1]
        thr = o[(top_k[i] if 0 < top_k[i] < V else V) - 1]
        if top_p[i] < 1:
            p = np.exp(o.astype(np.float64) - o.max())
            p /= p.sum()
            before = np.cumsum(p) - p
            thr = max(thr, o[max(int((before < top_p[i]).sum()), 1) - 1])
        out[i] = np.where(x[i] >= thr, x[i], -np.inf)
    return out


def test_filter_matches_the_sorted_rule():
    """The bisection thresholds against the rule on the sorted row: ties, signed zeros, -inf
    entries, top_k at and past the vocabulary, top_p 1; the whole filtered rows compared."""
    from kvjax.runner.sampling import _filtered

    rng = np.random.default_rng(0)
    for V in (2, 37, 160):
        L = 48
        x = (rng.normal(size=(L, V)) * rng.uniform(0.1, 5, (L, 1))).astype(np.float32)
        x[::3] = np.round(x[::3])  # ties, and -0.0 beside 0.0
        x[::5, : V // 3] = -np.inf
        top_k = rng.integers(0, V + 3, L).astype(np.int32)
        top_p = rng.uniform(0.05, 1.0, L).astype(np.float32)
        top_p[::4] = 1.0
        got = np.asarray(_filtered(jnp.asarray(x), jnp.asarray(top_k), jnp.asarray(top_p)))
        np.testing.assert_array_equal(got, _filtered_by_sorting(x, top_k, top_p), err_msg=f"V={V}")


def test_sampling_runs_no_sort():
    """With a sort in its branches, XLA:GPU ran the step's sampling conditional on the host: every
    launch then waited for the whole step to finish (``benchmarks/probe_launch.py``)."""
    import jax

    L, V = 3, 40
    args = (jnp.zeros((L, V), jnp.float32), jnp.ones((L,), jnp.float32), jnp.full((L,), 5, jnp.int32),
            jnp.full((L,), 0.9, jnp.float32), jnp.zeros((L,), jnp.int32), jnp.arange(L, dtype=jnp.int32))
    text = jax.jit(sample_rows).lower(*args).as_text()
    assert "sort" not in text


def test_a_draft_is_kept_exactly_when_the_sample_equals_it():
    """One decode row with 2 drafts at temperature 1: draft i is accepted iff every earlier one was
    and the sample at its position equals it; the correction is the sample itself."""
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(3, 8)).astype(np.float32)
    params = tuple(jnp.asarray(v) for v in (np.ones(3, np.float32), np.zeros(3, np.int32),
                                            np.ones(3, np.float32), np.full(3, 11, np.int32),
                                            np.arange(20, 23, dtype=np.int32)))
    target = np.asarray(sample_rows(jnp.asarray(logits), *params))
    cu = jnp.asarray([0, 3], jnp.int32)
    for drafts, accepted in (([target[0], target[1]], 2), ([target[0], (target[1] + 1) % 8], 1),
                             ([(target[0] + 1) % 8, target[1]], 0)):
        sampled, num = sample_and_verify(jnp.asarray(logits), cu, jnp.asarray([drafts], jnp.int32),
                                         jnp.asarray([2], jnp.int32), 2, params)
        assert int(num[0]) == accepted + 1
        np.testing.assert_array_equal(np.asarray(sampled)[0, :accepted + 1], target[:accepted + 1])


@pytest.mark.parametrize("planted", [False, True])
def test_sampling_planted_position_independence_fails(planted, monkeypatch):
    """Planted: the noise keyed by the batch row instead of the position; a permuted batch then
    draws other tokens and the position test fails."""
    if planted:
        import kvjax.runner.sampling as sm

        original = sm.sample_rows

        def by_row(logits, temperature, top_k, top_p, seed, position):
            return original(logits, temperature, top_k, top_p, seed, jnp.arange(position.shape[0]))

        monkeypatch.setattr(sm, "sample_rows", by_row)
        global sample_rows
        saved = sample_rows
        sample_rows = by_row
        try:
            with pytest.raises(AssertionError):
                test_noise_depends_on_seed_and_position_only()
        finally:
            sample_rows = saved
    else:
        test_noise_depends_on_seed_and_position_only()
