"""The tiny hybrid model: paged mixed steps against the dense oracle, poison and dummy steps.

Every scenario is driven by hand through the real state code (``RequestState``,
``BlockTables``, ``ScheduledBatch``, ``build_step_batch``): chunked prefill and
greedy decode of two requests in one bucket, with a padded row in the middle of
the batch and a padded token tail. Each logits row the step returns is checked
against :func:`dense_forward` (one request, no cache, full recompute) at the same
position, and every sampled token against the oracle's greedy choice.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import (
    NULL_BLOCK_ID,
    BlockTables,
    KVGroupSpec,
    RequestRows,
    RequestState,
    ScheduledBatch,
    build_step_batch,
    cdiv,
    validate_schedule,
)
from kvjax.models import (
    HybridCaches,
    TinyHybridConfig,
    dense_forward,
    forward_step,
    init_caches,
    init_params,
)
from kvjax.models.attention import paged_attention
from kvjax.testing.fast_compile import FAST_COMPILER_OPTIONS


CONFIG = TinyHybridConfig()
BLOCK_SIZE = 4
MAX_MODEL_LEN = 24
NUM_BLOCKS = 16
NUM_STATE_SLOTS = 8
MAX_NUM_REQS = 4
T, R = 8, 3  # the one bucket every step of these tests runs in
DENSE_LEN = 24  # the oracle runs on a fixed length (causal: a zero tail changes no earlier row)
TOL = 1e-4

SPEC = KVGroupSpec.for_model_len(BLOCK_SIZE, MAX_MODEL_LEN)
# The batch build is jitted (after an eager validate_schedule of the hand-written schedule): one
# compile instead of many eager ones.
_FAST_COMPILE = FAST_COMPILER_OPTIONS  # kvjax.testing.fast_compile (also in XLA_FLAGS, tests/conftest.py)
STEP = jax.jit(
    forward_step,
    static_argnames=("config", "backend"),
    donate_argnames=("caches",),
    compiler_options=_FAST_COMPILE,
)
BUILD = jax.jit(
    build_step_batch,
    static_argnames=("num_tokens_padded", "num_logits_padded", "backend"),
    compiler_options=_FAST_COMPILE,
)

PROMPT_A = list(b"The quick")  # 9 tokens
PROMPT_B = list(b"jumps")  # 5 tokens


@pytest.fixture(scope="module")
def params():
    return init_params(CONFIG, seed=0)


def dense_logits(params, tokens, kv_cache_dtype="auto"):
    """Oracle logits of ``tokens`` (``[len(tokens), V]``), computed on a fixed-length input."""
    padded = np.zeros(DENSE_LEN, np.int32)
    padded[: len(tokens)] = tokens
    out = dense_forward(params, CONFIG, jnp.asarray(padded), kv_cache_dtype=kv_cache_dtype)
    return np.asarray(out)[: len(tokens)]


def poison(caches: HybridCaches) -> HybridCaches:
    """Every KV byte and every state slot NaN (null block 0 and slot 0 included)."""
    return jax.tree.map(lambda a: jnp.full(a.shape, jnp.nan, a.dtype), caches)


def host(caches: HybridCaches) -> list[np.ndarray]:
    """A host copy of every cache array as raw bytes (for bitwise comparisons)."""
    return [np.asarray(a).view(np.uint8).copy() for a in jax.tree.leaves(caches)]


class Sim:
    """A hand-driven runner: rows, blocks and state slots for a few requests, one bucket.

    ``state_slots[req]`` is one slot, or ``1 + k`` slots with speculative decoding.
    Every logits row the model returns is recorded as ``(req, seen, logits)``, ``seen`` being
    the tokens at positions ``0 .. p`` the step saw (cached tokens + its query window).
    """

    def __init__(self, params, *, kv_cache_dtype="auto", num_spec=0, poisoned=False, kv_layout="flash"):
        self.params = params
        self.num_spec = num_spec
        self.requests = RequestState.create(MAX_NUM_REQS, MAX_MODEL_LEN, num_spec)
        self.tables = BlockTables.create([SPEC], MAX_NUM_REQS, num_cache_blocks=NUM_BLOCKS)
        self.rows = RequestRows(MAX_NUM_REQS)
        self.free_blocks = [3, 9, 5, 12, 7, 14, 2, 10, 6, 13, 1, 11, 4]  # never 0; 8, 15 unused
        self.free_slots = list(range(NUM_STATE_SLOTS - 1, 0, -1))  # never slot 0
        self.used_blocks: set[int] = set()
        self.used_slots: set[int] = set()
        self.state_slots: dict[str, list[int]] = {}
        self.prompts: dict[str, list[int]] = {}
        self.finished: dict[str, list[int]] = {}  # tokens of requests that left
        self.records: list[tuple[str, list[int], np.ndarray]] = []
        caches = init_caches(
            CONFIG, NUM_BLOCKS, BLOCK_SIZE, NUM_STATE_SLOTS, kv_cache_dtype,
            num_spec_tokens=num_spec, kv_layout=kv_layout,
        )
        self.caches = poison(caches) if poisoned else caches

    def add(self, req: str, prompt: list[int]) -> None:
        row = self.rows.add(req)
        self.requests = self.requests.add_request(row, prompt)
        self.prompts[req] = list(prompt)
        slots = [self.free_slots.pop() for _ in range(1 + self.num_spec)]
        self.used_slots.update(slots)
        self.state_slots[req] = slots

    def finish(self, req: str) -> None:
        """Free the request's row, blocks and slots; the next request reuses them first (LIFO)."""
        self.finished[req] = self.tokens(req)
        row = self.rows.remove(req)
        n = int(self.tables.num_blocks[0, row])
        blocks = [int(b) for b in np.asarray(self.tables.tables[0][row, :n])]
        self.free_blocks = blocks + self.free_blocks
        self.free_slots += self.state_slots.pop(req)[::-1]
        self.tables = self.tables.clear_row(row)
        self.requests = self.requests.clear_rows(np.array([row], np.int32))

    def tokens(self, req: str) -> list[int]:
        if req in self.finished:
            return self.finished[req]
        row = self.rows.row(req)
        n = int(self.requests.total_len[row])
        return [int(t) for t in np.asarray(self.requests.all_token_ids[row, :n])]

    def _ensure_blocks(self, req: str, upto: int) -> None:
        row = self.rows.row(req)
        have = int(self.tables.num_blocks[0, row])
        new = [self.free_blocks.pop(0) for _ in range(cdiv(upto, BLOCK_SIZE) - have)]
        if new:
            self.used_blocks.update(new)
            self.tables = self.tables.append_block_ids(row, [new])

    def step(self, schedule, drafts=None) -> None:
        """Run one step. ``schedule``: per batch row ``(req, num_tokens)`` or ``None`` (padded row).

        ``drafts``: ``{req: [draft tokens]}`` for speculative decode rows; verification is greedy.
        """
        drafts = drafts or {}
        known = {req: self.tokens(req) for req in self.prompts if req not in self.finished}
        schedule = list(schedule) + [None] * (R - len(schedule))
        sched = ScheduledBatch(
            idx_mapping=np.full((R,), -1, np.int32),
            num_scheduled_tokens=np.zeros((R,), np.int32),
            num_draft_tokens=np.zeros((R,), np.int32),
        )
        for b, entry in enumerate(schedule):
            if entry is None:
                continue  # a padded row: idx -1, no tokens
            req, n = entry
            row = self.rows.row(req)
            d = drafts.get(req, [])
            if d:
                assert n == 1 + len(d)
                self.requests = self.requests.set_draft_tokens(
                    np.array([row], np.int32),
                    np.array([d + [0] * (self.num_spec - len(d))], np.int32),
                )
            self._ensure_blocks(req, int(self.requests.num_computed_tokens[row]) + n)
            sched.idx_mapping[b], sched.num_scheduled_tokens[b] = row, n
            sched.num_draft_tokens[b] = len(d)
        L = min(T, R * (1 + self.num_spec))
        validate_schedule(self.requests, sched, num_tokens_padded=T, num_logits_padded=L)
        batch = BUILD(self.requests, self.tables, sched, num_tokens_padded=T, num_logits_padded=L)
        si_cols = [
            self.state_slots[e[0]] if e else [NULL_BLOCK_ID] * (1 + self.num_spec)
            for e in schedule
        ]
        if self.num_spec:
            state_indices = np.array(si_cols, np.int32)
            na = np.asarray(self.requests.num_accepted_tokens)[np.maximum(sched.idx_mapping, 0)]
            na = np.where(sched.idx_mapping >= 0, na, 1).astype(np.int32)
        else:
            state_indices, na = np.array([c[0] for c in si_cols], np.int32), None
        logits, self.caches = STEP(
            self.params, CONFIG, batch, self.caches, state_indices, na, backend="reference"
        )
        logits = np.asarray(logits)
        assert np.isfinite(logits).all()
        # Greedy verification: per row, sample the logits rows, accept the matching draft prefix.
        cu = np.asarray(batch.cu_num_logits)
        pos = np.asarray(batch.positions)
        li = np.asarray(batch.logits_indices)
        ids = np.asarray(batch.input_ids)
        qsl = np.asarray(batch.query_start_loc)
        nc = np.asarray(batch.num_computed_tokens)
        S = 1 + self.num_spec
        sampled = np.zeros((R, S), np.int32)
        num_sampled = np.zeros((R,), np.int32)
        for b, entry in enumerate(schedule):
            if entry is None:
                continue
            req = entry[0]
            greedy = [int(np.argmax(logits[i])) for i in range(cu[b], cu[b + 1])]
            for i in range(cu[b], cu[b + 1]):
                window = ids[qsl[b] : li[i] + 1].tolist()
                seen = known[req][: nc[b]] + window
                assert len(seen) - 1 == pos[li[i]]
                self.records.append((req, seen, logits[i]))
            d = drafts.get(req, [])
            n_acc = 0
            while n_acc < len(d) and d[n_acc] == greedy[n_acc]:
                n_acc += 1
            sampled[b, : n_acc + 1] = greedy[: n_acc + 1]
            num_sampled[b] = n_acc + 1
        self.requests = self.requests.post_update(
            sched.idx_mapping, sched.num_scheduled_tokens, sampled, num_sampled
        )

    def check_against_dense(self, kv_cache_dtype="auto") -> int:
        """Every recorded logits row within TOL of the oracle; every generated token its argmax."""
        for req, prompt in self.prompts.items():
            toks = self.tokens(req)
            ref = dense_logits(self.params, toks, kv_cache_dtype)
            for p in range(len(prompt) - 1, len(toks) - 1):
                assert toks[p + 1] == int(np.argmax(ref[p])), (req, p)
        for req, seen, got in self.records:
            want = dense_logits(self.params, seen, kv_cache_dtype)[-1]
            np.testing.assert_allclose(got, want, atol=TOL, rtol=0, err_msg=f"{req} {seen}")
        return len(self.records)


# Chunked prefill of two requests, then greedy decode; a padded row sits in the middle of
# the batch from step 3 on and most steps leave a padded token tail.
SCHEDULE = [
    [("a", 5), None, ("b", 2)],  # both mid-prefill, 1 pad token
    [("b", 3), ("a", 4)],  # b finishes its prompt (samples), a finishes too
    [("a", 1), None, ("b", 1)],  # decode, decode; 6 pad tokens
    [("b", 1), None, ("a", 1)],
    [("a", 1), ("b", 1)],
    [None, ("b", 1)],
    [None, None, ("b", 1)],
]


def run_scenario(params, **kw) -> Sim:
    sim = Sim(params, **kw)
    sim.add("a", PROMPT_A)
    sim.add("b", PROMPT_B)
    for sched in SCHEDULE:
        sim.step(sched)
    return sim


@pytest.fixture(scope="module")
def clean_run(params):
    return run_scenario(params)


def test_mixed_steps_match_dense(clean_run):
    sim = clean_run
    assert len(sim.tokens("a")) == len(PROMPT_A) + 4
    assert len(sim.tokens("b")) == len(PROMPT_B) + 6
    # 2 mid-prefill rows + 4 (a) + 6 (b) sampling rows
    assert sim.check_against_dense() == 12


def test_nan_poisoned_caches_change_nothing(params, clean_run):
    """Null block, unused blocks, unwritten tails of used blocks and unused slots all NaN."""
    sim = run_scenario(params, poisoned=True)
    assert [r[:2] for r in sim.records] == [r[:2] for r in clean_run.records]
    for (_, _, got), (_, _, want) in zip(sim.records, clean_run.records):
        np.testing.assert_array_equal(got, want)  # bitwise: masking is by value, not 0 * x
    for req in ("a", "b"):
        assert sim.tokens(req) == clean_run.tokens(req)
    c = sim.caches
    unused_blocks = sorted(set(range(NUM_BLOCKS)) - sim.used_blocks)
    assert NULL_BLOCK_ID in unused_blocks
    for kv in c.key + c.value:
        assert np.isnan(np.asarray(kv)[unused_blocks]).all()  # never written
    unused_slots = sorted(set(range(NUM_STATE_SLOTS)) - sim.used_slots)
    assert NULL_BLOCK_ID in unused_slots
    for st in c.conv_state + c.ssm_state:
        arr = np.asarray(st)
        assert np.isnan(arr[unused_slots]).all()
        assert np.isfinite(arr[sorted(sim.used_slots)]).all()  # fresh requests never read NaN


def test_reused_row_blocks_and_state_slot_start_clean(params):
    """A request taking over a just-freed row, block and state slot (stale K/V and state)."""
    sim = Sim(params)
    sim.add("a", PROMPT_A)
    sim.add("b", PROMPT_B)
    sim.step([("a", 5), ("b", 3)])
    sim.step([("b", 2), ("a", 3)])  # b samples
    slot_b, row_b = sim.state_slots["b"], sim.rows.row("b")
    blocks_b = np.asarray(sim.tables.tables[0][row_b, :2]).tolist()
    sim.finish("b")
    sim.add("c", list(b"over"))  # LIFO: b's row, b's slot, b's blocks first
    assert sim.state_slots["c"] == slot_b
    sim.step([("c", 3), ("a", 1)])  # c mid-prefill next to a's last prompt token
    sim.step([("a", 1), None, ("c", 1)])  # both sample
    sim.step([("c", 1), ("a", 1)])
    row_c = sim.rows.row("c")
    assert row_c == row_b and int(sim.tables.tables[0][row_c, 0]) == blocks_b[0]  # stale K/V
    assert sim.check_against_dense() == 2 + 2 + 2 + 2 + 2


def assert_dummy_step_is_a_no_op(sim: Sim, state_indices, num_accepted_tokens=None):
    """Run an all-padding batch (PR 39444) and check every cache and state byte is unchanged."""
    before = host(sim.caches)
    # dummy_step_batch(...) is exactly this build of ScheduledBatch.empty (jitted here).
    L = min(T, R * (1 + sim.num_spec))
    dummy = BUILD(
        sim.requests, sim.tables, ScheduledBatch.empty(R), num_tokens_padded=T, num_logits_padded=L
    )
    assert (np.asarray(dummy.idx_mapping) == -1).all() and int(dummy.num_tokens) == 0
    logits, caches = STEP(
        sim.params, CONFIG, dummy, sim.caches, state_indices, num_accepted_tokens,
        backend="reference",
    )
    assert np.isfinite(np.asarray(logits)).all()
    after = host(caches)
    assert len(before) == len(after)
    for b, a in zip(before, after):
        np.testing.assert_array_equal(b, a)


@pytest.mark.parametrize("state_indices", ["null", "live"])
def test_dummy_step_leaves_every_byte_unchanged(params, state_indices):
    """No KV write and no state write, even when live slots are passed for the padded rows."""
    sim = Sim(params, poisoned=True)
    sim.add("a", PROMPT_A)
    sim.step([("a", 6), None])
    si = np.zeros(R, np.int32) if state_indices == "null" else np.array([1, 2, 3], np.int32)
    assert_dummy_step_is_a_no_op(sim, si)


def test_fp8_kv_cache_matches_dense_with_fp8_round_trip(params):
    sim = run_scenario(params, kv_cache_dtype="fp8", poisoned=True)
    assert sim.caches.key[0].dtype == jnp.float8_e4m3fn
    assert sim.check_against_dense("fp8") == 12
    ref_auto = dense_logits(params, sim.tokens("a"))
    ref_fp8 = dense_logits(params, sim.tokens("a"), "fp8")
    assert np.abs(ref_auto - ref_fp8).max() > 10 * TOL  # the fp8 path is really exercised


def test_rpa_kv_layout_matches_dense_with_poison(params):
    """kv_layout="rpa": write_kv_pages + ragged paged attention, every KV byte NaN at start.

    (fp8 through this layout: tests/interop/test_rpa_attention.py.)
    """
    sim = run_scenario(params, kv_layout="rpa", poisoned=True)
    assert sim.check_against_dense() == 12
    assert sim.caches.value == () and len(sim.caches.key) == CONFIG.num_attn_layers
    unused_blocks = sorted(set(range(NUM_BLOCKS)) - sim.used_blocks)
    for pages in sim.caches.key:
        assert pages.shape == (NUM_BLOCKS, BLOCK_SIZE, 2 * CONFIG.num_kv_heads, CONFIG.head_dim)
        assert np.isnan(np.asarray(pages, np.float32)[unused_blocks]).all()  # never written


def test_speculative_decode_matches_dense(params):
    """vLLM-style speculative Mamba: per-token state slots, initial column num_accepted - 1.

    Decode windows of 1-3 tokens with drafts that are all right, all wrong or mixed; the
    outputs must be the plain greedy continuation and every logits row (rejected drafts
    included) must match the oracle on the tokens that step saw.
    """
    k = 2
    sim = Sim(params, num_spec=k, poisoned=True)
    sim.add("a", PROMPT_A)
    sim.add("b", PROMPT_B)
    sim.step([("a", 4), None, ("b", 4)])
    sim.step([("a", 5), ("b", 1)])  # both finish their prompts and sample
    # Oracle greedy continuations, to write drafts that are right (R) or wrong (W).
    want = {}
    for req in ("a", "b"):
        toks = sim.tokens(req)
        while len(toks) < MAX_MODEL_LEN:
            toks.append(int(np.argmax(dense_logits(params, toks)[-1])))
        want[req] = toks
    # All accepted (the next step starts from state column 2), none accepted with drafts
    # (column 0), partial, and a plain decode row in a speculative batch.
    rounds = [
        {"a": "RR", "b": "W"},
        {"b": "RW", "a": "R"},
        {"a": "WW", "b": ""},
        {"a": "RR", "b": "R"},
    ]
    for rnd in rounds:
        drafts, sched = {}, []
        for req, pattern in rnd.items():
            n = len(sim.tokens(req))
            good = want[req][n : n + len(pattern)]
            drafts[req] = [t if c == "R" else (t + 1) % 256 for t, c in zip(good, pattern)]
            sched.append((req, 1 + len(pattern)))
        before = {req: len(sim.tokens(req)) for req in rnd}
        sim.step(sched[:1] + [None] + sched[1:], drafts)
        for req, pattern in rnd.items():
            accepted = len(pattern) - len(pattern.lstrip("R"))
            assert len(sim.tokens(req)) - before[req] == 1 + accepted, (req, pattern)
    # Outputs are exactly the plain greedy continuation.
    for req in ("a", "b"):
        toks = sim.tokens(req)
        assert toks == want[req][: len(toks)]
    # Every logits row, rejected drafts included, against the oracle on the tokens it saw.
    assert sim.check_against_dense() == 4 + 5 + 5 + 4 + 5
    live = np.array([sim.state_slots["a"], sim.state_slots["b"], [1, 2, 3]], np.int32)
    assert_dummy_step_is_a_no_op(sim, live, np.array([3, 2, 1], np.int32))


def test_paged_attention_masks_nan_by_value():
    """A softmax over visible keys only; NaN keys past seq_len / the position are ignored."""
    rng = np.random.default_rng(0)
    Hq, Hkv, D, bs = 4, 2, 8, 4
    kc = rng.standard_normal((4, bs, Hkv, D)).astype(np.float32)
    vc = rng.standard_normal((4, bs, Hkv, D)).astype(np.float32)
    kc[0], vc[0] = np.nan, np.nan  # null block
    kc[2, 2:], vc[2, 2:] = np.nan, np.nan  # past seq_len in the live block
    q = rng.standard_normal((3, Hq, D)).astype(np.float32)
    bt = np.array([[1, 2, 0]], np.int32)  # one row; column 2 is the null block
    out = jax.jit(paged_attention, compiler_options=_FAST_COMPILE)(
        jnp.asarray(q), jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(bt),
        jnp.array([6], jnp.int32), jnp.array([3, 5, 0], jnp.int32), jnp.array([0, 0, 1], jnp.int32),
    )
    out = np.asarray(out)
    keys = np.concatenate([kc[1], kc[2]])[:6]  # [6, Hkv, D]
    vals = np.concatenate([vc[1], vc[2]])[:6]
    for t, p in ((0, 3), (1, 5)):
        for h in range(Hq):
            s = keys[: p + 1, h // 2] @ q[t, h] / np.sqrt(D)
            w = np.exp(s - s.max())
            np.testing.assert_allclose(out[t, h], (w / w.sum()) @ vals[: p + 1, h // 2], atol=1e-5)
    np.testing.assert_array_equal(out[2], 0.0)  # pad token (row == R): no key visible


def test_params_are_deterministic_and_configs_validated():
    a, b = init_params(CONFIG, 0), init_params(CONFIG, 0)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    c = init_params(CONFIG, 1)
    assert not np.array_equal(a["params"]["embed"], c["params"]["embed"])
    with pytest.raises(ValueError, match="num_kv_heads"):
        TinyHybridConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="layer_types"):
        TinyHybridConfig(layer_types=("attn", "mlp"))
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        init_caches(CONFIG, 4, 4, 4, "int8")


def test_forward_step_rejects_inconsistent_state_arguments(params):
    sim = Sim(params)  # conv states sized for num_spec_tokens=0
    batch = BUILD(sim.requests, sim.tables, ScheduledBatch.empty(R), num_tokens_padded=T,
                  num_logits_padded=R)
    spec_indices = np.zeros((R, 3), np.int32)
    with pytest.raises(ValueError, match="num_accepted_tokens"):
        forward_step(params, CONFIG, batch, sim.caches, spec_indices)
    with pytest.raises(ValueError, match="num_spec_tokens"):
        forward_step(params, CONFIG, batch, sim.caches, spec_indices, np.ones(R, np.int32))
    with pytest.raises(ValueError, match="state_indices"):
        forward_step(params, CONFIG, batch, sim.caches, np.zeros(R + 1, np.int32))


def test_cache_arrays_round_trip_through_zero_blocks():
    """Fresh blocks / slots of every layer zeroed in one launch, then the caches rebuilt."""
    from pallas_kernels.block_zero import zero_blocks

    caches = poison(init_caches(CONFIG, NUM_BLOCKS, BLOCK_SIZE, NUM_STATE_SLOTS, "fp8"))
    caches = caches.replace_kv_arrays(
        zero_blocks(caches.kv_arrays, np.array([3, -1, 5], np.int32), backend="reference")
    )
    caches = caches.replace_state_arrays(
        zero_blocks(caches.state_arrays, np.array([2], np.int32), backend="reference")
    )
    assert caches.kv_cache_dtype == "fp8" and len(caches.key) == CONFIG.num_attn_layers
    for kv in caches.key + caches.value:
        a = np.asarray(kv).astype(np.float32)
        assert (a[[3, 5]] == 0).all() and np.isnan(np.delete(a, [3, 5], axis=0)).all()
    for st in caches.conv_state + caches.ssm_state:
        a = np.asarray(st)
        assert (a[2] == 0).all() and np.isnan(np.delete(a, 2, axis=0)).all()
    with pytest.raises(ValueError, match="KV arrays"):
        caches.replace_kv_arrays(caches.kv_arrays[:1])


def test_linear_out_dtype_rounds_the_float32_sum_once():
    """``linear(out_dtype=bf16)`` is the float32 product (and bias) rounded once to bf16, on
    every path: bf16 weights with and without a bias, and float32 weights."""
    from kvjax.models.attention import linear

    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((5, 24)).astype(np.float32))
    for dtype in (jnp.bfloat16, jnp.float32):
        w = jnp.asarray(rng.standard_normal((24, 7)).astype(np.float32)).astype(dtype)
        b = jnp.asarray(rng.standard_normal(7).astype(np.float32))
        for bias in (None, b):
            wide = linear(x, w, bias)
            got = linear(x, w, bias, out_dtype=jnp.bfloat16)
            assert wide.dtype == jnp.float32 and got.dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(got), np.asarray(wide.astype(jnp.bfloat16)))
