"""RequestState, NewRequests, RequestRows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import NewRequests, RequestRows, RequestState


def test_rows_lifo_reuse_and_errors():
    rows = RequestRows(3)
    assert [rows.add("a"), rows.add("b")] == [2, 1]
    assert rows.remove("a") == 2
    assert rows.add("c") == 2  # the just-freed row is reused first
    rows.check()
    with pytest.raises(ValueError, match="request id 'b' already has row 1"):
        rows.add("b")
    rows.add("d")
    with pytest.raises(ValueError, match="no free request row: all 3 rows are in use"):
        rows.add("e")
    with pytest.raises(KeyError, match="unknown request id 'zz'"):
        rows.remove("zz")
    rows.free_rows.append(1)  # corrupt: row 1 both free and active
    with pytest.raises(AssertionError, match="free rows repeat|both free and active"):
        rows.check()


def test_add_request_rewrites_every_field_of_a_reused_row():
    s = RequestState.create(2, 8, num_speculative_tokens=2)
    s = s.add_request(1, [5, 6, 7, 8, 9], num_computed_tokens=0, temperature=0.7, top_k=4)
    s = s.set_draft_tokens(np.array([1]), np.array([[11, 12]]))
    s = s.post_update(np.array([1]), np.array([5]), np.array([[42, 0, 0]]), np.array([1]))
    s = s.replace(num_accepted_tokens=s.num_accepted_tokens.at[1].set(3))
    # Reuse row 1 for a shorter request that arrives with 2 tokens already computed.
    s = s.add_request(1, [1, 2, 3], num_computed_tokens=2)
    assert s.all_token_ids[1].tolist() == [1, 2, 3, 0, 0, 0, 0, 0]  # no stale tail
    assert int(s.last_sampled_tokens[1]) == 2  # all_token_ids[num_computed - 1]
    assert s.draft_tokens[1].tolist() == [0, 0]
    assert int(s.num_accepted_tokens[1]) == 1
    assert (int(s.prompt_len[1]), int(s.prefill_len[1]), int(s.total_len[1]), int(s.num_computed_tokens[1])) == (3, 3, 3, 2)
    assert float(s.temperature[1]) == 0.0 and int(s.top_k[1]) == 0 and float(s.top_p[1]) == 1.0
    # Row 0 untouched.
    empty = RequestState.create(2, 8, 2)
    for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(empty)):
        np.testing.assert_array_equal(np.asarray(a)[0], np.asarray(b)[0])


def test_fresh_prefill_last_sampled_is_zero_not_stale():
    s = RequestState.create(1, 4).replace(last_sampled_tokens=jnp.array([77], jnp.int32))
    s = s.add_request(0, [3, 4])
    assert int(s.last_sampled_tokens[0]) == 0


def test_post_update_prefill_chunks_decode_and_drafts():
    s = RequestState.create(2, 16, num_speculative_tokens=2).add_request(0, [1, 2, 3, 4, 5])
    idx = np.array([0, -1])
    # Mid-prefill chunk: nothing sampled even if the sampler reports one.
    s = s.post_update(idx, np.array([3, 0]), np.array([[9, 9, 9], [0, 0, 0]]), np.array([1, 0]))
    assert (int(s.num_computed_tokens[0]), int(s.total_len[0])) == (3, 5)
    # Finishing chunk samples one token.
    s = s.post_update(idx, np.array([2, 0]), np.array([[6, 0, 0], [0, 0, 0]]), np.array([1, 0]))
    assert (int(s.num_computed_tokens[0]), int(s.total_len[0]), int(s.last_sampled_tokens[0])) == (5, 6, 6)
    # Decode with 2 drafts, 1 accepted + bonus: 2 sampled, 1 rejected.
    s = s.post_update(idx, np.array([3, 0]), np.array([[7, 8, 0], [0, 0, 0]]), np.array([2, 0]))
    assert (int(s.num_computed_tokens[0]), int(s.total_len[0]), int(s.last_sampled_tokens[0])) == (7, 8, 8)
    assert int(s.num_accepted_tokens[0]) == 2
    assert s.all_token_ids[0].tolist()[:9] == [1, 2, 3, 4, 5, 6, 7, 8, 0]
    assert int(s.total_len[1]) == 0  # padded batch row touched nothing


def test_post_update_drops_tokens_past_max_model_len():
    s = RequestState.create(1, 3, 1).add_request(0, [1, 2, 3], num_computed_tokens=2)
    # the chunk that finishes prefill samples 1 token (its window), which lands past the end
    s = s.post_update(np.array([0]), np.array([1]), np.array([[5, 6]]), np.array([1]))
    assert s.all_token_ids[0].tolist() == [1, 2, 3]  # nothing written out of bounds, no wrap


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(token_ids=[[]]), r"token_ids\[0\] is empty"),
        (dict(token_ids=[[1] * 9]), r"token_ids\[0\] has 9 tokens, more than max_model_len=8"),
        (dict(num_computed_tokens=[5]), r"num_computed_tokens\[0\] must be in \[0, num_tokens=2\], got 5"),
        (dict(rows=[4]), r"rows must have values in \[0, 2\) \(or -1\); got 4"),
        (dict(rows=[1, 1], token_ids=[[1], [2]]), r"rows must be distinct in one add"),
    ],
)
def test_add_rejects_bad_input(kw, match):
    s = RequestState.create(2, 8)
    args = dict(rows=[0], token_ids=[[1, 2]])
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        rows, toks = args.pop("rows"), args.pop("token_ids")
        s.add_requests(NewRequests.from_lists(rows, toks, max_model_len=8, **args))


def test_add_requests_under_jit_matches_eager():
    s = RequestState.create(3, 6, 1)
    new = NewRequests.from_lists([2, 0], [[4, 5, 6], [7]], max_model_len=6, num_computed_tokens=[3, 0], pad_to=3)
    eager = s.add_requests(new)
    jitted = jax.jit(RequestState.add_requests)(s, new)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        np.testing.assert_array_equal(a, b)
    assert int(eager.last_sampled_tokens[2]) == 6


def test_clear_rows():
    s = RequestState.create(2, 4, 1).add_request(0, [1, 2]).add_request(1, [3])
    s = s.clear_rows(np.array([0, -1]))
    assert int(s.total_len[0]) == 0 and int(s.prefill_len[0]) == 0 and int(s.num_computed_tokens[0]) == 0
    assert s.all_token_ids[1].tolist() == [3, 0, 0, 0] and int(s.total_len[1]) == 1
    # the cleared row's tokens are left (never read at total_len 0); the next tenant's add
    # rewrites the whole row, so nothing of them survives
    assert s.all_token_ids[0].tolist() == [1, 2, 0, 0]
    s = s.add_request(0, [5])
    assert s.all_token_ids[0].tolist() == [5, 0, 0, 0] and int(s.total_len[0]) == 1


def test_post_update_keeps_last_sampled_of_a_row_that_samples_nothing():
    """A resumed request's mid-prefill chunk samples nothing: its last_sampled_tokens (set at
    add time from its history) stays, and so does every field of a row not in the batch."""
    s = RequestState.create(3, 16).add_request(0, [1, 2, 3, 4, 5, 6], num_computed_tokens=2)
    s = s.add_request(2, [7, 8], num_computed_tokens=1)
    before = jax.tree.map(np.asarray, s)
    assert int(before.last_sampled_tokens[0]) == 2 and int(before.last_sampled_tokens[2]) == 7
    s = s.post_update(np.array([0, -1]), np.array([2, 0]), np.array([[9], [0]]), np.array([1, 0]))
    assert int(s.num_computed_tokens[0]) == 4 and int(s.last_sampled_tokens[0]) == 2
    for f in ("last_sampled_tokens", "total_len", "num_computed_tokens", "num_accepted_tokens", "all_token_ids"):
        np.testing.assert_array_equal(np.asarray(getattr(s, f))[1:], getattr(before, f)[1:], err_msg=f)


# ---------------------------------------- num_sampled is bounded by the row's window

def _decode_row():
    """Row 0 decoding (a prompt of 5, then 3 outputs, the last step's draft accepted), row 1
    prefilling (6 tokens); k = 2."""
    s = RequestState.create(3, 16, num_speculative_tokens=2).add_request(0, [1, 2, 3, 4, 5])
    s = s.post_update(np.array([0]), np.array([5]), np.array([[6, 0, 0]]), np.array([1]))
    s = s.post_update(np.array([0]), np.array([2]), np.array([[7, 8, 0]]), np.array([2]))
    assert (int(s.num_computed_tokens[0]), int(s.total_len[0]), int(s.num_accepted_tokens[0])) == (7, 8, 2)
    return s.add_request(1, [1, 2, 3, 4, 5, 6])


@pytest.mark.parametrize(
    "qlen, num_sampled, window",
    [
        (1, 3, 1),  # a decode window with no drafts samples 1 token, not 3
        (2, 3, 2),  # one draft: 1 + 1
    ],
)
def test_post_update_rejects_more_samples_than_the_window(qlen, num_sampled, window):
    s = _decode_row()
    with pytest.raises(ValueError, match=(
            rf"num_sampled\[1\]={num_sampled} must be in \[0, {window}\] \(1 \+ num_drafts\) for "
            rf"request row 0 \(query_lens\[1\]={qlen}, 7 of its 5 prefill tokens computed\)")):
        s.post_update(np.array([1, 0]), np.array([6, qlen]), np.array([[7, 0, 0], [8, 9, 10]]),
                      np.array([1, num_sampled]))


def test_post_update_rejects_samples_past_the_chunk_that_finishes_prefill():
    s = _decode_row()
    with pytest.raises(ValueError, match=r"num_sampled\[0\]=2 must be in \[0, 1\] \(1 \+ num_drafts\) "
                                         r"for request row 1"):
        s.post_update(np.array([1]), np.array([6]), np.array([[7, 8, 0]]), np.array([2]))
    # the window itself is fine: 1 sample for the finishing chunk, 1 + 2 for two drafts
    t = s.post_update(np.array([1, 0]), np.array([6, 3]), np.array([[7, 0, 0], [8, 9, 10]]), np.array([1, 3]))
    assert t.num_computed_tokens[:2].tolist() == [10, 6] and t.total_len[:2].tolist() == [11, 7]


def test_post_update_under_jit_leaves_a_row_with_too_many_samples_unchanged():
    s = _decode_row()
    f = jax.jit(lambda ns: s.post_update(np.array([1, 0]), np.array([6, 1]),
                                         np.array([[7, 0, 0], [8, 9, 10]]), ns))
    got = f(np.array([1, 3], np.int32))
    for name in RequestState.reset_on_clear() + ("all_token_ids",):
        a, b = np.asarray(getattr(got, name)), np.asarray(getattr(s, name))
        np.testing.assert_array_equal(a[0], b[0], err_msg=name)  # row 0: untouched
    # row 1 (a valid finishing chunk in the same step) moved
    assert (int(got.num_computed_tokens[1]), int(got.total_len[1]), int(got.last_sampled_tokens[1])) == (6, 7, 7)
    ok = f(np.array([1, 1], np.int32))
    assert (int(ok.num_computed_tokens[0]), int(ok.total_len[0])) == (8, 9)


def test_step_progress_refuses_a_negative_rejection_count():
    from kvjax.state import step_progress
    # a decode window (5 of 5 prefill tokens computed): 1 token, no drafts, 3 "sampled"
    with pytest.raises(ValueError, match=r"num_sampled=3 must be in \[0, 1\] \(1 \+ num_drafts\)"):
        step_progress(5, 5, 1, 3)
    with pytest.raises(ValueError, match=r"num_sampled\[1\]=4 must be in \[0, 3\]"):
        step_progress(np.array([5, 5]), np.array([5, 5]), np.array([1, 3]), np.array([1, 4]))
    # mid-prefill and idle rows ignore num_sampled, as before
    assert step_progress(0, 10, 4, 3) == (0, 4) and step_progress(5, 5, 0, 3) == (0, 5)
    # traced: the row does not move
    kept, nc = jax.jit(lambda n: step_progress(5, 5, 1, n, xp=jnp))(jnp.int32(3))
    assert (int(kept), int(nc)) == (0, 5)


# ---------------------------------------- total_len never passes max_model_len

def test_a_sample_past_max_model_len_is_not_counted():
    """The chunk that finishes a max_model_len-token prefill samples 1 token with no column
    left: it is dropped, and total_len stays max_model_len (it read 5 of 4)."""
    s = RequestState.create(1, 4).add_request(0, [1, 2, 3, 4], num_computed_tokens=3)
    for f in (lambda *a: s.post_update(*a), jax.jit(lambda *a: s.post_update(*a))):
        out = f(np.array([0]), np.array([1]), np.array([[9]]), np.array([1]))
        assert int(out.total_len[0]) == 4 and int(out.num_computed_tokens[0]) == 4
        assert out.all_token_ids[0].tolist() == [1, 2, 3, 4]
        assert int(out.last_sampled_tokens[0]) == 3  # unchanged: the dropped 9 is no token of the row


def test_a_decode_window_at_max_model_len_keeps_the_samples_that_fit():
    """A window of 1 draft ending at max_model_len, both accepted: the first sample takes the
    last column, the bonus token has none."""
    s = RequestState.create(2, 8, num_speculative_tokens=1).add_request(1, [1, 2, 3, 4, 5, 6])
    s = s.post_update(np.array([1]), np.array([6]), np.array([[7, 0]]), np.array([1]))  # nc 6, total 7
    for f in (lambda *a: s.post_update(*a), jax.jit(lambda *a: s.post_update(*a))):
        out = f(np.array([1]), np.array([2]), np.array([[8, 9]]), np.array([2]))
        assert (int(out.num_computed_tokens[1]), int(out.total_len[1])) == (8, 8)
        assert out.all_token_ids[1].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
        assert int(out.last_sampled_tokens[1]) == 8 and int(out.num_accepted_tokens[1]) == 2


# ---------------------------------------- sampled tokens: the token-id rule of the drafts

def _with_drafts():
    s = _decode_row()
    return s, s.set_draft_tokens(np.array([0]), np.array([[11, 12]]))


@pytest.mark.parametrize(
    "bad, match",
    [
        pytest.param(np.array([[7.9, 0, 0]]), r"{} must have dtype an integer dtype, got float64", id="float"),
        pytest.param(np.array([[-5, 0, 0]]), r"{} must have values in \[0, 2147483648\); got -5 at index \(0, 0\)",
                     id="negative"),
        pytest.param(np.array([[2**32 + 5, 0, 0]], np.int64), r"{} must have values in \[0, 2147483648\); got 4294967301",
                     id="wide"),
    ],
)
def test_sampled_and_drafts_share_the_token_id_rule(bad, match):
    s, _ = _with_drafts()
    with pytest.raises(ValueError, match=match.format("sampled")):
        s.post_update(np.array([0]), np.array([1]), bad, np.array([1]))
    with pytest.raises(ValueError, match=match.format("drafts")):
        s.set_draft_tokens(np.array([0]), bad[:, :2])


def test_post_update_reads_only_the_kept_samples():
    """Positions past num_sampled are no tokens (vLLM's sampler puts -1 there): not checked."""
    s, _ = _with_drafts()
    out = s.post_update(np.array([0]), np.array([3]), np.array([[9, -1, -1]], np.int64), np.array([1]))
    assert int(out.last_sampled_tokens[0]) == 9 and int(out.total_len[0]) == 9


def test_post_update_under_jit_leaves_a_row_with_a_bad_kept_token_unchanged():
    s, _ = _with_drafts()
    f = jax.jit(lambda sampled: s.post_update(np.array([1, 0]), np.array([6, 1]), sampled, np.array([1, 1])))
    got = f(np.array([[7, 0, 0], [-5, -1, -1]], np.int32))
    for name in RequestState.reset_on_clear() + ("all_token_ids",):
        np.testing.assert_array_equal(np.asarray(getattr(got, name))[0], np.asarray(getattr(s, name))[0],
                                      err_msg=name)
    assert (int(got.num_computed_tokens[1]), int(got.total_len[1]), int(got.last_sampled_tokens[1])) == (6, 7, 7)
    ok = f(np.array([[7, 0, 0], [5, -1, -1]], np.int32))
    assert (int(ok.num_computed_tokens[0]), int(ok.total_len[0]), int(ok.last_sampled_tokens[0])) == (8, 9, 5)


# ---------------------------------------- NewRequests: dtypes and values, however built

def _new(**kw):
    """One entry (row 0, tokens [5, 6] of max_model_len 4) with fields replaced by ``kw``."""
    d = dict(rows=np.array([0], np.int32), token_ids=np.array([[5, 6, 0, 0]], np.int32),
             num_tokens=np.array([2], np.int32), prompt_len=np.array([2], np.int32),
             num_computed_tokens=np.array([0], np.int32), temperature=np.array([0.0], np.float32),
             top_p=np.array([1.0], np.float32), top_k=np.array([0], np.int32), seed=np.array([0], np.int32))
    d.update(kw)
    return NewRequests(**d)


INT_RULE = r"must have dtype an integer dtype, got float64"
DIRECT_CASES = [
    ("wide-token", dict(token_ids=np.array([[2**32 + 5, 6, 0, 0]], np.int64)),
     r"token_ids must have values in \[0, 2147483648\); got 4294967301 at index \(0, 0\)"),
    ("negative-token", dict(token_ids=np.array([[5, -7, 0, 0]], np.int32)),
     r"token_ids must have values in \[0, 2147483648\); got -7 at index \(0, 1\)"),
    ("float-token", dict(token_ids=np.array([[5.5, 6, 0, 0]])), "token_ids " + INT_RULE),
    ("float-num-tokens", dict(num_tokens=np.array([2.7])), "num_tokens " + INT_RULE),
    ("float-prompt-len", dict(prompt_len=np.array([1.5])), "prompt_len " + INT_RULE),
    ("float-num-computed", dict(num_computed_tokens=np.array([0.5])), "num_computed_tokens " + INT_RULE),
    ("float-rows", dict(rows=np.array([0.0])), "rows " + INT_RULE),
    ("wide-num-tokens", dict(num_tokens=np.array([2**32 + 2], np.int64)),
     r"num_tokens\[0\] must be in \[1, max_model_len=4\], got 4294967298"),
    ("negative-temperature", dict(temperature=np.array([-1.0], np.float32)),
     r"temperature\[0\] must be a number >= 0, got -1.0"),
    ("nan-temperature", dict(temperature=np.array([np.nan], np.float32)),
     r"temperature\[0\] must be a number >= 0, got nan"),
    ("int-temperature", dict(temperature=np.array([1])), r"temperature must have dtype a floating dtype, got int64"),
    ("zero-top-p", dict(top_p=np.array([0.0], np.float32)), r"top_p\[0\] must be in \(0, 1\], got 0.0"),
    ("big-top-p", dict(top_p=np.array([1.5], np.float32)), r"top_p\[0\] must be in \(0, 1\], got 1.5"),
    ("negative-top-k", dict(top_k=np.array([-3], np.int32)),
     r"top_k\[0\] must be an int in \[0, 2\*\*31\) \(0: off\), got -3"),
    ("float-top-k", dict(top_k=np.array([1.0])), "top_k " + INT_RULE),
    ("negative-seed", dict(seed=np.array([-1], np.int32)), r"seed\[0\] must be an int in \[0, 2\*\*31\), got -1"),
    ("wide-seed", dict(seed=np.array([2**31], np.int64)),
     r"seed\[0\] must be an int in \[0, 2\*\*31\), got 2147483648"),
]


@pytest.mark.parametrize("kw, match", [pytest.param(kw, m, id=i) for i, kw, m in DIRECT_CASES])
def test_new_requests_built_directly_are_checked(kw, match):
    with pytest.raises(ValueError, match=match):
        RequestState.create(2, 4).add_requests(_new(**kw))


def test_unused_entries_and_the_token_tail_are_not_read():
    """A -1 entry and the tokens past num_tokens may hold anything: they are never installed."""
    new = _new(rows=np.array([0, -1], np.int32),
               token_ids=np.array([[5, 6, -1, 2**40], [-3, -3, -3, -3]], np.int64),
               num_tokens=np.array([2, 0], np.int32), prompt_len=np.array([2, 0], np.int32),
               num_computed_tokens=np.array([0, 9], np.int32), temperature=np.array([0.5, -1], np.float32),
               top_p=np.array([1.0, 0.0], np.float32), top_k=np.array([0, -1], np.int32),
               seed=np.array([0, -1], np.int32))
    out = RequestState.create(2, 4).add_requests(new)
    assert out.all_token_ids[0].tolist() == [5, 6, 0, 0] and float(out.temperature[0]) == 0.5
    assert int(out.total_len[1]) == 0


JIT_BAD = {
    "num-tokens-past-max-model-len": dict(num_tokens=9, num_computed_tokens=7, prompt_len=0),  # r7 (d)
    "no-tokens": dict(num_tokens=0, prompt_len=0),
    "prompt-past-num-tokens": dict(prompt_len=3),
    "computed-past-num-tokens": dict(num_computed_tokens=3),
    "negative-token": dict(token=-7),
    "negative-temperature": dict(temperature=-1.0),
    "zero-top-p": dict(top_p=0.0),
    "negative-top-k": dict(top_k=-3),
    "negative-seed": dict(seed=-1),
}


def _two_entries(bad):
    """Entry 0 (row 0) with ``bad``'s values, entry 1 (row 1) a valid request."""
    f = dict(num_tokens=2, prompt_len=2, num_computed_tokens=0, temperature=0.0, top_p=1.0, top_k=0, seed=0)
    f.update({k: v for k, v in bad.items() if k != "token"})
    ints = ("num_tokens", "prompt_len", "num_computed_tokens", "top_k", "seed")
    cols = {k: np.array([f[k], 2 if k != "num_computed_tokens" else 1], np.int32 if k in ints else np.float32)
            for k in f}
    cols["top_p"][1] = 0.5
    cols["temperature"][1] = 0.7
    tokens = np.array([[5, bad.get("token", 6), 0, 0], [7, 8, 0, 0]], np.int32)
    return _new(rows=np.array([0, 1], np.int32), token_ids=tokens, **cols)


@pytest.mark.parametrize("bad", [pytest.param(v, id=k) for k, v in JIT_BAD.items()])
def test_add_requests_under_jit_installs_no_entry_that_breaks_a_rule(bad):
    s = RequestState.create(3, 4).add_request(0, [9, 9, 9], num_computed_tokens=2, top_k=4)
    new = _two_entries(bad)
    with pytest.raises(ValueError):
        s.add_requests(new)  # eager: refused
    out = jax.jit(RequestState.add_requests)(s, new)
    for name in RequestState.reset_on_clear() + ("all_token_ids",):
        a, b = np.asarray(getattr(out, name)), np.asarray(getattr(s, name))
        np.testing.assert_array_equal(a[0], b[0], err_msg=name)  # row 0 keeps its request
    assert out.all_token_ids[1].tolist() == [7, 8, 0, 0] and int(out.last_sampled_tokens[1]) == 7
    assert float(out.top_p[1]) == 0.5 and float(out.temperature[1]) == np.float32(0.7)


def test_add_requests_under_jit_installs_neither_of_two_entries_for_one_row():
    s = RequestState.create(2, 4).add_request(0, [9, 9, 9])
    new = _new(rows=np.array([0, 0], np.int32), token_ids=np.array([[5, 6, 0, 0], [7, 8, 0, 0]], np.int32),
               num_tokens=np.array([2, 2], np.int32), prompt_len=np.array([2, 2], np.int32),
               num_computed_tokens=np.zeros(2, np.int32), temperature=np.zeros(2, np.float32),
               top_p=np.ones(2, np.float32), top_k=np.zeros(2, np.int32), seed=np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="rows must be distinct in one add"):
        s.add_requests(new)
    out = jax.jit(RequestState.add_requests)(s, new)
    assert out.all_token_ids[0].tolist() == [9, 9, 9, 0] and int(out.total_len[0]) == 3
    # an entry that breaks a rule writes nothing, so it does not make its row's valid entry a duplicate
    bad_first = new.replace(num_tokens=np.array([9, 2], np.int32))
    out = jax.jit(RequestState.add_requests)(s, bad_first)
    assert out.all_token_ids[0].tolist() == [7, 8, 0, 0] and int(out.total_len[0]) == 2


@pytest.mark.parametrize(
    "kw, match",
    [
        pytest.param(dict(prompt_lens=[1.9]), "prompt_lens " + INT_RULE, id="float-prompt-len"),
        pytest.param(dict(prompt_lens=[2**40]), r"prompt_len\[0\] must be in \[1, num_tokens=2\], got 1099511627776",
                     id="wide-prompt-len"),
        pytest.param(dict(num_computed_tokens=[0.5]), "num_computed_tokens " + INT_RULE, id="float-computed"),
        pytest.param(dict(token_ids=[[1.9, True]]), r"token_ids\[0\] " + INT_RULE, id="float-token"),
        pytest.param(dict(token_ids=[[1, -2]]), r"token_ids\[0\] must have values in \[0, 2147483648\); got -2",
                     id="negative-token"),
        pytest.param(dict(rows=[1.5]), "rows " + INT_RULE, id="float-row"),
        pytest.param(dict(seed=[2**31]), r"seed\[0\] must be an int in \[0, 2\*\*31\), got 2147483648", id="wide-seed"),
        pytest.param(dict(seed=[-5]), r"seed\[0\] must be an int in \[0, 2\*\*31\), got -5", id="negative-seed"),
        pytest.param(dict(top_k=[-1]), r"top_k\[0\] must be an int in \[0, 2\*\*31\) \(0: off\), got -1", id="top-k"),
        pytest.param(dict(top_k=[2.0]), "top_k " + INT_RULE, id="float-top-k"),
        pytest.param(dict(temperature=[float("nan")]), r"temperature\[0\] must be a number >= 0, got nan", id="nan"),
        pytest.param(dict(top_p=[0]), r"top_p\[0\] must be in \(0, 1\], got 0", id="top-p"),
    ],
)
def test_from_lists_checks_every_value_before_narrowing(kw, match):
    args = dict(rows=[0], token_ids=[[1, 2]])
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        NewRequests.from_lists(args.pop("rows"), args.pop("token_ids"), max_model_len=4, **args)


@pytest.mark.parametrize(
    "name, value",
    [("temperature", -0.5), ("temperature", float("nan")), ("temperature", 0.0), ("temperature", 2),
     ("top_p", 0.0), ("top_p", -0.1), ("top_p", 1.5), ("top_p", 1.0), ("top_p", 0.3),
     ("top_k", -1), ("top_k", 0), ("top_k", 7), ("top_k", 2.0),
     ("seed", -1), ("seed", 2**31), ("seed", 2**31 - 1), ("seed", 0), ("seed", 1.0)],
)
def test_the_state_and_the_scheduler_refuse_the_same_sampling_parameters(name, value):
    """kvjax.host.scheduler.Request keeps its own copy of the rule (SAMPLING_RULES is its
    owner, in request_state.py): until it calls it, this test keeps the two in step."""
    from kvjax.host.scheduler import Request
    from kvjax.state.request_state import SAMPLING_RULES

    def error(f):
        try:
            f()
        except ValueError as e:
            return str(e)
        return None

    by_request = error(lambda: Request("a", [1, 2], max_tokens=1, **{name: value}))
    by_state = error(lambda: RequestState.create(1, 4).add_request(0, [1, 2], **{name: value}))
    assert (by_request is None) == (by_state is None), (by_request, by_state)
    if by_state is not None:  # named, with the rule (or, for a float int, the dtype wanted)
        assert (f"{name}[0] must be {SAMPLING_RULES[name][0]}" in by_state
                or f"{name} must have dtype an integer dtype" in by_state), by_state
