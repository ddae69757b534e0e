"""grouped_matmul and its tile layout: the GPU kernel (interpret mode) and the jnp reference.

Operands are small integers, so every product and sum is exact in float32: both
implementations must equal the numpy product bitwise, whatever their accumulation order.
Unused tiles hold NaN rows and the weights no tile names are NaN: an unused tile reading
anything, or a used tile reading the wrong group, shows as NaN or a wrong integer.

Planted bugs each test was seen to fail on (then restored):

* the kernel's unused-tile zero store removed: ``test_kernel_matches_numpy_exactly`` fails
  (the interpreter leaves the output uninitialised, NaN);
* the kernel reading group ``g - 1``'s weights: every kernel case, the round trip, and the
  grouped cases of ``tests/models/test_moe_apply.py`` fail;
* ``group_tiles`` starting each group at ``starts * TM + rank`` with ``starts`` off by one
  tile: the layout test fails;
* ``num_tiles`` one tile short: the layout test's bound fails (and the slots overflow);
* the layout counted by a running sum down a ``[P, G]`` one-hot (an earlier way), its ranks
  counted in one chunk of all ``P`` rows, or the earlier chunks' counts summed in one masked
  sum over all the chunks (``P / 256`` of them, 1,024 at 262,144 rows):
  ``test_group_tiles_counts_in_bounded_reductions`` fails;
* the ranks without the earlier chunks' counts: the layout test fails at 513 and 600 rows;
* ``_exclusive_prefix``'s blocks without the earlier blocks' totals:
  ``test_group_tiles_layout_past_one_prefix_block`` fails;
* the gated kernel multiplying ``act(x @ w) * (x @ gate)`` (roles swapped): the gated test fails;
* the shared-memory rule's budget fixed at Hopper's: ``test_tiles_fit_shared_memory`` fails;
* the ragged ``K`` mask 8 columns too wide, or the gated prefill product given 256 columns:
  ``test_prefill_tiles_match_numpy_exactly`` fails;
* the kernel's ``x_rows`` row mask dropped (a row outside ``[0, M)`` read as row 0), or the
  reference taking negative ``x_rows`` from the end: ``test_rows_read_in_place`` fails.
"""

from __future__ import annotations

import warnings

import jax
import jax.extend.core
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kvjax.testing.asserts import assert_bitwise
from pallas_kernels import GroupedMatmulConfig, group_tiles, grouped_matmul
from pallas_kernels.grouped_matmul import num_tiles, tile_rows_for

BF16 = ml_dtypes.bfloat16


def _layout(groups, G, TM):
    slot, tg = group_tiles(jnp.asarray(groups, jnp.int32), G, TM)
    return np.asarray(slot), np.asarray(tg)


@pytest.mark.parametrize("P,G,TM", [(6, 64, 16), (1, 4, 16), (40, 5, 4), (33, 3, 8), (7, 7, 1), (600, 7, 16),
                                    (513, 64, 8)])
def test_group_tiles_layout(P, G, TM):
    """Every valid row gets its own slot; a group's rows are consecutive, in row order, from a
    tile boundary, in tiles naming that group; unused tiles name ``G``; rows of no group are
    one past the end; the tile count never exceeds :func:`num_tiles`."""
    for seed in range(4):
        r = np.random.default_rng(seed)
        groups = r.integers(-2, G + 2, size=P)
        if seed == 0:
            groups[:] = r.integers(0, G)  # all rows in one group
        slot, tg = _layout(groups, G, TM)
        NT = num_tiles(P, G, TM)
        assert tg.shape == (NT,) and slot.shape == (P,)
        valid = (groups >= 0) & (groups < G)
        assert np.all(slot[~valid] == NT * TM)
        assert len(set(slot[valid].tolist())) == valid.sum()
        assert np.all((slot[valid] >= 0) & (slot[valid] < NT * TM))
        used = set()
        for g in range(G):
            s = slot[valid & (groups == g)]
            if s.size == 0:
                continue
            assert s[0] % TM == 0 and np.array_equal(s, s[0] + np.arange(s.size)), (g, s)
            tiles = np.unique(s // TM)
            assert np.all(tg[tiles] == g), (g, tiles, tg)
            assert np.array_equal(tiles, np.arange(tiles[0], tiles[0] + -(-s.size // TM)))
            used |= set(tiles.tolist())
        unused = sorted(set(range(NT)) - used)
        assert np.all(tg[unused] == G)
        assert unused == list(range(len(used), NT)), "used tiles come first"


@pytest.mark.parametrize("P,G", [(384, 64), (49152, 64), (262144, 256)])
def test_group_tiles_counts_in_bounded_reductions(P, G):
    """The layout neither sorts the rows (XLA:GPU's CUB radix sort: six kernels with a memset and
    a gap before each, ~80 us a MoE layer of DeepSeek's 8k prefill on an H200) nor runs a count
    down all of them: every running sum is over the groups and every reduction sums at most
    ``max(G, RANK_CHUNK)`` values. A running count down the rows of a ``[P, G]`` one-hot gives
    the same layout, but XLA:GPU fuses it into a reduction of G outputs, each walking all P rows
    (121 us a MoE layer at DeepSeek's batch 64, BENCHMARKS.md)."""
    from pallas_kernels.grouped_matmul import RANK_CHUNK

    def walk(jaxpr):  # every equation, those of nested jits included
        for e in jaxpr.eqns:
            yield e
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                yield from walk(sub)

    eqns = list(walk(jax.make_jaxpr(lambda g: group_tiles(g, G, 16))(jnp.zeros((P,), jnp.int32)).jaxpr))
    assert not [e for e in eqns if e.primitive.name == "sort"]
    sums = [e for e in eqns if e.primitive.name in ("cumsum", "reduce_window_sum")]
    assert all(max(v.aval.shape) <= G for e in sums for v in e.invars), sums
    reduced = [e.invars[0].aval.shape[a] for e in eqns if e.primitive.name.startswith("reduce_")
               and "axes" in e.params for a in e.params["axes"]]
    assert reduced and max(reduced) <= max(G, RANK_CHUNK), reduced


def test_group_tiles_layout_past_one_prefix_block():
    """Past 256 chunks of 256 rows the per-chunk counts are summed in blocks (65,792 rows here,
    257 chunks, three groups and rows of none): each group's rows are still consecutive, in row
    order, from a tile boundary, exactly as a stable sort puts them."""
    P, G, TM = 256 * 257, 3, 128
    groups = np.random.default_rng(5).integers(-1, G + 1, size=P)
    slot, tg = _layout(groups, G, TM)
    valid = (groups >= 0) & (groups < G)
    order = np.argsort(np.where(valid, groups, G), kind="stable")
    counts = np.bincount(groups[valid], minlength=G)
    starts = np.concatenate([[0], np.cumsum(-(-counts // TM))[:-1]]) * TM
    want = np.full(P, num_tiles(P, G, TM) * TM)
    pos = np.arange(P) - np.concatenate([[0], np.cumsum(counts)])[np.minimum(groups[order], G)]
    sel = valid[order]
    want[order[sel]] = starts[groups[order][sel]] + pos[sel]
    assert np.array_equal(slot, want)


def test_group_tiles_under_x64():
    """With x64 on, the layout is the same int32 arrays and traces without a dtype warning (an
    int64 sum scattered into the int32 slots warns, and JAX says that will become an error)."""
    groups = np.array([3, 0, -1, 3, 7, 1, 3, 0], np.int32)
    want = _layout(groups, 4, 2)
    with jax.enable_x64(True), warnings.catch_warnings():
        warnings.simplefilter("error")
        for g in (jnp.asarray(groups), jnp.asarray(groups.astype(np.int64))):
            got = jax.jit(lambda x: group_tiles(x, 4, 2))(g)
            assert [a.dtype for a in got] == [jnp.int32, jnp.int32]
            assert all(np.array_equal(a, b) for a, b in zip(map(np.asarray, got), want))


@pytest.mark.parametrize("G,TM", [(64, 16), (5, 4)])
def test_group_tiles_rows_apart(G, TM):
    """``rows_apart``: row ``p`` alone in tile ``p`` (``P <= G`` rows, ``NT == P``), rows of no
    group one past the end and their tiles unused; for distinct groups (one token's top-k) the
    products are bitwise those of the counted layout; more rows than groups is refused."""
    P = min(G, 5)
    r = np.random.default_rng(G)
    groups = r.choice(G, P, replace=False).astype(np.int32)
    groups[1] = G + 1  # a choice this holder does not have
    slot, tg = group_tiles(jnp.asarray(groups), G, TM, rows_apart=True)
    slot, tg = np.asarray(slot), np.asarray(tg)
    valid = groups < G
    assert tg.shape == (P,) == (num_tiles(P, G, TM),)
    assert np.array_equal(slot[valid], np.flatnonzero(valid) * TM) and np.all(slot[~valid] == P * TM)
    assert np.array_equal(tg[valid], groups[valid]) and np.all(tg[~valid] == G)
    x = r.standard_normal((P, 8)).astype(np.float32)
    w = r.standard_normal((G, 8, 16)).astype(np.float32)
    outs = []
    for s_, t_ in ((slot, tg), _layout(groups, G, TM)):
        a = jnp.zeros((P * TM, 8), jnp.float32).at[s_].set(x, mode="drop")
        y = grouped_matmul(a, jnp.asarray(w), jnp.asarray(t_), tile_rows=TM, backend="pallas_gpu", interpret=True)
        outs.append(np.asarray(jnp.take(y, jnp.asarray(s_), axis=0, mode="fill", fill_value=0)))
    assert_bitwise(outs[0], outs[1])
    assert np.all(outs[0][~valid] == 0) and np.all(outs[0][valid] != 0)
    with pytest.raises(ValueError, match="rows_apart needs at most num_groups=3 rows"):
        group_tiles(jnp.zeros((4,), jnp.int32), 3, TM, rows_apart=True)


def test_num_tiles_and_tile_rows_rules():
    assert num_tiles(6, 64, 16) == 6  # one tile per pair at decode
    assert num_tiles(1536, 64, 64) == 87 and num_tiles(12288, 64, 128) == 159
    assert tile_rows_for(6, 64) == 16 and tile_rows_for(1536, 64) == 64
    assert tile_rows_for(12288, 64) == 128


def _case(seed, P, G, K, N, TM, dtype):
    r = np.random.default_rng(seed)
    groups = r.integers(-1, G + 1, size=P)  # some rows of no group
    groups[0] = 1
    slot, tg = _layout(groups, G, TM)
    NT = tg.shape[0]
    rows = r.integers(-3, 4, size=(P, K)).astype(np.float32)
    x = np.full((NT * TM, K), np.nan, np.float32)  # unused rows and tiles: NaN
    tile_used = tg < G
    x[np.repeat(tile_used, TM)] = 0.0  # used tiles' padding rows hold 0
    ok = slot < NT * TM
    x[slot[ok]] = rows[ok]
    w = r.integers(-3, 4, size=(G, K, N)).astype(np.float32)
    named = np.zeros(G, bool)
    named[tg[tile_used]] = True
    w[~named] = np.nan  # groups no tile names must not be read
    want = np.zeros((NT * TM, N), np.float32)
    for i in np.flatnonzero(tile_used):
        want[i * TM:(i + 1) * TM] = x[i * TM:(i + 1) * TM] @ w[tg[i]]
    return x.astype(dtype), w.astype(dtype), tg, want, slot, rows, groups


CASES = [  # P, G, K, N, TM: divisible blocks, ragged K and N, one pair per tile
    (12, 4, 32, 64, 16),
    (20, 3, 40, 33, 16),
    (6, 8, 64, 48, 16),
    (3, 8, 300, 80, 16),  # few rows: block_k 128 over a ragged K, block_n 64 over a ragged N
]


@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("P,G,K,N,TM", CASES)
def test_kernel_matches_numpy_exactly(P, G, K, N, TM, dtype):
    x, w, tg, want, *_ = _case(P + K, P, G, K, N, TM, dtype)
    args = (jnp.asarray(x), jnp.asarray(w), jnp.asarray(tg, jnp.int32))
    for backend, cfg in (("reference", GroupedMatmulConfig()),
                         ("pallas_gpu", GroupedMatmulConfig()),
                         ("pallas_gpu", GroupedMatmulConfig(gpu_block_n=16, gpu_block_k=16))):
        out = grouped_matmul(*args, tile_rows=TM, backend=backend, config=cfg)
        assert out.dtype == jnp.float32
        assert_bitwise(np.asarray(out), want, f"{backend} {cfg}")


def test_few_rows_take_deeper_steps():
    """A call of at most FEW_ROWS rows in 16-row tiles (one token's experts: weight streaming) takes block_k
    128 and keeps block_n >= 64; a larger one the throughput tiling (block_k 64, block_n >= 32).
    The shapes are DeepSeek-V2-Lite's expert products (d 2048, F 1408): one token's 6 tiles of
    16 rows, then 16 tokens' 66 tiles. Both pipeline three stages."""
    from pallas_kernels.grouped_matmul import FEW_ROWS, _blocks

    cfg = GroupedMatmulConfig()
    assert 6 * 16 <= FEW_ROWS < 66 * 16
    assert _blocks(6, 1408, 2048, 16, cfg, True) == (64, 128, 4, 3)  # gated first product
    assert _blocks(6, 2048, 1408, 16, cfg) == (64, 128, 4, 3)  # down
    assert _blocks(66, 1408, 2048, 16, cfg, True) == (128, 64, 4, 3)
    assert _blocks(17, 1408, 2048, 16, cfg, True) == (64, 64, 4, 3)  # 272 rows: not few
    assert _blocks(6, 1408, 2048, 16, GroupedMatmulConfig(gpu_block_n=32, gpu_block_k=64)) == (32, 64, 4, 3)
    assert _blocks(1, 40, 24, 16, cfg) == (64, 32, 4, 3)  # at most K's and N's powers of two
    assert _blocks(66, 2048, 1408, 64, cfg) == (128, 64, 4, 3)  # batch 256's down: 64-row tiles


def test_prefill_tiles_pipeline_deeper():
    """Tiles of MAX_TILE_ROWS rows (a prefill's experts) pipeline four stages; their ungated
    products (down) start from 256 columns, the gated ones (two accumulators) from 128; both halve
    to keep ``gpu_min_programs`` programs. A config's fields win. DeepSeek-V2-Lite's 8k-token
    prefill: ~448 tiles."""
    from pallas_kernels.grouped_matmul import MAX_TILE_ROWS, _blocks

    cfg = GroupedMatmulConfig()
    assert MAX_TILE_ROWS == 128
    assert _blocks(448, 2048, 1408, 128, cfg) == (256, 64, 8, 4)  # down
    assert _blocks(448, 1408, 2048, 128, cfg, True) == (128, 64, 8, 4)  # gated first product
    assert _blocks(2, 4096, 2048, 128, cfg) == (32, 64, 8, 4)  # 256 rows: too few programs for wide blocks
    assert _blocks(448, 2048, 1408, 128, GroupedMatmulConfig(gpu_block_n=128, gpu_num_stages=3)) == (128, 64, 8, 3)


def test_tiles_fit_shared_memory():
    """Hopper's bf16 tiles of the models' calls keep :func:`_blocks`' sizes; float32 tiles and
    smaller GPUs (an A100: 138 KiB, an L4: 84 KiB) get shallower steps (then narrower columns); a
    config's sizes are kept. The rule counts every pipeline stage's buffers: the four 8k-token
    tilings Triton refused on an H200 for shared memory (``-moe-sweep-8k-gated.log``) each
    need more than Hopper's budget."""
    from pallas_kernels import gpu_tiling
    from pallas_kernels.grouped_matmul import _fit_shared_memory as fit

    cfg = GroupedMatmulConfig()
    hopper, a100, l4 = (gpu_tiling.shared_memory_budget(c) for c in (None, (8, 0), (8, 9)))
    assert fit(16, 64, 128, 2, True, cfg, hopper, 3) == (64, 128)  # DeepSeek's one-token gated step: 108 KiB
    assert fit(16, 128, 64, 2, True, cfg, hopper, 3) == (128, 64)  # 16 tokens' steps
    assert fit(64, 128, 64, 2, True, cfg, hopper, 3) == (128, 64)  # batch 256's 64-row tiles: 120 KiB
    assert fit(128, 128, 64, 2, True, cfg, hopper, 4) == (128, 64)  # prefill tiles, four stages: 192 KiB
    assert fit(128, 256, 64, 2, False, cfg, hopper, 4) == (256, 64)  # their down product: 192 KiB
    assert fit(16, 128, 128, 2, True, cfg, hopper, 3) == (128, 64)  # 204 KiB in three stages
    assert fit(64, 128, 64, 4, True, cfg, hopper, 3) == (128, 32)  # float32: 240 KiB would not fit Hopper's 227
    assert fit(16, 64, 128, 2, True, cfg, a100, 3) == (64, 128)
    assert fit(16, 64, 128, 2, True, cfg, l4, 3) == (64, 64)
    assert fit(128, 128, 64, 2, True, cfg, a100, 4) == (128, 32)
    assert fit(128, 256, 64, 2, False, cfg, a100, 4) == (256, 32)
    assert fit(128, 128, 64, 4, True, cfg, l4, 3) == (128, 16)
    assert fit(16, 128, 128, 2, True, GroupedMatmulConfig(gpu_block_k=128, gpu_block_n=128), l4, 3) == (128, 128)
    need = lambda TM, BN, BK, stages: stages * (TM * BK + 2 * BK * BN) * 2  # noqa: E731 - bf16, gated
    refused = [((128, 128, 128, 3), 294912), ((128, 64, 128, 4), 262144), ((128, 32, 256, 3), 294912),
               ((128, 128, 128, 4), 393216)]  # (TM, BN, BK, stages): the bytes Triton asked for
    for (TM, BN, BK, stages), asked in refused:
        assert need(TM, BN, BK, stages) == asked > hopper
        bn, bk = fit(TM, BN, BK, 2, True, cfg, hopper, stages)
        assert need(TM, bn, bk, stages) <= hopper
    for TM, BN, BK, size, gated, stages in [(16, 128, 128, 2, True, 3), (128, 128, 64, 4, True, 4),
                                            (64, 64, 128, 4, False, 3), (128, 256, 64, 2, False, 4)]:
        for budget in (hopper, a100, l4):
            bn, bk = fit(TM, BN, BK, size, gated, cfg, budget, stages)
            assert bn >= 16 and bk >= 16 and stages * (TM * bk + (2 if gated else 1) * bk * bn) * size <= budget


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_prefill_tiles_match_numpy_exactly(dtype):
    """The prefill regime's tiling (128-row tiles, four stages, 256 columns ungated and 128 gated,
    here with ``gpu_min_programs=1`` so that a small call takes it) over a ragged ``K`` (72 against
    ``block_k`` 64) and a ragged ``N`` (300 against 256): the product equals numpy's, the gated
    form the reference's, bitwise."""
    P, G, K, N, TM = 40, 3, 72, 300, 128
    x, w, tg, want, *_ = _case(7, P, G, K, N, TM, dtype)
    cfg = GroupedMatmulConfig(gpu_min_programs=1)
    from pallas_kernels.grouped_matmul import _blocks

    assert _blocks(tg.shape[0], N, K, TM, cfg)[::3] == (256, 4)
    assert _blocks(tg.shape[0], N, K, TM, cfg, True)[::3] == (128, 4)
    args = (jnp.asarray(x), jnp.asarray(w), jnp.asarray(tg, jnp.int32))
    out = grouped_matmul(*args, tile_rows=TM, backend="pallas_gpu", config=cfg)
    assert_bitwise(np.asarray(out), want, "ungated, 256 columns")
    gate = jnp.asarray(np.where(np.isnan(np.asarray(w, np.float32)), np.nan,
                                np.random.default_rng(1).integers(-3, 4, size=w.shape)).astype(dtype))
    got, ref = (grouped_matmul(*args, tile_rows=TM, gate=gate, activation="silu", backend=b, config=cfg)
                for b in ("pallas_gpu", "reference"))
    assert_bitwise(np.asarray(got), np.asarray(ref), "gated, 128 columns")


@pytest.mark.parametrize("activation", ["silu", "relu2"])
@pytest.mark.parametrize("P,G,K,N,TM", CASES[:2])
def test_gated_form(P, G, K, N, TM, activation):
    """``act(x @ gate[g]) * (x @ w[g])``: both flavours bitwise alike (exact integer products, the
    same activation formula), within float32 rounding of float64 numpy, 0 in unused tiles; with
    ``out_dtype=bfloat16`` the float32 result rounded once."""
    x, w, tg, want_up, *_ = _case(P + K, P, G, K, N, TM, np.float32)
    gate = np.random.default_rng(P).integers(-3, 4, size=w.shape).astype(np.float32)
    gate[np.isnan(w)] = np.nan
    used = np.repeat(tg < G, TM)
    lin = np.zeros_like(want_up, dtype=np.float64)
    for i in np.flatnonzero(tg < G):
        lin[i * TM:(i + 1) * TM] = x[i * TM:(i + 1) * TM].astype(np.float64) @ gate[tg[i]]
    act = lin / (1 + np.exp(-lin)) if activation == "silu" else np.square(np.maximum(lin, 0))
    want = np.where(used[:, None], act * want_up, 0.0)
    args = (jnp.asarray(x), jnp.asarray(w), jnp.asarray(tg, jnp.int32))
    outs = {b: np.asarray(grouped_matmul(*args, tile_rows=TM, gate=jnp.asarray(gate),
                                         activation=activation, backend=b))
            for b in ("reference", "pallas_gpu")}
    assert_bitwise(outs["pallas_gpu"], outs["reference"], "gpu vs reference")
    np.testing.assert_allclose(outs["reference"], want, rtol=1e-5, atol=1e-4)
    assert np.all(outs["reference"][~used] == 0)
    low = grouped_matmul(*args, tile_rows=TM, gate=jnp.asarray(gate), activation=activation,
                         out_dtype=jnp.bfloat16, backend="pallas_gpu")
    assert low.dtype == jnp.bfloat16
    assert_bitwise(np.asarray(low), np.asarray(jnp.asarray(outs["reference"]).astype(jnp.bfloat16)), "bf16")


def test_pairs_come_back_through_the_slots():
    """The layout's round trip: scatter rows to their slots, multiply, gather by slot."""
    P, G, K, N, TM = 24, 5, 16, 16, 8
    _, w, tg, _, slot, rows, groups = _case(3, P, G, K, N, TM, np.float32)
    NT = tg.shape[0]
    x = jnp.zeros((NT * TM, K), jnp.float32).at[slot].set(jnp.asarray(rows), mode="drop")
    w = np.nan_to_num(w)
    out = grouped_matmul(x, jnp.asarray(w), jnp.asarray(tg, jnp.int32), tile_rows=TM,
                         backend="pallas_gpu")
    y = np.asarray(jnp.take(out, jnp.asarray(slot), axis=0, mode="fill", fill_value=0))
    for p in range(P):
        g = groups[p]
        assert_bitwise(y[p], rows[p] @ w[g] if 0 <= g < G else np.zeros(N, np.float32), p)


@pytest.mark.parametrize("dtype", [np.float32, BF16])
@pytest.mark.parametrize("P,G,K,N,TM", [CASES[0], CASES[1], (40, 3, 72, 300, 128)])
def test_rows_read_in_place(P, G, K, N, TM, dtype):
    """``x_rows``: tile row ``r`` is ``x[x_rows[r]]`` of a ``[M, K]`` input, zeros outside ``[0, M)``
    (-1, M, and a large and a negative number): bitwise the product of the rows laid out as tiles,
    ungated and gated, on both backends (the 128-row case in the prefill tiling). ``x`` holds a
    NaN row no tile names: reading an unnamed row shows."""
    _, w, tg, _, slot, *_ = _case(11, P, G, K, N, TM, dtype)
    r = np.random.default_rng(5)
    M = 13
    src = r.integers(0, M, size=P)
    table = np.asarray(r.integers(-3, 4, size=(M + 1, K)), np.float32)
    table[M] = np.nan  # row M: named by no tile row
    NT = tg.shape[0]
    x_rows = np.full(NT * TM, -1, np.int32)
    ok = slot < NT * TM
    x_rows[slot[ok]] = src[ok]
    pad = np.flatnonzero(x_rows < 0)
    x_rows[pad[1::4]] = M + 1  # past the end
    x_rows[pad[2::4]] = 2**30
    x_rows[pad[3::4]] = -7
    tiles = np.zeros((NT * TM, K), np.float32)
    tiles[slot[ok]] = table[src[ok]]
    tiles[np.repeat(tg >= G, TM)] = np.nan  # unused tiles must not be read either way
    args = (jnp.asarray(w), jnp.asarray(tg, jnp.int32))
    cfg = GroupedMatmulConfig(gpu_min_programs=1)
    gate = jnp.asarray(np.nan_to_num(np.asarray(w, np.float32), nan=2.0).astype(dtype))
    for backend in ("reference", "pallas_gpu"):
        for gating in ({}, dict(gate=gate, activation="silu")):
            got = grouped_matmul(jnp.asarray(table.astype(dtype)), *args, tile_rows=TM, x_rows=jnp.asarray(x_rows),
                                 backend=backend, config=cfg, **gating)
            want = grouped_matmul(jnp.asarray(tiles.astype(dtype)), *args, tile_rows=TM, backend="reference",
                                  **gating)
            assert_bitwise(np.asarray(got), np.asarray(want), f"{backend} {sorted(gating)}")
    empty = grouped_matmul(jnp.zeros((0, K), dtype), *args, tile_rows=TM, x_rows=jnp.asarray(x_rows),
                           backend="pallas_gpu")
    assert not np.any(np.asarray(empty))


@pytest.mark.parametrize("bad,match", [
    (dict(x=np.ones((3, 2), np.float32)), "x must have shape"),
    (dict(x_rows=np.zeros((2,), np.int64)), "x_rows must have dtype"),
    (dict(x_rows=np.zeros((3,), np.int32)), "x_rows must have shape"),
    (dict(x_rows=np.zeros((2,), np.int32), x=np.ones((5, 3), np.float32)), "x must have shape"),
    (dict(w=np.ones((1, 2, 3), BF16)), "w must have dtype"),
    (dict(tile_group=np.array([0], np.int64)), "tile_group must have dtype"),
    (dict(tile_rows=0), "tile_rows must be an int >= 1"),
    (dict(config="fast"), "config must be a GroupedMatmulConfig"),
    (dict(activation="silu"), "activation is for the gated form"),
    (dict(gate=np.ones((1, 2, 3), np.float32), activation="gelu"), "activation must be one of"),
    (dict(gate=np.ones((1, 2, 4), np.float32), activation="silu"), "gate must have shape"),
    (dict(out_dtype=np.int32), "out_dtype must be a float dtype"),
])
def test_bad_arguments_name_themselves(bad, match):
    args = dict(x=np.ones((2, 2), np.float32), w=np.ones((1, 2, 3), np.float32),
                tile_group=np.array([0], np.int32), tile_rows=2)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        grouped_matmul(args.pop("x"), args.pop("w"), args.pop("tile_group"), backend="reference",
                       **args)
    with pytest.raises(ValueError, match="gpu_block_n must be a power of two"):
        GroupedMatmulConfig(gpu_block_n=48)


@pytest.mark.parametrize("layout", ["stack", "side"])
@pytest.mark.parametrize("gated", [False, True])
def test_more_groups_are_read_in_place(layout, gated):
    """``more_w`` (and ``more_gate``): ``S`` groups after ``w``'s, a ``[S, K, N]`` stack or a
    ``[K, S * N]`` matrix side by side; each tile of such a group is multiplied by its slice,
    on the kernel (interpreted) exactly as in numpy."""
    r = np.random.default_rng(11)
    G, K, N, S, TM = 3, 40, 24, 2, 16
    w, g = (r.standard_normal((G, K, N)).astype(np.float32) for _ in range(2))
    more = [r.standard_normal((S, K, N)).astype(np.float32) for _ in range(2)]
    tg = np.array([0, 4, 2, 3, 9, 1], np.int32)  # 3 and 4 are the more groups, 9 unused
    x = r.standard_normal((len(tg) * TM, K)).astype(np.float32)
    lay = (lambda m: m) if layout == "stack" else (lambda m: np.ascontiguousarray(m.transpose(1, 0, 2)).reshape(K, S * N))
    kw = dict(tile_rows=TM, more_w=lay(more[0]), more_groups=S)
    if gated:
        kw.update(gate=g, activation="silu", more_gate=lay(more[1]))
    full_w, full_g = np.concatenate([w, more[0]]), np.concatenate([g, more[1]])
    want = np.zeros((len(tg) * TM, N))
    for i, grp in enumerate(tg):
        if grp < G + S:
            a = x[i * TM:(i + 1) * TM].astype(np.float64)
            o = a @ full_w[grp]
            if gated:
                v = a @ full_g[grp]
                o = v / (1 + np.exp(-v)) * o
            want[i * TM:(i + 1) * TM] = o
    for backend, interp in (("reference", None), ("pallas_gpu", True)):
        got = grouped_matmul(x, w, tg, backend=backend, interpret=interp, **kw)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5, err_msg=backend)


def test_more_groups_lower_for_cuda(verified_triton_modules):
    from tests.cuda_lowering import lower_for_cuda

    x = jnp.zeros((2 * 16, 64), jnp.bfloat16)
    w = jnp.zeros((4, 64, 32), jnp.bfloat16)
    side = jnp.zeros((64, 2 * 32), jnp.bfloat16)
    fn = lambda x, w, s: grouped_matmul(x, w, np.array([1, 5], np.int32), tile_rows=16, gate=w,  # noqa: E731
                                        activation="silu", more_w=s, more_gate=s, more_groups=2,
                                        backend="pallas_gpu", interpret=False)
    lower_for_cuda(fn, x, w, side)
    assert len(verified_triton_modules) == 1


@pytest.mark.parametrize("TM,K,gated,stages,col_blocks", [(16, 64, True, 3, 8), (128, 72, False, 4, 2)])
def test_rows_in_place_lower_for_cuda(verified_triton_modules, TM, K, gated, stages, col_blocks):
    """The row-gathering kernel lowers for CUDA with the rule's pipeline and columns: a decode tile
    (gated, two shared groups side by side; 64 columns a program, three stages) and a prefill tile
    (ungated, ragged ``K``: 256 columns, four stages)."""
    import re

    from tests.cuda_lowering import lower_for_cuda

    x = jnp.zeros((5, K), jnp.bfloat16)
    w = jnp.zeros((4, K, 512), jnp.bfloat16)
    side = jnp.zeros((K, 2 * 512), jnp.bfloat16)
    rows = jnp.zeros((2 * TM,), jnp.int32)
    cfg = GroupedMatmulConfig(gpu_min_programs=1 if TM == 128 else 264)
    extra = dict(gate=w, activation="silu", more_w=side, more_gate=side, more_groups=2) if gated else {}
    fn = lambda x, w, r: grouped_matmul(x, w, np.array([1, 5], np.int32), tile_rows=TM, x_rows=r,  # noqa: E731
                                        backend="pallas_gpu", interpret=False, config=cfg, **extra)
    text = lower_for_cuda(fn, x, w, rows)
    assert len(verified_triton_modules) == 1
    assert re.findall(r"num_stages = (\d+)", text) == [str(stages)]
    assert re.findall(r"grid_y = (\d+)", text) == [str(col_blocks)]


@pytest.mark.parametrize("layout", ["stack", "side"])
def test_rows_in_place_with_more_groups(layout):
    """``x_rows`` with two more groups read in place (gated): bitwise the rows laid out as tiles."""
    P, G, S, K, N, TM = 30, 3, 2, 40, 24, 16
    r = np.random.default_rng(9)
    groups = r.integers(-1, G + S + 1, size=P)
    slot, tg = _layout(groups, G + S, TM)
    NT = tg.shape[0]
    M = 7
    table = r.integers(-3, 4, size=(M, K)).astype(np.float32)
    src = r.integers(0, M, size=P)
    x_rows = np.full(NT * TM, -1, np.int32)
    ok = slot < NT * TM
    x_rows[slot[ok]] = src[ok]
    tiles = np.zeros((NT * TM, K), np.float32)
    tiles[slot[ok]] = table[src[ok]]
    w, gate = (r.integers(-3, 4, size=(G, K, N)).astype(np.float32) for _ in range(2))
    mw, mg = (r.integers(-3, 4, size=(S, K, N)).astype(np.float32) for _ in range(2))
    if layout == "side":
        mw, mg = (m.transpose(1, 0, 2).reshape(K, S * N) for m in (mw, mg))
    kw = dict(tile_rows=TM, gate=jnp.asarray(gate), activation="silu", more_w=jnp.asarray(mw),
              more_gate=jnp.asarray(mg), more_groups=S)
    want = grouped_matmul(jnp.asarray(tiles), jnp.asarray(w), jnp.asarray(tg), backend="reference", **kw)
    for backend in ("reference", "pallas_gpu"):
        got = grouped_matmul(jnp.asarray(table), jnp.asarray(w), jnp.asarray(tg), x_rows=jnp.asarray(x_rows),
                             backend=backend, **kw)
        assert_bitwise(np.asarray(got), np.asarray(want), backend)


@pytest.mark.parametrize("bad, match", [
    (dict(more_w=np.ones((1, 2, 3), np.float32)), "more_groups must be an int >= 1"),
    (dict(more_groups=1), "more_gate and more_groups need more_w"),
    (dict(more_w=np.ones((2, 2, 3), np.float32), more_groups=1), "more_w must have shape"),
    (dict(more_w=np.ones((2, 6), np.float32), more_groups=2, gate=np.ones((1, 2, 3), np.float32),
          activation="silu"), "more_gate is required"),
    (dict(more_w=np.ones((2, 6), np.float32), more_groups=2, gate=np.ones((1, 2, 3), np.float32),
          activation="silu", more_gate=np.ones((2, 2, 3), np.float32)), "more_gate must have more_w's layout"),
    (dict(more_w=np.ones((2, 6), np.float32), more_gate=np.ones((2, 6), np.float32), more_groups=2),
     "more_gate is for the gated form"),
    (dict(more_w=np.ones((2, 6), np.float16), more_groups=2), "more_w must have dtype"),
    (dict(w=np.ones((0, 2, 3), np.float32), more_w=np.ones((2, 3), np.float32), more_groups=1),
     r"w must hold at least one group beside more_w, got shape \[0, 2, 3\]"),
])
def test_more_groups_bad_arguments_name_themselves(bad, match):
    with pytest.raises(ValueError, match=match):
        args = {"w": np.ones((1, 2, 3), np.float32), **bad}
        grouped_matmul(np.ones((2, 2), np.float32), args.pop("w"), np.array([0], np.int32),
                       tile_rows=2, backend="reference", **args)
