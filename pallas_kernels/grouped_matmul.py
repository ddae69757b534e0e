"""Grouped matmul: row tiles of one input, each multiplied by the weight matrix of its group.

``grouped_matmul(x, w, tile_group, tile_rows=TM)``: ``x [NT * TM, K]`` is ``NT`` tiles of ``TM``
rows; tile ``i`` is multiplied by ``w[tile_group[i]]`` (``w [G, K, N]``), so that
``out[i * TM:(i + 1) * TM] = x[i * TM:(i + 1) * TM] @ w[tile_group[i]]``, float32 ``[NT * TM, N]``.
With ``x_rows`` (int32 ``[NT * TM]``), tile row ``r`` is ``x[x_rows[r]]`` of any ``x [M, K]``
(a zero row where ``x_rows[r]`` is outside ``[0, M)``): the rows are read where they are, with no
``[NT * TM, K]`` copy in the tile layout. A tile whose group is outside ``[0, G)`` (``[0, G + S)``
with ``S`` more groups, ``more_w``) reads no weight and no row of ``x`` (with ``x_rows``, only its
row numbers), and gives 0. With ``gate`` (``[G, K, N]``,
same dtype) and ``activation``, the output is ``act(x @ gate[g]) * (x @ w[g])`` instead: a gated
(SwiGLU-style) expert's first layer in one pass over ``x`` and one launch. This is the product of a
mixture of experts with the (token, expert) pairs sorted by expert: every expert's weights
are read once per tile that names it, and no weight is copied
(:func:`group_tiles` builds the tile layout; ``kvjax.models.moe`` is the caller).

Contract (every implementation):

* Products are ``x``'s dtype times ``w``'s dtype (one float dtype), accumulated in float32;
  float32 operands multiply in IEEE float32. Implementations differ only in the order of the
  float32 accumulation. ``activation`` is applied in float32: ``"silu"`` (``v / (1 + exp(-v))``)
  or ``"relu2"`` (``max(v, 0) ** 2``). The output is float32, or ``out_dtype``.
* ``tile_group`` values outside ``[0, G + S)`` are the unused tiles: 0 out, no weight read (a
  value check refuses nothing here: the tile layout marks unused tiles with ``G + S``).

Implementations (:mod:`pallas_kernels.backend`; a TPU choice runs the reference):

* reference (jnp): ``einsum("imk,ikn->imn")`` over the weights gathered per tile (a copy of
  ``NT`` matrices: fine on a CPU, the reason for the kernel on a GPU), and the rows gathered by
  ``x_rows``.
* GPU (Pallas Triton): grid ``(NT, cdiv(N, block_n))``. Program ``(i, j)`` reads its tile's
  group, then accumulates ``block_k``-deep products of the tile's rows with columns
  ``[j * block_n, (j + 1) * block_n)`` of that group's matrix, read in place through
  ``w``'s flat view (a group of ``more_w``, through its flat view in either layout); with
  ``x_rows`` it first reads the tile's row numbers and loads those rows of ``x``. An unused
  tile stores zeros.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import backend as _backend
from pallas_kernels import contract as validation
from pallas_kernels import gpu_tiling

__all__ = ["ACTIVATIONS", "FEW_ROWS", "GroupedMatmulConfig", "group_tiles", "grouped_matmul", "num_tiles",
           "tile_rows_for"]

OP_GROUPED_MATMUL = "grouped_matmul"

#: ``activation`` names of the gated form.
ACTIVATIONS = ("silu", "relu2")


def _activate(v, name: str):
    """``name`` of float32 ``v`` (the one formula every implementation uses)."""
    if name == "silu":
        return v / (1.0 + jnp.exp(-v))
    return jnp.square(jnp.maximum(v, 0.0))

#: Tile heights :func:`tile_rows_for` picks from (Triton products need >= 16 rows).
MIN_TILE_ROWS, MAX_TILE_ROWS = 16, 128

#: The most tile rows (``NT * tile_rows``, in tiles of at most ``MIN_TILE_ROWS``) of a call whose
#: GPU tiling takes the few-rows regime of :class:`GroupedMatmulConfig`.
FEW_ROWS = 256


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    """Tuning knobs of the GPU kernel (a static argument).

    Three regimes (``None`` defaults): a call of at most :data:`FEW_ROWS` rows in tiles of 16 (a
    token or two's experts: a product that streams its weights) takes deeper steps, ``block_k``
    128, and halves ``block_n`` to 64 at least; a larger call takes ``block_k`` 64 and halves
    ``block_n`` to 32 at least (measured in BENCHMARKS.md's H200 notes, item 26); a call in tiles
    of :data:`MAX_TILE_ROWS` rows (a prefill's experts) pipelines four stages, and its ungated
    products start from 256 columns (H200 note 55).

    Attributes:
      gpu_block_n: output columns of a program (a power of two). None: 128 (256 for an ungated
        product in tiles of :data:`MAX_TILE_ROWS` rows), halved while that gives fewer than
        ``gpu_min_programs`` programs (to 64, or 32 beyond :data:`FEW_ROWS`).
      gpu_block_k: depth of one product step (a power of two). None: 128 for at most
        :data:`FEW_ROWS` tile rows, else 64 (at most ``K``'s power of two).
      gpu_min_programs: the program count under which ``gpu_block_n`` halves.
      gpu_num_warps: None: 4 for tiles of up to 64 rows, else 8.
      gpu_num_stages: Triton's software pipelining of the ``K`` loop. None: 4 for tiles of
        :data:`MAX_TILE_ROWS` rows, else 3.
    """

    gpu_block_n: int | None = None
    gpu_block_k: int | None = None
    gpu_min_programs: int = 264
    gpu_num_warps: int | None = None
    gpu_num_stages: int | None = None

    def __post_init__(self):
        validation.check_config_ints(self, ("gpu_block_n", "gpu_block_k"))


# --------------------------------------------------------------------------
# The tile layout
# --------------------------------------------------------------------------


def tile_rows_for(rows: int, groups: int) -> int:
    """``TM`` for ``rows`` rows over ``groups`` groups: twice the mean rows per group, as a power
    of two in ``[16, 128]`` (one tile holds most groups' rows, so most weights are read once)."""
    want = pl.next_power_of_2(max(1, 2 * -(-int(rows) // max(1, int(groups)))))
    return int(min(MAX_TILE_ROWS, max(MIN_TILE_ROWS, want)))


def num_tiles(rows: int, groups: int, tile_rows: int) -> int:
    """The most tiles :func:`group_tiles` can fill: ``sum_g ceil(n_g / TM)`` over at most
    ``min(rows, groups)`` non-empty groups whose sizes ``n_g`` sum to ``rows``."""
    return max(1, (int(rows) + min(int(rows), int(groups)) * (int(tile_rows) - 1)) // int(tile_rows))


def group_tiles(group_of_row: jax.Array, num_groups: int, tile_rows: int, *, rows_apart: bool = False):
    """The tile layout of rows by group: ``(slot int32 [P], tile_group int32 [NT])``.

    Row ``p`` of group ``g = group_of_row[p]`` goes to position ``slot[p]`` of an
    ``[NT * tile_rows]`` layout in which each group's rows are consecutive (in row order),
    starting at a tile boundary; ``tile_group[i]`` is tile ``i``'s group, ``num_groups`` for
    an unused tile. A row whose group is outside ``[0, num_groups)`` gets
    ``slot = NT * tile_rows`` (one past the end: scatter with ``mode="drop"``, gather with a
    fill). ``NT`` is :func:`num_tiles` (static).

    ``rows_apart=True`` (needs ``P <= num_groups``, where ``NT == P``): row ``p`` takes tile
    ``p`` alone, nothing counted or sorted. Exact for any groups; a group named by two rows is
    read by two tiles, so it is meant for rows known to name distinct groups (one token's top-k
    experts), where it is the layout above with the tiles in row order.
    """
    validation.check_rank("group_of_row", group_of_row, 1)
    P = int(np.shape(group_of_row)[0])
    G, TM = int(num_groups), int(tile_rows)
    NT = num_tiles(P, G, TM)
    g = jnp.asarray(group_of_row).astype(jnp.int32)
    valid = (g >= 0) & (g < G)
    key = jnp.where(valid, g, G)  # rows of no group: G (they sort last)
    if rows_apart:
        if NT != P:
            raise ValueError(f"rows_apart needs at most num_groups={G} rows (one tile each), got {P}")
        return jnp.where(valid, jnp.arange(P, dtype=jnp.int32) * TM, NT * TM).astype(jnp.int32), key
    # Each row's rank among its group's rows: counted, not sorted (a stable sort of the rows by
    # group was XLA:GPU's CUB radix sort, six kernels with a memset and a gap before each, ~80 us
    # of each MoE layer of an 8k prefill; BENCHMARKS.md), and not a running count down a [P, G]
    # one-hot either (XLA:GPU fuses that into a reduction of G outputs, each walking all P rows:
    # 121 us at P 384, G 64 on an H200): see _group_ranks.
    i32 = jnp.int32  # sums stay int32 under x64
    rank, counts = _group_ranks(key, G)
    tiles = (counts + TM - 1) // TM
    ends = jnp.cumsum(tiles, dtype=i32)  # [G] exclusive end tile of each group
    starts = ends - tiles
    slot = jnp.where(valid, starts[jnp.minimum(key, G - 1)] * TM + rank, NT * TM).astype(i32)
    tile = jnp.arange(NT, dtype=jnp.int32)
    tile_group = jnp.sum(ends[None, :] <= tile[:, None], axis=1, dtype=i32)  # G: unused
    return slot, tile_group


#: Rows per chunk of :func:`_group_ranks`, and chunks per block of :func:`_exclusive_prefix`: the
#: longest reduction either runs.
RANK_CHUNK = 256


def _group_ranks(key: jax.Array, G: int) -> tuple[jax.Array, jax.Array]:
    """``(rank int32 [P], counts int32 [G])`` of ``key [P]`` (int32, ``G`` for a row of no group):
    ``rank[p]`` the rows ``q < p`` with ``key[q] == key[p]``, ``counts[g]`` the rows of group
    ``g``. Only reductions of at most ``max(G, RANK_CHUNK)`` values: the rows in chunks of
    :data:`RANK_CHUNK`, a row's rank the earlier rows of its chunk in its group (a compare and a
    sum over the chunk, which XLA:GPU fuses; XLA:CPU materialises the ``[P, RANK_CHUNK]``
    compare, ~50 MB at 49,152 rows) plus its group's rows in the earlier chunks
    (:func:`_exclusive_prefix` of the per-chunk counts, materialised once behind a barrier, not
    recomputed by every chunk that sums them)."""
    i32 = jnp.int32
    P = int(key.shape[0])
    if P == 0:
        return jnp.zeros((0,), i32), jnp.zeros((G,), i32)
    C = min(RANK_CHUNK, P)
    n = -(-P // C)
    kc = jnp.pad(key, (0, n * C - P), constant_values=G).reshape(n, C)  # pad rows: no group
    per_chunk = jnp.sum(kc[:, :, None] == jnp.arange(G, dtype=i32)[None, None, :], axis=1, dtype=i32)
    per_chunk = jax.lax.optimization_barrier(per_chunk)  # [n, G]
    before = _exclusive_prefix(per_chunk)  # [n, G]: the group's rows in the chunks before
    pos = jnp.arange(C, dtype=i32)
    within = jnp.sum((kc[:, None, :] == kc[:, :, None]) & (pos[None, None, :] < pos[None, :, None]),
                     axis=2, dtype=i32)  # [n, C]: the group's rows before it in its chunk
    rank = jnp.take_along_axis(before, jnp.minimum(kc, G - 1), axis=1) + within
    return rank.reshape(n * C)[:P], before[-1] + per_chunk[-1]


def _exclusive_prefix(x: jax.Array) -> jax.Array:
    """``out[i] = sum(x[:i])`` of int32 ``x [n, G]`` along its first axis, by reductions of at
    most :data:`RANK_CHUNK` values: up to that many rows, a masked sum over the earlier rows;
    beyond, blocks of that many rows, each row's earlier rows of its block (this function on
    each block) plus the earlier blocks' totals (this function on the ``n / RANK_CHUNK`` totals)."""
    i32 = jnp.int32
    n = int(x.shape[0])
    if n <= RANK_CHUNK:
        i = jnp.arange(n, dtype=i32)
        return jnp.sum(jnp.where((i[None, :] < i[:, None])[:, :, None], x[None], 0), axis=1, dtype=i32)
    m = -(-n // RANK_CHUNK)
    blocks = jnp.pad(x, ((0, m * RANK_CHUNK - n), (0, 0))).reshape(m, RANK_CHUNK, -1)
    inside = jax.vmap(_exclusive_prefix)(blocks)  # [m, RANK_CHUNK, G]
    totals = jax.lax.optimization_barrier(jnp.sum(blocks, axis=1, dtype=i32))  # [m, G]
    return (inside + _exclusive_prefix(totals)[:, None]).reshape(m * RANK_CHUNK, -1)[:n]


# --------------------------------------------------------------------------
# Reference (plain XLA)
# --------------------------------------------------------------------------


def _operands(x, w):
    """Both operands widened to float32 (exact for bf16 / f16 products), and the precision."""
    return x.astype(jnp.float32), w.astype(jnp.float32), jax.lax.Precision.HIGHEST


def _as_stack(m, more_groups: int):
    """``more_w`` / ``more_gate`` as a ``[S, K, N]`` stack (side by side ``[K, S * N]``: a copy)."""
    if m.ndim == 3:
        return m
    K, SN = m.shape
    return m.reshape(K, more_groups, SN // more_groups).transpose(1, 0, 2)


@_backend.register(OP_GROUPED_MATMUL, "reference")
def _reference(x, w, tile_group, gate, more_w, more_gate, x_rows, *, tile_rows, activation, out_dtype,
                more_groups, config, interpret):
    del config, interpret
    if x_rows is not None:  # a row outside [0, M) reads as zeros
        M = x.shape[0]
        x = jnp.take(x, jnp.where((x_rows >= 0) & (x_rows < M), x_rows, M), axis=0, mode="fill", fill_value=0)
    if more_w is not None:
        w = jnp.concatenate([w, _as_stack(more_w, more_groups)])
        if gate is not None:
            gate = jnp.concatenate([gate, _as_stack(more_gate, more_groups)])
    G = w.shape[0]
    NT = tile_group.shape[0]
    used = (tile_group >= 0) & (tile_group < G)
    pick = jnp.where(used, tile_group, 0)

    def product(m):
        a, b, prec = _operands(x.reshape(NT, tile_rows, -1), jnp.take(m, pick, axis=0))
        return jnp.einsum("imk,ikn->imn", a, b, precision=prec, preferred_element_type=jnp.float32)

    out = product(w)
    if gate is not None:
        out = _activate(product(gate), activation) * out
    out = jnp.where(used[:, None, None], out, 0.0).reshape(NT * tile_rows, -1)
    return out.astype(out_dtype)


# --------------------------------------------------------------------------
# GPU: Pallas Triton, one program per (tile, column block)
# --------------------------------------------------------------------------


def _blocks(NT: int, N: int, K: int, TM: int, cfg: GroupedMatmulConfig,
            gated: bool = False) -> tuple[int, int, int, int]:
    """``(block_n, block_k, num_warps, num_stages)`` (see :class:`GroupedMatmulConfig`)."""
    few = TM <= MIN_TILE_ROWS and NT * TM <= FEW_ROWS
    full = TM >= MAX_TILE_ROWS
    BN = cfg.gpu_block_n
    if BN is None:  # a gated product holds two accumulators: 256 columns of both would spill
        BN = min(256 if full and not gated else 128, max(16, pl.next_power_of_2(N)))
        while BN > (64 if few else 32) and NT * -(-N // BN) < cfg.gpu_min_programs:
            BN //= 2
    BK = cfg.gpu_block_k or min(128 if few else 64, max(16, pl.next_power_of_2(K)))
    warps = cfg.gpu_num_warps or (4 if TM <= 64 else 8)
    stages = cfg.gpu_num_stages or (4 if full else 3)
    return int(BN), int(BK), int(warps), int(stages)


def _fit_shared_memory(TM: int, BN: int, BK: int, itemsize: int, gated: bool, cfg: GroupedMatmulConfig,
                       budget: int, stages: int) -> tuple[int, int]:
    """``(block_n, block_k)``: :func:`_blocks`' sizes, ``block_k`` then ``block_n`` halved (where
    the config leaves them free, down to 16) while the ``K`` loop's pipeline buffers pass
    ``budget`` bytes (:func:`gpu_tiling.shared_memory_budget`): ``stages`` chunks of an ``x``
    tile and one weight tile (two when gated), what Triton asks for (an H200 refused gated
    128-row tiles with ``block_k`` 128 at 294,912 bytes for 3 stages and 393,216 for 4: 3 and 4
    chunks of 98,304). On Hopper the bf16 tiles the models take keep their sizes (a prefill's
    128-row tiles in four stages: 192 KiB of 192; a gated few-rows step: 108 KiB); float32 tiles
    and smaller GPUs' shrink."""

    def need(bn, bk):
        return stages * (TM * bk + (2 if gated else 1) * bk * bn) * itemsize

    while cfg.gpu_block_k is None and BK > 16 and need(BN, BK) > budget:
        BK //= 2
    while cfg.gpu_block_n is None and BN > 16 and need(BN, BK) > budget:
        BN //= 2
    return int(BN), int(BK)


@_backend.register(OP_GROUPED_MATMUL, "gpu")
def _gpu(x, w, tile_group, gate, more_w, more_gate, x_rows, *, tile_rows, activation, out_dtype,
         more_groups, config, interpret):
    TM = tile_rows
    G, K, N = w.shape
    S = more_groups if more_w is not None else 0
    side_by_side = S > 0 and more_w.ndim == 2
    NT = tile_group.shape[0]
    BN, BK, warps, stages = _blocks(NT, N, K, TM, config, gate is not None)
    BN, BK = _fit_shared_memory(TM, BN, BK, jnp.dtype(x.dtype).itemsize, gate is not None, config,
                                gpu_tiling.device_shared_memory_budget(), stages)
    if not interpret and (TM < 16 or TM & (TM - 1)):
        raise NotImplementedError(f"the GPU kernel needs tile_rows a power of two >= 16 (Triton blocks "
                                  f"and products), got {TM}")
    M = x.shape[0]
    in_place = x_rows is not None
    for name, shape in (("x", x.shape), ("w", w.shape), ("the output", (NT * TM, N + BN)),
                        ("more_w", (S, K, N))):
        gpu_tiling.check_int32_offsets(name, shape)
    f32 = jnp.dtype(x.dtype) == jnp.float32
    # Interpret mode widens both operands (XLA:CPU has no bf16 x bf16 -> f32 dot); the products
    # are exact either way.
    prec = jax.lax.Precision.HIGHEST if (f32 or interpret) else None
    k_even, n_even = K % BK == 0, N % BN == 0
    Np = -(-N // BN) * BN
    load, store = _backend.triton.load, _backend.triton.store
    gated = gate is not None

    def kernel(group_ref, x_ref, w_ref, *refs):
        # group_ref i32[NT], x_ref [NT * TM * K] (with x_rows: [M * K]), w_ref (and gated: gate_ref)
        # [G * K * N], with more groups more_ref (and more_gate_ref) [S * K * N], with x_rows
        # rows_ref i32[NT * TM], o_ref out_dtype[NT * TM * Np].
        refs = list(refs)
        rows_ref = refs.pop(-2) if in_place else None
        gate_ref = refs.pop(0) if gated else None
        more_ref = refs.pop(0) if S else None
        more_gate_ref = refs.pop(0) if S and gated else None
        o_ref, = refs
        i, j = pl.program_id(0), pl.program_id(1)
        g = group_ref[i]
        rows = i * TM + jnp.arange(TM, dtype=jnp.int32)
        cols = j * BN + jnp.arange(BN, dtype=jnp.int32)
        if in_place:  # the tile's rows of x: a row number outside [0, M) reads zeros
            src = load(rows_ref.at[rows])
            row_ok = (src >= 0) & (src < M)
            src = jnp.where(row_ok, src, 0)
        else:
            src, row_ok = rows, None
        # The output is Np = cdiv(N, BN) * BN wide: every lane stores to its own address
        # (interpret mode writes masked lanes back), the padding columns are sliced off.
        out_at = o_ref.at[rows[:, None] * Np + cols[None, :]]
        col_ok = cols < N
        if not n_even:  # masked columns read inside the matrix
            cols = jnp.minimum(cols, N - 1)

        def product(mats, address):
            """The tile's product with ``mats`` (one, or two when gated), element ``(k, n)`` of
            the tile's matrix at ``address(kk, cols)``."""
            def step(kb, accs):
                kk = kb * BK + jnp.arange(BK, dtype=jnp.int32)
                if k_even:
                    a_mask = None if row_ok is None else jnp.broadcast_to(row_ok[:, None], (TM, BK))
                    b_mask = None if n_even else jnp.broadcast_to(col_ok[None, :], (BK, BN))
                else:
                    k_ok = kk < K
                    kk = jnp.minimum(kk, K - 1)
                    a_mask = jnp.broadcast_to(k_ok[None, :], (TM, BK))
                    if row_ok is not None:
                        a_mask = a_mask & row_ok[:, None]
                    b_mask = k_ok[:, None] & col_ok[None, :]
                a_at = x_ref.at[src[:, None] * K + kk[None, :]]
                a = load(a_at) if a_mask is None else load(a_at, mask=a_mask, other=0)
                if interpret:
                    a = a.astype(jnp.float32)
                out = []
                for m_ref, acc in zip(mats, accs):
                    b_at = m_ref.at[address(kk[:, None], cols[None, :])]
                    b = load(b_at) if b_mask is None else load(b_at, mask=b_mask, other=0)
                    if interpret:
                        b = b.astype(jnp.float32)
                    out.append(acc + jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                                                         precision=prec,
                                                         preferred_element_type=jnp.float32))
                return tuple(out)

            zero = jnp.zeros((TM, BN), jnp.float32)
            accs = jax.lax.fori_loop(0, -(-K // BK), step, (zero, zero) if gated else (zero,))
            out = _activate(accs[1], activation) * accs[0] if gated else accs[0]
            store(out_at, out.astype(out_dtype))

        @pl.when((g >= 0) & (g < G))
        def _main_groups():
            product((w_ref, gate_ref) if gated else (w_ref,), lambda k, n: (g * K + k) * N + n)

        if S:
            @pl.when((g >= G) & (g < G + S))
            def _more_groups():
                e = g - G
                if side_by_side:  # group G + e is columns e * N .. (e + 1) * N of [K, S * N]
                    address = lambda k, n: k * (S * N) + e * N + n  # noqa: E731
                else:
                    address = lambda k, n: (e * K + k) * N + n  # noqa: E731
                product((more_ref, more_gate_ref) if gated else (more_ref,), address)

        @pl.when((g < 0) | (g >= G + S))
        def _unused_tile():
            store(out_at, jnp.zeros((TM, BN), out_dtype))

    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((NT * TM * Np,), out_dtype),
        grid=(NT, Np // BN),
        compiler_params=_backend.triton.CompilerParams(num_warps=warps,
                                                       num_stages=stages),
        interpret=interpret,
        name="grouped_matmul_gpu",
    )
    mats = (w.reshape(-1),) + ((gate.reshape(-1),) if gated else ())
    if S:
        mats += (more_w.reshape(-1),) + ((more_gate.reshape(-1),) if gated else ())
    if in_place:
        mats += (x_rows,)
    out = call(tile_group, x.reshape(-1), *mats).reshape(NT * TM, Np)
    return out if n_even else out[:, :N]


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------


def grouped_matmul(x, w, tile_group, *, tile_rows: int, gate=None, activation: str | None = None,
                   out_dtype=jnp.float32, more_w=None, more_gate=None, more_groups: int = 0,
                   x_rows=None, backend: str = "auto", interpret: bool | None = None,
                   config: GroupedMatmulConfig = GroupedMatmulConfig()):
    """Each ``tile_rows``-row tile of ``x`` times its group's matrix (see the module docstring).

    Args:
      x: ``[NT * tile_rows, K]``, float32, bfloat16 or float16; with ``x_rows``, ``[M, K]``.
      w: ``[G, K, N]``, ``x``'s dtype.
      tile_group: int32 ``[NT]``: tile ``i``'s group; outside ``[0, G + more_groups)``: an unused
        tile.
      tile_rows: rows of a tile (static; >= 16 for the compiled GPU kernel).
      gate: optional ``[G, K, N]`` in ``w``'s dtype; with it, ``activation`` (one of
        :data:`ACTIVATIONS`, static) is required and the output is
        ``activation(x @ gate[g]) * (x @ w[g])``.
      out_dtype: the output's float dtype (static; the float32 result rounded once).
      more_w, more_gate, more_groups: ``more_groups`` (static) groups ``G .. G + S - 1`` held
        apart from ``w`` (and ``gate``, which then needs ``more_gate`` in the same layout):
        ``[S, K, N]`` (a stack like ``w``), or ``[K, S * N]`` side by side (group ``G + s`` is
        columns ``s * N .. (s + 1) * N``: a dense layer's matrix read as ``S`` experts in
        place). The kernel reads them where they are; the reference concatenates.
      x_rows: optional int32 ``[NT * tile_rows]``: tile row ``r`` is ``x[x_rows[r]]``, zeros where
        ``x_rows[r]`` is outside ``[0, M)`` (the tile layout's padding rows; no value is refused).
      backend, interpret: see :mod:`pallas_kernels.backend` (TPU: the reference).
      config: :class:`GroupedMatmulConfig` (static).

    Returns:
      ``out_dtype`` ``[NT * tile_rows, N]``; 0 in unused tiles.

    Raises:
      ValueError: bad ranks, shapes or dtypes, or a bad ``tile_rows``.
      NotImplementedError: the compiled GPU kernel cannot take the shapes.
    """
    choice = _backend.choose(OP_GROUPED_MATMUL, backend, interpret)
    if not isinstance(config, GroupedMatmulConfig):
        raise ValueError(f"config must be a GroupedMatmulConfig, got {config!r}")
    tile_rows = validation.static_int("tile_rows", tile_rows)
    validation.check_rank("x", x, 2)
    validation.check_rank("w", w, 3)
    validation.check_rank("tile_group", tile_group, 1)
    validation.check_dtype("x", x, (np.float32, jnp.bfloat16, np.float16))
    validation.check_dtype("w", w, np.dtype(x.dtype))
    validation.check_dtype("tile_group", tile_group, np.int32)
    NT = int(np.shape(tile_group)[0])
    if x_rows is None:
        validation.check_shape("x", x, (NT * tile_rows, np.shape(w)[1]))
    else:
        validation.check_rank("x_rows", x_rows, 1)
        validation.check_dtype("x_rows", x_rows, np.int32)
        validation.check_shape("x_rows", x_rows, (NT * tile_rows,))
        validation.check_shape("x", x, (np.shape(x)[0], np.shape(w)[1]))
    if gate is None:
        if activation is not None:
            raise ValueError(f"activation is for the gated form (gate=...), got {activation!r} without a gate")
    else:
        validation.check_shape("gate", gate, tuple(np.shape(w)))
        validation.check_dtype("gate", gate, np.dtype(w.dtype))
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS} with a gate, got {activation!r}")
    if not jnp.issubdtype(out_dtype, jnp.floating):
        raise ValueError(f"out_dtype must be a float dtype, got {out_dtype!r}")
    out_dtype = jnp.dtype(out_dtype)
    G, K, N = np.shape(w)
    S = _check_more(more_w, more_gate, more_groups, gated=gate is not None, G=G, K=K, N=N, dtype=w.dtype)
    if NT == 0 or N == 0 or G == 0 or K == 0 or np.shape(x)[0] == 0:  # (x_rows into no row: all zeros)
        return jnp.zeros((NT * tile_rows, N), out_dtype)
    return _backend.run(OP_GROUPED_MATMUL, choice, x, w, tile_group, gate, more_w, more_gate, x_rows,
                        tile_rows=tile_rows, activation=activation, out_dtype=out_dtype,
                        more_groups=S, config=config)


def _check_more(more_w, more_gate, more_groups, *, gated: bool, G: int, K: int, N: int, dtype) -> int:
    """The number of groups ``more_w`` adds (0 without it), its arguments checked."""
    if more_w is None:
        if more_gate is not None or more_groups:
            raise ValueError(f"more_gate and more_groups need more_w, got more_gate "
                             f"{'set' if more_gate is not None else None} and more_groups={more_groups!r}")
        return 0
    S = validation.static_int("more_groups", more_groups)
    if G == 0:
        raise ValueError(f"w must hold at least one group beside more_w, got shape [{G}, {K}, {N}]")
    shapes = ((S, K, N), (K, S * N))
    for name, m in (("more_w", more_w), ("more_gate", more_gate if gated else None)):
        if gated and m is None:
            raise ValueError("more_gate is required with gate and more_w (the gated form of the more groups)")
        if m is None:
            continue
        if tuple(np.shape(m)) not in shapes:
            raise ValueError(f"{name} must have shape {list(shapes[0])} (a stack) or {list(shapes[1])} "
                             f"(side by side), got {list(np.shape(m))}")
        validation.check_dtype(name, m, np.dtype(dtype))
    if not gated and more_gate is not None:
        raise ValueError("more_gate is for the gated form (gate=...), got it without a gate")
    if gated and np.ndim(more_gate) != np.ndim(more_w):
        raise ValueError(f"more_gate must have more_w's layout, got shapes {list(np.shape(more_gate))} "
                         f"and {list(np.shape(more_w))}")
    return S
