"""kvjax inside another engine's jitted step, without ``kvjax.runner``.

``ToyEngine`` stands for your engine: its own model (one attention layer with
its own paged attention), its own host loop and its own ``jax.jit`` step with
the state donated. It adopts kvjax piece by piece:

* host bookkeeping: ``kvjax.BlockPool`` (block 0 reserved, every allocated block
  reported once for zeroing) and ``kvjax.RequestRows`` (request id <-> row);
* device state: ``kvjax.RequestState`` and ``kvjax.BlockTables``, updated inside
  the step by their pure functions (``clear_rows``, ``add_requests``,
  ``write_rows``, ``post_update``);
* ``kvjax.build_step_batch``: the one function that applies every padding
  rule (``PAD_SLOT_ID`` slots past the real tokens, ``NULL_BLOCK_ID`` table
  rows, logits indices) and combines each decode row's last sampled token into
  the inputs (``pallas_kernels.combine_sampled_and_draft_tokens``);
* kernels: ``zero_blocks`` on the fresh blocks and ``reshape_and_cache_flash``
  for the K/V write at the batch's slot mapping.

The cache starts filled with NaN (null block included): only zeroed or written
memory may be read. Every output is checked against recomputing the request
from scratch, and an all-padding step must leave the cache bitwise unchanged.
Run: ``python examples/engine_integration.py`` (exit status 1 on a mismatch).
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

import kvjax
from pallas_kernels import reshape_and_cache_flash, zero_blocks

VOCAB, D_MODEL, HEADS, HEAD_DIM = 64, 32, 2, 8
BLOCK_SIZE, NUM_BLOCKS, MAX_MODEL_LEN = 4, 32, 32
MAX_ROWS, STEP_TOKENS = 3, 16  # the engine's one bucket: 3 rows, 16 tokens
SPECS = (kvjax.KVGroupSpec.for_model_len(BLOCK_SIZE, MAX_MODEL_LEN),)
MAX_NEW_BLOCKS = STEP_TOKENS // BLOCK_SIZE + 1  # per row and step


# ----------------------------------------------------------------- the engine's model


def init_params(seed: int = 0) -> dict:
    ks = jax.random.split(jax.random.key(seed), 6)

    def w(k, shape):
        return jax.random.normal(k, shape, jnp.float32) / np.sqrt(shape[0])

    return {"embed": jax.random.normal(ks[0], (VOCAB, D_MODEL)),
            "pos": 0.3 * jax.random.normal(ks[1], (MAX_MODEL_LEN, D_MODEL)),
            "wq": w(ks[2], (D_MODEL, HEADS * HEAD_DIM)), "wk": w(ks[3], (D_MODEL, HEADS * HEAD_DIM)),
            "wv": w(ks[4], (D_MODEL, HEADS * HEAD_DIM)), "out": w(ks[5], (HEADS * HEAD_DIM, VOCAB))}


def qkv(params, tokens, positions):
    """Queries, keys and values ``[n, HEADS, HEAD_DIM]`` of tokens at absolute positions."""
    x = params["embed"][tokens] + params["pos"][positions]
    return tuple((x @ params[w]).reshape(-1, HEADS, HEAD_DIM) for w in ("wq", "wk", "wv"))


def my_paged_attention(q, k_cache, v_cache, batch: kvjax.StepBatch):
    """The engine's own attention over the paged cache, read as a paged kernel reads it.

    Token ``t`` of row ``b`` attends to positions ``j <= positions[t]``, ``j < seq_lens[b]``
    through ``batch.block_tables[0][b]``. Like a real kernel it reads whole blocks up to
    the row's last one and gives invisible positions probability 0, but ``0 * NaN`` is
    NaN: the unwritten tail of a live block must hold zeros, not whatever the block held
    before (NaN here). That is what zero-on-allocate guarantees.
    """
    T, R = q.shape[0], batch.num_reqs_padded
    row = batch.request_of_token  # [T], R for pad tokens
    real = row < R
    safe = jnp.where(real, row, 0)
    table = batch.block_tables[0][safe]  # [T, W]
    S = table.shape[1] * BLOCK_SIZE
    j = jnp.arange(S)
    seq_len = batch.seq_lens[safe][:, None]
    read = real[:, None] & (j[None] < kvjax.cdiv(seq_len, BLOCK_SIZE) * BLOCK_SIZE)  # whole live blocks
    visible = read & (j[None] <= batch.positions[:, None]) & (j[None] < seq_len)
    k = k_cache[table].reshape(T, S, HEADS, HEAD_DIM)
    v = jnp.where(read[..., None, None], v_cache[table].reshape(T, S, HEADS, HEAD_DIM), 0.0)
    s = jnp.where(visible[:, None], jnp.einsum("thd,tshd->ths", q, k) / np.sqrt(HEAD_DIM), -1e30)
    p = jax.nn.softmax(s, axis=-1)  # exactly 0 where invisible
    return jnp.einsum("ths,tshd->thd", p, v).reshape(T, HEADS * HEAD_DIM)


def reference_logits(params, tokens) -> np.ndarray:
    """One request recomputed from scratch: causal attention, no cache, no padding."""
    n = len(tokens)
    q, k, v = qkv(params, jnp.asarray(tokens), jnp.arange(n))
    s = jnp.einsum("qhd,khd->hqk", q, k) / np.sqrt(HEAD_DIM)
    p = jax.nn.softmax(jnp.where(np.tril(np.ones((n, n), bool)), s, -jnp.inf), axis=-1)
    return np.asarray(jnp.einsum("hqk,khd->qhd", p, v).reshape(n, -1) @ params["out"])


# ------------------------------------------------------ the engine's device state and step


@struct.dataclass
class EngineState:
    requests: kvjax.RequestState
    tables: kvjax.BlockTables
    k_cache: jax.Array  # [NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM]
    v_cache: jax.Array


@struct.dataclass
class StepInputs:
    """Fixed shapes, so the step compiles once: ``-1`` pads rows and block ids."""

    cleared_rows: np.ndarray  # int32 [MAX_ROWS] rows freed since the last step
    new: kvjax.NewRequests  # requests installed this step
    write_rows: np.ndarray  # int32 [MAX_ROWS] block-table appends: row,
    write_ids: np.ndarray  # int32 [MAX_ROWS, MAX_NEW_BLOCKS] ids,
    write_num: np.ndarray  # int32 [1, MAX_ROWS] how many,
    write_overwrite: np.ndarray  # bool [MAX_ROWS] new tenant: rewrite the whole row
    zero_ids: np.ndarray  # int32 [MAX_ROWS * MAX_NEW_BLOCKS] fresh blocks
    sched: kvjax.ScheduledBatch


@functools.partial(jax.jit, donate_argnums=(1,))
def engine_step(params, state: EngineState, inp: StepInputs):
    empty = [jnp.zeros((MAX_ROWS, 0), jnp.int32)]
    requests = state.requests.clear_rows(inp.cleared_rows)
    tables = state.tables.write_rows(inp.cleared_rows, empty, jnp.zeros((1, MAX_ROWS), jnp.int32),
                                     jnp.ones((MAX_ROWS,), bool))
    requests = requests.add_requests(inp.new)
    tables = tables.write_rows(inp.write_rows, [inp.write_ids], inp.write_num, inp.write_overwrite)
    # Zero-on-allocate: fresh blocks hold the previous tenant's K/V (or NaN) until zeroed.
    k_cache, v_cache = zero_blocks([state.k_cache, state.v_cache], inp.zero_ids)
    batch = kvjax.build_step_batch(requests, tables, inp.sched, num_tokens_padded=STEP_TOKENS)
    q, k, v = qkv(params, batch.input_ids, batch.positions)
    # PAD_SLOT_ID past the real tokens: padding writes nothing, not even into the null block.
    k_cache, v_cache = reshape_and_cache_flash(k, v, k_cache, v_cache, batch.slot_mappings[0])
    logits = (my_paged_attention(q, k_cache, v_cache, batch) @ params["out"])[batch.logits_indices]
    # Greedy sampling, one token per row with logits (no drafts in this engine).
    has_logits = batch.cu_num_logits[1:] > batch.cu_num_logits[:-1]
    sampled = jnp.argmax(logits, axis=-1).astype(jnp.int32)[batch.cu_num_logits[:-1]][:, None]
    num_sampled = has_logits.astype(jnp.int32)
    requests = requests.post_update(inp.sched.idx_mapping, inp.sched.num_scheduled_tokens,
                                    jnp.where(has_logits[:, None], sampled, 0), num_sampled)
    state = EngineState(requests, tables, k_cache, v_cache)
    row_logits = jnp.where(has_logits[:, None], logits[batch.cu_num_logits[:-1]], 0.0)  # [R, VOCAB]
    return state, (sampled[:, 0], row_logits)


# ------------------------------------------------------------------ the engine's host loop


class ToyEngine:
    def __init__(self, seed: int = 0):
        self.params = init_params(seed)
        nan = jnp.full((NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM), jnp.nan, jnp.float32)
        self.state = EngineState(kvjax.RequestState.create(MAX_ROWS, MAX_MODEL_LEN),
                                 kvjax.BlockTables.create(SPECS, MAX_ROWS, num_cache_blocks=NUM_BLOCKS),
                                 nan, nan + 0)
        self.pool = kvjax.BlockPool(NUM_BLOCKS)
        self.rows = kvjax.RequestRows(MAX_ROWS)
        self.waiting, self.running, self.finished = [], {}, {}
        self.cleared: list[int] = []

    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> None:
        self.waiting.append((req_id, prompt, max_tokens))

    def _inputs(self, scheduled, added) -> StepInputs:
        """Pack one step: ``scheduled`` is ``[(req_id, num_tokens)]``, ``added`` the new ones."""
        w_rows = np.full((MAX_ROWS,), -1, np.int32)
        w_ids = np.zeros((MAX_ROWS, MAX_NEW_BLOCKS), np.int32)
        w_num = np.zeros((1, MAX_ROWS), np.int32)
        w_ow = np.zeros((MAX_ROWS,), bool)
        for u, (rid, n) in enumerate(scheduled):
            r = self.running[rid]
            need = SPECS[0].blocks_to_add(r["computed"] + n, len(r["blocks"]))
            ids = self.pool.allocate(need)
            r["blocks"] += ids
            w_rows[u], w_num[0, u], w_ow[u] = r["row"], need, rid in added
            w_ids[u, :need] = ids
        zero = np.full((MAX_ROWS * MAX_NEW_BLOCKS,), -1, np.int32)
        fresh = self.pool.take_ids_to_zero()
        zero[: len(fresh)] = fresh
        cleared = np.full((MAX_ROWS,), -1, np.int32)
        cleared[: len(self.cleared)], self.cleared = self.cleared, []
        new = kvjax.NewRequests.from_lists([self.running[rid]["row"] for rid in added],
                                           [self.running[rid]["prompt"] for rid in added],
                                           max_model_len=MAX_MODEL_LEN, pad_to=MAX_ROWS)
        sched = kvjax.ScheduledBatch.from_lists([self.running[rid]["row"] for rid, _ in scheduled],
                                                [n for _, n in scheduled], pad_to=MAX_ROWS)
        return StepInputs(cleared, new, w_rows, w_ids, w_num, w_ow, zero, sched)

    def step(self) -> None:
        budget, added = STEP_TOKENS, []
        scheduled = [(rid, 1) for rid in self.running]  # decodes first: one token each
        budget -= len(scheduled)
        while self.waiting and len(self.running) < MAX_ROWS and len(self.waiting[0][1]) <= budget:
            rid, prompt, max_tokens = self.waiting.pop(0)
            self.running[rid] = {"row": self.rows.add(rid), "prompt": prompt, "max_tokens": max_tokens,
                                 "blocks": [], "computed": 0, "output": [], "logits": []}
            scheduled.append((rid, len(prompt)))
            added.append(rid)
            budget -= len(prompt)
        self.state, (sampled, logits) = engine_step(self.params, self.state,
                                                                self._inputs(scheduled, added))
        sampled, logits = np.asarray(sampled), np.asarray(logits)
        for b, (rid, n) in enumerate(scheduled):
            r = self.running[rid]
            r["computed"] += n
            r["output"].append(int(sampled[b]))
            r["logits"].append(logits[b])
            if len(r["output"]) == r["max_tokens"] or r["computed"] + 1 >= MAX_MODEL_LEN:
                self.finished[rid] = self.running.pop(rid)
                self.cleared.append(self.rows.remove(rid))
                self.pool.free(r["blocks"])

    def dummy_step(self) -> None:
        """An all-padding step (an idle data-parallel rank): it must write nothing."""
        self.state, _ = engine_step(self.params, self.state, self._inputs([], []))


def main() -> int:
    # float32 matmuls stay float32 on GPUs too (their default, TF32, moves logits by ~1e-3).
    jax.config.update("jax_default_matmul_precision", "highest")
    engine = ToyEngine(seed=0)
    rng = np.random.default_rng(0)
    for i in range(5):  # 5 requests through 3 rows: freed rows and blocks are reused
        engine.add(f"req{i}", rng.integers(0, VOCAB, int(rng.integers(3, 10))).tolist(), int(rng.integers(2, 7)))
    steps = 0
    while engine.waiting or engine.running:
        engine.step()
        steps += 1
    before = jax.tree.map(np.asarray, (engine.state.k_cache, engine.state.v_cache))
    engine.dummy_step()
    after = jax.tree.map(np.asarray, (engine.state.k_cache, engine.state.v_cache))
    dummy_ok = all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(before, after))
    # Nothing ever writes the null block: it still holds the NaN it started with (vLLM PR 39444).
    null_ok = all(np.isnan(a[kvjax.NULL_BLOCK_ID]).all() for a in after)
    ok = dummy_ok and null_ok
    for rid, r in sorted(engine.finished.items()):
        seq = r["prompt"] + r["output"]
        ref = reference_logits(engine.params, seq[:-1])[len(r["prompt"]) - 1:]
        got = np.stack(r["logits"])
        err = float(np.abs(got - ref).max())  # NaN if any logit is NaN
        match = ref.argmax(-1).tolist() == r["output"] and err <= 1e-4  # NaN: no match
        ok &= match
        print(f"{rid}: prompt {len(r['prompt'])} tokens, output {r['output']}, max logit error {err:.2g}: "
              f"{'matches' if match else 'DIFFERS FROM'} the reference")
    print(f"{steps} steps; null block never written: {null_ok}; "
          f"all-padding step left the cache bitwise unchanged: {dummy_ok}")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
