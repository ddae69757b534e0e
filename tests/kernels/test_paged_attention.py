"""paged_attention: the GPU kernel (interpret mode) and the jnp reference against float64 numpy.

Every step is ragged (decode rows, chunked-prefill rows crossing tile windows,
speculative windows, rows with a table but no token, rows whose ``seq_len`` is 0,
pad tokens before, between and after the rows) and poisoned: the null block, every
free block and every row's unwritten tail hold NaN. The oracle walks one token at a
time over exactly the keys it sees, in float64, from the stored values. The kernel
runs its body through Pallas' interpreter (``backend="pallas_gpu"`` on a CPU); its
Triton lowering is built and verified for CUDA at the end.

Planted bugs each test was seen to fail on (then restored):

* the kernel's loop reads one block too many (``live = j < n_keys + bs``): NaN
  tails reach V; the poisoned mixed-step, GQA and tile/split tests fail (NaN);
* a row's keys rounded up to whole blocks (``kv_len`` = ``seq_len`` rounded up to
  ``bs``): the interleaved test fails (its token past ``seq_len`` reads the tail);
  every other token's causal limit hides this one;
* the pad-token zero store removed: ``test_pad_and_empty_tokens_get_exact_zeros``
  and the mixed-step tests fail (the interpreter does not zero the output);
* a tile starting only at aligned windows (the row-change start dropped): the
  mixed-step and interleaved tests fail (tokens of a run starting mid-window are
  never written);
* the split combine ignoring each split's running max (``w = l``): the 4-split
  tile test fails;
* the reference scaling scores by ``sqrt(D)`` instead of ``1 / sqrt(D)``:
  ``test_reference_is_the_models_attention_bitwise`` fails.
* every feature block's columns clamped into the row, as only a padded block needs: both
  lowering tests fail (a clamp on a row of columns);
* the split combine's weights without ``exp(m - top)``: 2 tests fail; its log-sum-exp's sum off
  by one: 3 fail; its guard on padded lanes removed: ``test_gqa_ratios``' 4-split case fails;
* the split rule's count left unrounded (3, 5, 7 splits): ``test_split_counts_are_powers_of_two``
  fails;
* the shared-memory rule's budget fixed at Hopper's: ``test_tiles_fit_shared_memory`` fails;
* the combine loading every split's output row (not only those whose sum is > 0): the
  dead-splits test and five end-to-end split tests fail; the kernel writing no output row where
  there are no split statistics either: 18 tests fail;
* ``gpu_max_kv_splits`` back at 64: the MLA lowering test fails (its combine tiles).

Not observable here: a tile taking in the next row's tokens (membership without the
row check). The interpreter runs programs in grid order, so the later, right tile
overwrites them; on a GPU it would be a race between two stores.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kvjax.testing.asserts import assert_bitwise
from pallas_kernels import backend as _backend  # the public module (test_kernel_hygiene)
from pallas_kernels import gpu_tiling
from pallas_kernels.paged_attention import (
    PagedAttentionConfig,
    paged_attention,
    paged_attention_reference,
)
from tests.cuda_lowering import lower_for_cuda

FP8 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16
GPU = "pallas_gpu"


# --------------------------------------------------------------------------
# Steps and the oracle
# --------------------------------------------------------------------------


def make_step(seed, rows, *, T, R, W, N, bs, Hq, Hkv, D, order=None, pads=(),
              qdt=np.float32, cdt=np.float32, k_scale=None, v_scale=None):
    """A poisoned ragged step.

    ``rows``: per row ``(seq_len, query_len)``; row ``b``'s query is its last
    ``query_len`` positions. ``order``: token order as a list of row ids (default:
    rows in order); ``pads``: token indices where pad tokens go (the rest of the ``T``
    slots after the real tokens are pads too).
    """
    rng = np.random.default_rng(seed)
    assert len(rows) <= R
    seq = np.zeros((R,), np.int32)
    table = np.zeros((R, W), np.int32)
    free = list(rng.permutation(np.arange(1, N)))
    for b, (L, _) in enumerate(rows):
        seq[b] = L
        for c in range(-(-L // bs)):
            table[b, c] = free.pop()
    tokens = []  # (row, position)
    # Row b's query: its last q positions (a row with seq_len 0: positions 0 .. q - 1).
    queues = {b: list(range(L - q, L) if L else range(q)) for b, (L, q) in enumerate(rows)}
    for b in order if order is not None else [b for b, (_, q) in enumerate(rows) for _ in range(q)]:
        tokens.append((b, queues[b].pop(0)))
    assert all(not v for v in queues.values())
    token_row = np.full((T,), R, np.int32)
    positions = rng.integers(-3, 40, size=T).astype(np.int32)  # pads: anything
    slots = [t for t in range(T) if t not in pads]
    assert len(tokens) <= len(slots)
    for t, (b, p) in zip(slots, tokens):
        token_row[t], positions[t] = b, p
    q = rng.standard_normal((T, Hq, D)).astype(np.float32)
    k = rng.standard_normal((N, bs, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((N, bs, Hkv, D)).astype(np.float32)
    live = np.zeros((N, bs), bool)
    for b in range(R):
        for j in range(seq[b]):
            live[table[b, j // bs], j % bs] = True
    k[~live], v[~live] = np.nan, np.nan  # null block, free blocks, tails
    if np.dtype(cdt) == np.dtype(FP8):
        k, v = (x / np.asarray(s, np.float32).reshape(1, 1, -1, 1) for x, s in
                ((k, k_scale), (v, v_scale)))
    return dict(q=q.astype(qdt), key_cache=k.astype(cdt), value_cache=v.astype(cdt),
                block_table=table, seq_lens=seq, positions=positions, token_row=token_row)


def oracle(a, *, sm_scale=None, k_scale=None, v_scale=None, with_lse=False):
    """float64, one token at a time, over exactly the keys it sees. ``with_lse``: also each
    head's log-sum-exp of its scaled visible scores ``[T, Hq]`` (-inf: none)."""
    q = a["q"].astype(np.float64)
    k, v = a["key_cache"].astype(np.float64), a["value_cache"].astype(np.float64)
    if k_scale is not None:
        k = k * np.asarray(k_scale, np.float64).reshape(1, 1, -1, 1)
        v = v * np.asarray(v_scale, np.float64).reshape(1, 1, -1, 1)
    table, seq = a["block_table"], a["seq_lens"]
    T, Hq, D = q.shape
    R, W = table.shape
    bs, Hkv = k.shape[1], k.shape[2]
    scale = 1 / np.sqrt(D) if sm_scale is None else sm_scale
    out = np.zeros((T, Hq, v.shape[-1]))
    lse = np.full((T, Hq), -np.inf)
    for t in range(T):
        b = a["token_row"][t]
        if b == R:
            continue
        n = min(int(seq[b]), int(a["positions"][t]) + 1, W * bs)
        if n <= 0:
            continue
        j = np.arange(n)
        kk, vv = k[table[b, j // bs], j % bs], v[table[b, j // bs], j % bs]
        for h in range(Hq):
            s = kk[:, h // (Hq // Hkv)] @ q[t, h] * scale
            p = np.exp(s - s.max())
            out[t, h] = p @ vv[:, h // (Hq // Hkv)] / p.sum()
            lse[t, h] = s.max() + np.log(p.sum())
    return (out, lse) if with_lse else out


def check(got, want, tol, a):
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    assert not np.isnan(got).any(), f"NaN at {np.argwhere(np.isnan(got))[:3].tolist()}"
    err = np.abs(got - want).max()
    assert err <= tol, f"max |got - oracle| = {err:.3g} > {tol}"
    pads = a["token_row"] == a["block_table"].shape[0]
    assert (got[pads] == 0).all(), "a pad token's output is not 0"


TOL = {np.dtype(np.float32): 2e-5, np.dtype(BF16): 3e-2}

# One mixed step of every kind of row (T=24, R=7, W=5, bs=4: 20 keys per table).
MIXED_ROWS = [
    (17, 1),  # decode, partial last block
    (20, 9),  # chunked prefill over a full table, crossing tile windows
    (6, 3),  # speculative window inside one block
    (0, 0),  # idle row, no table
    (11, 0),  # a table but no token this step
    (4, 1),  # decode, exactly one full block
    (0, 2),  # seq_len 0 with tokens: they see nothing
]
MIXED = dict(T=24, R=7, W=5, N=24, bs=4, pads=(0, 5, 19))


def mixed(seed, Hq=4, Hkv=2, D=16, **kw):
    return make_step(seed, MIXED_ROWS, Hq=Hq, Hkv=Hkv, D=D, **{**MIXED, **kw})


# --------------------------------------------------------------------------
# The reference is the model's attention, and both flavours match the oracle
# --------------------------------------------------------------------------


@pytest.mark.parametrize("fp8", [False, True])
def test_reference_is_the_models_attention_bitwise(fp8):
    """float32: what ``kvjax.models.attention.paged_attention`` computes today, bit for bit."""
    from kvjax.models.attention import paged_attention as model_attention

    scales = dict(k_scale=0.5, v_scale=0.25) if fp8 else {}
    a = mixed(0, cdt=FP8 if fp8 else np.float32, **scales)
    want = model_attention(*(jnp.asarray(x) for x in a.values()), **scales)
    got = paged_attention_reference(*a.values(), **scales)
    assert_bitwise(got, want, "reference")
    check(got, oracle(a, **scales), 2e-5, a)


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("backend", ["reference", GPU])
def test_poisoned_mixed_step_matches_the_oracle(backend, seed):
    a = mixed(seed)
    check(paged_attention(*a.values(), backend=backend), oracle(a), 2e-5, a)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("Hq,Hkv", [(6, 2), (8, 1)], ids=["gqa-3-padded-to-4", "gqa-8"])
def test_gqa_ratios(Hq, Hkv, splits):
    """Groups of 3 heads run padded to 4, with 1 or 4 splits (the split combine over padded
    groups: its padded lanes store nothing; planted, a padded lane's store into the next
    head's row fails the 4-split case, the combine's lanes running in reverse order)."""
    a = mixed(4, Hq=Hq, Hkv=Hkv)
    cfg = PagedAttentionConfig(gpu_kv_splits=splits, gpu_block_n=2)
    check(paged_attention(*a.values(), backend=GPU, config=cfg), oracle(a), 2e-5, a)


@pytest.mark.parametrize("qdt,cdt", [(BF16, BF16), (np.float32, BF16)],
                         ids=["bf16", "f32-q-bf16-cache"])
def test_dtypes(qdt, cdt):
    a = mixed(5, qdt=qdt, cdt=cdt)
    want = oracle(a)
    for backend in ("reference", GPU):
        got = paged_attention(*a.values(), backend=backend)
        assert got.dtype == np.dtype(qdt)
        check(got, want, TOL[np.dtype(qdt)], a)


@pytest.mark.parametrize("scale_shape", [(), (2,)], ids=["one-scale", "per-kv-head"])
def test_fp8_caches_dequantised_by_scale(scale_shape):
    ks = np.full(scale_shape, 0.5, np.float32) if scale_shape else 0.5
    vs = np.array([0.25, 2.0], np.float32) if scale_shape else 0.25
    a = mixed(6, qdt=BF16, cdt=FP8, k_scale=ks, v_scale=vs)
    want = oracle(a, k_scale=ks, v_scale=vs)
    for backend in ("reference", GPU):
        check(paged_attention(*a.values(), k_scale=ks, v_scale=vs, backend=backend), want,
              3e-2 * max(1.0, float(np.max(vs))), a)


@pytest.mark.parametrize(
    "config", [PagedAttentionConfig(gpu_kv_splits=1, gpu_block_m=4, gpu_block_n=8),
               PagedAttentionConfig(gpu_kv_splits=4, gpu_block_m=32, gpu_block_n=2)],
    ids=["1-split-tiles-of-2-tokens-chunks-of-2-blocks",
         "4-splits-tiles-of-16-tokens-chunks-of-half-a-block"])
def test_tiles_chunks_and_splits(config):
    a = mixed(7)
    check(paged_attention(*a.values(), backend=GPU, config=config), oracle(a), 2e-5, a)


def test_interleaved_rows_positions_out_of_range_and_sm_scale():
    """Tokens of one row in separate runs, rows interleaved, a decode token whose position is
    past its seq_len (sees every live key) and one with a negative position (sees none);
    scores scaled by ``sm_scale``."""
    rows = [(9, 4), (5, 2), (13, 3)]
    order = [0, 1, 0, 2, 0, 1, 2, 2, 0]
    a = make_step(9, rows, T=12, R=4, W=4, N=16, bs=4, Hq=4, Hkv=2, D=16, order=order,
                  pads=(2,))
    a["positions"][0] = 50  # row 0: every one of its 9 keys
    a["positions"][4] = -7  # row 2: nothing
    want = oracle(a, sm_scale=0.3)
    for backend in ("reference", GPU):
        check(paged_attention(*a.values(), sm_scale=0.3, backend=backend), want, 2e-5, a)


@pytest.mark.parametrize("backend", ["reference", GPU])
def test_pad_and_empty_tokens_get_exact_zeros(backend):
    """A dummy step (every token a pad token), and a step whose rows all have seq_len 0."""
    a = mixed(10)
    a["token_row"][:] = a["block_table"].shape[0]
    out = np.asarray(paged_attention(*a.values(), backend=backend))
    assert_bitwise(out, np.zeros_like(out), "dummy step")
    b = mixed(11)
    b["seq_lens"][:] = 0
    out = np.asarray(paged_attention(*b.values(), backend=backend))
    assert_bitwise(out, np.zeros_like(out), "seq_len 0 everywhere")


def test_empty_shapes():
    a = mixed(12)
    for backend in ("reference", GPU):
        out = paged_attention(a["q"][:0], a["key_cache"], a["value_cache"], a["block_table"],
                              a["seq_lens"], a["positions"][:0], a["token_row"][:0],
                              backend=backend)
        assert out.shape == (0, 4, 16)
        out = paged_attention(a["q"], a["key_cache"], a["value_cache"], a["block_table"][:0],
                              a["seq_lens"][:0], a["positions"], np.zeros((24,), np.int32),
                              backend=backend)
        assert_bitwise(np.asarray(out), np.zeros((24, 4, 16), np.float32), "no rows")


def test_traced_bad_ids_read_nothing_out_of_range():
    """Under jit nothing is value-checked. Garbage ids in columns past a row's live keys and in
    a row without tokens change nothing; a token row past R is a pad token; a garbage id in a
    live column reads nothing out of range (its keys count as zeros; only that row differs)."""
    a = mixed(13)
    want = oracle(a)
    a["block_table"][2, 3] = 10**6  # row 2: 6 keys in columns 0-1
    a["block_table"][5, 2] = -5  # row 5: 4 keys in column 0
    a["block_table"][4, 1] = 10**6  # row 4: no tokens this step
    a["block_table"][1, 2] = -(10**6)  # row 1: live column
    a["token_row"][0] = 99
    got = np.asarray(jax.jit(lambda *x: paged_attention(*x, backend=GPU))(*a.values()))
    assert not np.isnan(got).any()
    assert (got[0] == 0).all()
    others = a["token_row"] != 1
    np.testing.assert_allclose(got[others], want[others], atol=2e-5)


# --------------------------------------------------------------------------
# Argument checks, routing
# --------------------------------------------------------------------------


def test_value_checks_when_concrete():
    a = mixed(14)

    def call(**over):
        return paged_attention(*{**a, **over}.values(), backend="reference")

    bad_table = a["block_table"].copy()
    bad_table[2, 1] = 24
    with pytest.raises(ValueError, match=r"block_table must have values in \[0, 24\)"):
        call(block_table=bad_table)
    with pytest.raises(ValueError, match=r"seq_lens must have values in \[0, 21\)"):
        call(seq_lens=np.full((7,), 21, np.int32))
    with pytest.raises(ValueError, match=r"token_row must have values in \[0, 8\)"):
        call(token_row=np.full((24,), -1, np.int32))
    with pytest.raises(ValueError, match="positions must have dtype int32"):
        call(positions=a["positions"].astype(np.int64))
    with pytest.raises(ValueError, match="q must have dtype float32 or bfloat16 or float16"):
        call(q=a["q"].astype(FP8))
    with pytest.raises(ValueError, match="multiple of the caches' kv heads"):
        call(q=np.zeros((24, 3, 16), np.float32))
    with pytest.raises(ValueError, match="value_cache must have dtype float32"):
        call(value_cache=a["value_cache"].astype(BF16))
    with pytest.raises(ValueError, match="k_scale is required"):
        call(key_cache=a["key_cache"].astype(FP8), value_cache=a["value_cache"].astype(FP8))
    with pytest.raises(ValueError, match="gpu_block_n must be a power of two"):
        PagedAttentionConfig(gpu_block_n=48)


@pytest.mark.parametrize("backend", ["reference", GPU])
@pytest.mark.parametrize("D,Dv,shared", [(24, 24, False), (40, 16, False), (36, 32, True), (48, 48, False),
                                         (48, 16, True)],
                         ids=["pad-24", "dv-16", "latent-36-32", "blocks-32-16", "latent-48-16"])
def test_head_sizes_not_powers_of_two_and_shared_latent_values(backend, D, Dv, shared):
    """Head sizes need not be powers of two (the GPU kernel pads its blocks and masks the rest,
    or, at 48 = 32 + 16, reads two unpadded blocks, the second from column 32); values may have
    their own head size, or be the keys' first ``v_head_dim`` features (``value_cache=None``: a
    latent cache read as MQA, MLA's absorbed form; at 48 / 16 the values are narrower than the
    keys' first block). Poisoned mixed step against the float64 oracle; the padded columns'
    NaN-free zeros never reach an output."""
    a = mixed(7, Hq=4, Hkv=1 if shared else 2, D=D)
    v_full = a["value_cache"]
    if shared:
        a["value_cache"] = a["key_cache"][..., :Dv]  # what the oracle reads
    else:
        rng = np.random.default_rng(3)
        a["value_cache"] = np.where(np.isnan(v_full[..., :1]), np.nan,
                                    rng.standard_normal(v_full.shape[:3] + (Dv,))).astype(np.float32)
    want = oracle(a)
    args = dict(a)
    if shared:
        args["value_cache"] = None
    got = paged_attention(**args, v_head_dim=Dv if shared else None, backend=backend)
    assert got.shape == (a["q"].shape[0], 4, Dv)
    check(got, want, TOL[np.dtype(np.float32)], a)


def test_tiles_fit_shared_memory():
    """The usual head sizes keep the default tiles; MLA's latent rows (576 / 512 features padded
    to 1024 / 512) get tiles that fit the budget, counting the chunks a third pipeline stage
    holds; a config's explicit sizes are kept."""
    from pallas_kernels.paged_attention import _fit_shared_memory as rule

    budget = gpu_tiling.shared_memory_budget(None)  # no CUDA device: Hopper's
    assert budget == 192 * 1024 == gpu_tiling.shared_memory_budget((9, 0))

    def _fit_shared_memory(*a, budget=budget):
        return rule(*a, budget)

    cfg = PagedAttentionConfig()
    assert _fit_shared_memory(64, 64, 4, 128, 128, 2, 2, cfg) == (16, 64)  # bf16 decode
    assert _fit_shared_memory(2048, 256, 4, 128, 128, 2, 2, cfg) == (64, 64)  # bf16 prefill
    assert _fit_shared_memory(64, 64, 4, 128, 128, 4, 2, cfg) == (16, 64)  # float32 decode
    for T in (64, 2048):
        for stages in (1, 2, 3, 4):
            bm, bn = _fit_shared_memory(T, 64, 16, 1024, 512, 2, stages, cfg)
            chunks = max(1, stages - 1)
            assert bm >= 16 and bn >= 16 and (bm * 1024 + chunks * bn * 1536) * 2 <= budget
    assert _fit_shared_memory(64, 64, 16, 1024, 512, 2, 2, PagedAttentionConfig(gpu_block_n=128))[1] == 128
    # MLA's 576 key features as 512 + 64, the values read from the first block: default tiles,
    # 64 keys at 3 stages in bf16 (decode); a float32 decode tile halves to 32 keys to hold 2 chunks
    assert _fit_shared_memory(64, 64, 16, 576, 0, 2, 3, cfg) == (16, 64)
    assert _fit_shared_memory(2048, 256, 16, 576, 0, 2, 2, cfg) == (64, 64)
    assert _fit_shared_memory(64, 64, 16, 576, 0, 4, 3, cfg) == (16, 32)
    assert _fit_shared_memory(64, 64, 16, 576, 0, 4, 2, cfg) == (16, 64)
    # Smaller GPUs get smaller tiles: MLA's bf16 decode tile (162 KiB at 64 keys) takes 32 keys
    # on an A100 (138 KiB) and 16 on an L4 (84 KiB); GQA's tiles of 128-wide heads are unchanged.
    a100, l4 = (gpu_tiling.shared_memory_budget(c) for c in ((8, 0), (8, 9)))
    assert (a100, l4) == (138 * 1024, 84 * 1024)
    assert _fit_shared_memory(64, 64, 16, 576, 0, 2, 3, cfg, budget=a100) == (16, 32)
    assert _fit_shared_memory(64, 64, 16, 576, 0, 2, 3, cfg, budget=l4) == (16, 16)
    assert _fit_shared_memory(2048, 256, 16, 576, 0, 2, 2, cfg, budget=l4) == (16, 32)
    for b in (a100, l4):
        assert _fit_shared_memory(64, 64, 4, 128, 128, 2, 2, cfg, budget=b) == (16, 64)
        assert _fit_shared_memory(2048, 256, 4, 128, 128, 2, 2, cfg, budget=b) == (64, 64)


def test_tiles_fit_registers():
    """Key chunks stay within the per-warp register budget: MLA's decode tiles 16 x 64 on 4
    warps (16 x 128 ran slower on an H200), its prefill tiles 64 x 64 on 8; usual heads unchanged."""
    from pallas_kernels.paged_attention import _fit_registers

    cfg = PagedAttentionConfig()
    assert _fit_registers(16, 128, 576, 512, cfg) == (64, 4)
    assert _fit_registers(16, 64, 576, 512, cfg) == (64, 4)
    assert _fit_registers(64, 64, 576, 512, cfg) == (64, 8)
    assert _fit_registers(16, 128, 128, 128, cfg) == (128, 4)
    assert _fit_registers(64, 64, 128, 128, cfg) == (64, 4)
    assert _fit_registers(16, 128, 576, 512, PagedAttentionConfig(gpu_block_n=128)) == (128, 4)


def test_stages_rule():
    """Three pipeline stages for decode tiles over MLA's 576-wide latent rows; two for GQA's
    128-wide rows and for prefill tiles; the config's value wins."""
    from pallas_kernels.paged_attention import _stages

    cfg = PagedAttentionConfig()
    assert _stages(64, 64, 576, cfg) == 3 and _stages(1, 256, 576, cfg) == 3  # MLA decode
    assert _stages(2048, 64, 576, cfg) == 2  # MLA prefill over its context
    assert _stages(64, 64, 128, cfg) == 2 and _stages(64, 64, 256, cfg) == 2  # GQA decode
    assert _stages(64, 64, 576, PagedAttentionConfig(gpu_num_stages=1)) == 1
    with pytest.raises(ValueError, match="gpu_num_stages must be an int >= 1 or None"):
        PagedAttentionConfig(gpu_num_stages=0)


def test_feature_segments():
    """Key features as at most two power-of-two blocks (>= 16), covering every feature."""
    from pallas_kernels.paged_attention import _feature_segments

    assert _feature_segments(576) == ((0, 512), (512, 64))
    assert _feature_segments(192) == ((0, 128), (128, 64))
    assert _feature_segments(128) == ((0, 128),)
    assert _feature_segments(24) == ((0, 16), (16, 16))
    assert _feature_segments(8) == ((0, 16),)
    for D in range(1, 1100, 7):
        segs = _feature_segments(D)
        assert segs[-1][0] + segs[-1][1] >= D and len(segs) <= 2
        assert all(w >= 16 and w & (w - 1) == 0 for _, w in segs)


def test_shared_values_need_v_head_dim():
    a = mixed(0)
    a["value_cache"] = None
    with pytest.raises(ValueError, match="v_head_dim, an int in"):
        paged_attention(**a, backend="reference")
    with pytest.raises(ValueError, match="v_head_dim, an int in"):
        paged_attention(**a, v_head_dim=17, backend="reference")
    b = mixed(0)
    with pytest.raises(ValueError, match="only for value_cache=None"):
        paged_attention(**b, v_head_dim=8, backend="reference")


@pytest.mark.parametrize("backend,config", [
    ("reference", PagedAttentionConfig()),
    (GPU, PagedAttentionConfig(gpu_kv_splits=1, gpu_block_m=4, gpu_block_n=8)),
    (GPU, PagedAttentionConfig(gpu_kv_splits=4, gpu_block_m=32, gpu_block_n=2))],
    ids=["reference", "gpu-1-split", "gpu-4-splits"])
def test_return_lse_is_each_heads_log_sum_exp(backend, config):
    """``return_lse``: the float32 output and the log-sum-exp of each head's scaled visible
    scores, -inf exactly where the token sees nothing (pads, seq_len 0 rows)."""
    a = mixed(13)
    out, lse = paged_attention(*a.values(), sm_scale=0.4, return_lse=True, backend=backend,
                               config=config)
    assert out.dtype == np.float32 and lse.shape == a["q"].shape[:2] and lse.dtype == np.float32
    want_out, want = oracle(a, sm_scale=0.4, with_lse=True)
    check(out, want_out, 2e-5, a)
    lse = np.asarray(lse, np.float64)
    assert_bitwise(np.isneginf(lse), np.isneginf(want), "where lse is -inf")
    seen = np.isfinite(want)
    assert seen.sum() > 10
    np.testing.assert_allclose(lse[seen], want[seen], atol=2e-5, rtol=0)


@pytest.mark.parametrize("backend", ["reference", GPU])
def test_two_halves_merged_equal_the_whole(backend):
    """Each row's keys cut at a block boundary ``c`` (every row with >= 2 blocks: ``c`` one
    block; others: all keys in the first part): the first part through ``seq_lens = min(seq,
    c)``, the second through the block table shifted by ``c / bs`` columns with positions and
    lengths shifted by ``c``; :func:`merge_attention` of the two equals the whole step's
    attention (poisoned pools; a row whose second part is empty and tokens that see nothing
    in one part or both)."""
    from pallas_kernels.attention_math import merge_attention

    a = mixed(14)
    bs = a["key_cache"].shape[1]
    R, W = a["block_table"].shape
    cut = np.where(a["seq_lens"] > 2 * bs, bs, a["seq_lens"]).astype(np.int32)
    first = dict(a, seq_lens=np.minimum(a["seq_lens"], cut).astype(np.int32))
    table2 = np.zeros_like(a["block_table"])
    for b in range(R):
        sh = cut[b] // bs if cut[b] % bs == 0 else W
        table2[b, :W - sh] = a["block_table"][b, sh:]
    rows = np.minimum(a["token_row"], R - 1)
    second = dict(a, block_table=table2, seq_lens=(a["seq_lens"] - cut).astype(np.int32),
                  positions=(a["positions"] - cut[rows]).astype(np.int32))
    assert (second["seq_lens"] > 0).sum() >= 2 and (second["seq_lens"] == 0).sum() >= 2
    o1, l1 = paged_attention(*first.values(), return_lse=True, backend=backend)
    o2, l2 = paged_attention(*second.values(), return_lse=True, backend=backend)
    o, lse = merge_attention(o1, l1, o2, l2)
    want_out, want = oracle(a, with_lse=True)
    check(o, want_out, 2e-5, a)
    seen = np.isfinite(want)
    assert_bitwise(np.isneginf(np.asarray(lse)), ~seen, "where lse is -inf")
    np.testing.assert_allclose(np.asarray(lse)[seen], want[seen], atol=2e-5, rtol=0)


def test_split_combine_reads_only_the_splits_that_saw_keys():
    """The kernel writes a split's output row only where its sum is positive, so the combine
    reads only those rows: rows of splits with a zero sum are NaN here (unwritten memory) and
    change nothing. Per lane: ``out = sum_s w_s o_s / sum_s w_s``, ``w_s = l_s exp(m_s - max
    m)``; a lane no split saw gives 0 and ``lse`` -inf. Lanes of the padded group (3 heads
    in 4) are skipped."""
    from pallas_kernels.attention_math import MASK_VALUE
    from pallas_kernels.paged_attention import _combine_gpu

    rng = np.random.default_rng(5)
    splits, T, Hkv, G, Dv = 4, 2, 2, 3, 24
    Gp, Dvp = 4, 32
    lanes = T * Hkv * Gp
    o = rng.standard_normal((splits, lanes, Dvp)).astype(np.float32)
    m = rng.standard_normal((splits, lanes)).astype(np.float32)
    l = rng.uniform(0.5, 2.0, (splits, lanes)).astype(np.float32)
    dead = rng.random((splits, lanes)) < 0.4
    dead[:, 5] = True  # a lane no split saw
    dead[:, 6] = False
    l[dead], m[dead], o[dead] = 0.0, MASK_VALUE, np.nan
    out, lse = _combine_gpu(jnp.asarray(o.reshape(-1)), jnp.asarray(m.reshape(-1)),
                            jnp.asarray(l.reshape(-1)), splits=splits, T=T, Hkv=Hkv, G=G,
                            Dvp=Dvp, Dv=Dv, out_dtype=jnp.float32, interpret=True)
    w = np.where(dead, 0.0, l * np.exp(m - m.max(axis=0)))
    den = w.sum(axis=0)
    want = np.einsum("sl,sld->ld", w, np.where(dead[..., None], 0.0, o)) / np.where(den > 0, den, 1)[:, None]
    with np.errstate(divide="ignore"):
        want_lse = np.where(den > 0, m.max(axis=0) + np.log(den), -np.inf)
    keep = (np.arange(lanes) % Gp) < G  # lane (t, h, g) -> head h * G + g
    out, lse = np.asarray(out), np.asarray(lse)
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out.reshape(-1, Dv), want[keep, :Dv], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse.reshape(-1), want_lse[keep], rtol=1e-6, atol=1e-6)
    assert (out.reshape(-1, Dv)[list(np.flatnonzero(keep)).index(5)] == 0).all()


def test_registered_flavours_and_routing():
    assert _backend.flavors("paged_attention") == ("reference", "gpu")
    # No TPU kernel: every TPU choice runs the reference (the TPU path is JAX's RPA).
    assert _backend.choose("paged_attention", "pallas_tpu", None).flavor == "reference"
    assert _backend.choose("paged_attention", GPU, None).flavor == "gpu"


# --------------------------------------------------------------------------
# The compiled path: Triton modules built and verified for CUDA (on any host)
# --------------------------------------------------------------------------


def _lower_for_cuda(T, *, Hq, Hkv, D, qdt, cdt, N=64, bs=16, R=32, W=64) -> str:
    """The compiled GPU kernel over K and V caches of ``D`` features, lowered for CUDA (its Triton
    module lands in ``verified_triton_modules``); returns the lowered text."""
    SD = jax.ShapeDtypeStruct
    args = (SD((T, Hq, D), qdt), SD((N, bs, Hkv, D), cdt), SD((N, bs, Hkv, D), cdt),
            SD((R, W), jnp.int32), SD((R,), jnp.int32), SD((T,), jnp.int32),
            SD((T,), jnp.int32))
    scale = jnp.float32(0.5) if cdt == jnp.float8_e4m3fn else None

    def f(*x):
        return paged_attention(*x, k_scale=scale, v_scale=scale, backend=GPU, interpret=False)

    return lower_for_cuda(f, *args)


@pytest.mark.parametrize(
    "qdt,cdt,T", [(jnp.bfloat16, jnp.bfloat16, 4), (jnp.bfloat16, jnp.float8_e4m3fn, 64),
                  (jnp.float32, jnp.float32, 64), (jnp.bfloat16, jnp.bfloat16, 300)],
    ids=["bf16-decode-splits", "fp8-decode", "f32", "bf16-prefill"])
def test_lowers_to_one_verified_triton_kernel(verified_triton_modules, qdt, cdt, T):
    """One kernel; a decode call that splits the keys (4 tokens: 4 x 4 x 16 programs) adds the
    split combine's kernel, and nothing else: no XLA pass between or after them."""
    text = _lower_for_cuda(T, Hq=16, Hkv=4, D=128, qdt=qdt, cdt=cdt)
    splits = T == 4
    assert len(verified_triton_modules) == (2 if splits else 1) and "paged_attention_gpu" in text
    module = str(verified_triton_modules[0].module)
    assert module.count("tt.dot") == 2 and "scf.for" in module  # the key loop, two products
    assert not COLUMN_CLAMP.search(module)
    if splits:
        assert "paged_attention_combine_gpu" in text
        combine = str(verified_triton_modules[1].module)
        assert "tt.dot" not in combine and not COLUMN_CLAMP.search(combine)
        body = text[text.index("func.func public @main"):]
        ops = re.findall(r"= (stablehlo\.[a-z_]+)", body)
        assert set(ops) <= {"stablehlo.custom_call", "stablehlo.reshape", "stablehlo.constant",
                            "stablehlo.broadcast_in_dim", "stablehlo.convert", "stablehlo.slice"}, ops


def test_split_counts_are_powers_of_two(verified_triton_modules):
    """The split rule gives a power of two for any table (the combine's Triton blocks need one):
    a batch-1 decode over a 384-key table (24 blocks of 16: 3 splits before) lowers for CUDA to
    the attention and the combine."""
    from pallas_kernels.paged_attention import _kv_splits

    cfg = PagedAttentionConfig()
    for keys in range(1, 5000, 7):
        for bn in (16, 32, 64):
            n = _kv_splits(1, 1, keys, bn, cfg)
            assert n >= 1 and n & (n - 1) == 0 and (n == 1 or keys // (2 * bn) >= n), (keys, bn, n)
    _lower_for_cuda(1, Hq=16, Hkv=1, D=128, qdt=jnp.bfloat16, cdt=jnp.bfloat16, R=1, W=24)
    assert len(verified_triton_modules) == 2


#: A clamp (``jnp.minimum``) on a row of column indices: Triton then cannot see that a load's
#: columns are consecutive, and loads each element alone. Only a feature block padded past the
#: head's width may clamp; every block of these shapes lies inside the row.
COLUMN_CLAMP = re.compile(r"arith\.minsi [^\n]*: tensor<1x\d+xi32>")


def test_column_clamp_pattern_finds_a_padded_block(verified_triton_modules):
    """The control of ``COLUMN_CLAMP``: a head of 72 features (blocks 64 + 16, the second padded)
    clamps that block's columns, and the pattern sees it in the lowered module."""
    _lower_for_cuda(4, Hq=4, Hkv=2, D=72, qdt=jnp.bfloat16, cdt=jnp.bfloat16)
    assert COLUMN_CLAMP.search(str(verified_triton_modules[0].module))


def test_mla_latent_shape_lowers_to_one_verified_triton_kernel(verified_triton_modules):
    """DeepSeek's absorbed MLA decode: 16 heads over one latent kv head of 512 + 64 features,
    values its first 512, bf16: the scores are two products (the 512 and 64 feature blocks),
    the values one, the keys' first block."""
    T, Hq, N, bs, R, W = 64, 16, 64, 16, 64, 64
    SD = jax.ShapeDtypeStruct
    args = (SD((T, Hq, 576), jnp.bfloat16), SD((N, bs, 1, 576), jnp.bfloat16),
            SD((R, W), jnp.int32), SD((R,), jnp.int32), SD((T,), jnp.int32), SD((T,), jnp.int32))

    def f(q, kc, bt, sl, pos, row):
        return paged_attention(q, kc, None, bt, sl, pos, row, v_head_dim=512, sm_scale=0.1,
                               backend=GPU, interpret=False)

    text = lower_for_cuda(f, *args)
    # 64 tokens of one kv head split their keys 4 ways: the attention, then the combine
    assert len(verified_triton_modules) == 2 and "paged_attention_combine_gpu" in text
    module = str(verified_triton_modules[0].module)
    assert module.count("tt.dot") == 3 and not COLUMN_CLAMP.search(module)
    # batch 1 over a 32k table: the rule's most splits (128), whose combine tiles are
    # [128 splits, 64 columns]
    args = (SD((1, Hq, 576), jnp.bfloat16), SD((N, bs, 1, 576), jnp.bfloat16),
            SD((1, 2048), jnp.int32), SD((1,), jnp.int32), SD((1,), jnp.int32), SD((1,), jnp.int32))
    lower_for_cuda(f, *args)
    assert len(verified_triton_modules) == 4
    assert "tensor<128x64xf32>" in str(verified_triton_modules[3].module)
