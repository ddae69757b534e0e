"""Helpers shared by the Mamba ops (``mamba_ssu``, ``mamba_conv``, ``mamba_scan``).

Argument checks for index tables and packed batches, the null-row predicate,
token -> sequence lookup for packed batches, vLLM's softplus, and :class:`Columns`
(an operand read in place from a wider array's columns).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import contract


def pow2(n: int) -> int:
    """Smallest power of two >= n (>= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def softplus(v):
    """vLLM's softplus: ``v`` above 20, else ``log(1 + exp(v))``."""
    return jnp.where(v <= 20.0, jnp.log1p(jnp.exp(jnp.minimum(v, 20.0))), v)


def check_int_arg(name: str, value) -> int:
    """``value`` as an int; ``ValueError`` unless it is a (non-bool) Python/numpy int."""
    if not contract.is_int(value):
        raise ValueError(f"{name} must be a Python int, got {value!r}")
    return int(value)


def check_float(name: str, arr) -> None:
    contract.check_dtype(name, arr, "floating")


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Columns:
    """An operand that is columns ``[start, start + width)`` of the first ``shape[0]`` rows of a
    2-D array ``parent [n, C]`` (``shape[0] <= n``), read as an array of ``shape`` (``width =
    prod(shape[1:])``, row-major). Rows past ``shape[0]`` are never read or written.

    What a strided torch view of a projection is to vLLM's kernels: the GPU kernels of
    :func:`~pallas_kernels.mamba.causal_conv1d_update` and
    :func:`~pallas_kernels.mamba.selective_state_update` read such an operand from ``parent``
    in place (no copy of the slice before the kernel); every other implementation reads
    :meth:`value`. ``start`` and ``shape`` are static.
    """

    parent: jax.Array
    start: int
    shape: tuple

    def __post_init__(self):  # the checks run where a caller builds one, not where JAX rebuilds one
        shape = tuple(self.shape)
        start = check_int_arg("Columns start", self.start)
        if np.ndim(self.parent) != 2:
            raise ValueError(f"Columns parent must have rank 2 [n, C], got shape {tuple(np.shape(self.parent))}")
        n, width = np.shape(self.parent)
        if (len(shape) < 2 or any(isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)) or d < 1
                                  for d in shape) or shape[0] > n):
            raise ValueError(f"Columns shape must be [rows <= {n}, ...] of positive ints (parent shape "
                             f"{[n, width]}), got {list(shape)}")
        shape = tuple(int(d) for d in shape)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "start", start)
        if start < 0 or start + self.width > width:
            raise ValueError(f"Columns [{start}, {start + self.width}) must lie within the parent's {width} columns")

    def tree_flatten(self):
        return (self.parent,), (self.start, self.shape)

    @classmethod
    def tree_unflatten(cls, aux, children):
        # no checks: JAX rebuilds with placeholder or batched (vmap) leaves
        obj = object.__new__(cls)
        object.__setattr__(obj, "parent", children[0])
        object.__setattr__(obj, "start", aux[0])
        object.__setattr__(obj, "shape", aux[1])
        return obj

    @property
    def width(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        return self.parent.dtype

    def value(self) -> jax.Array:
        """The operand as an array of its own (a slice of ``parent``)."""
        rows = self.shape[0]
        return jax.lax.slice(self.parent, (0, self.start), (rows, self.start + self.width)).reshape(self.shape)

    def with_value(self, v: jax.Array) -> Columns:
        """The same columns of a new parent: ``parent`` with them set to ``v`` (cast to its dtype)."""
        v = jnp.asarray(v).reshape(self.shape[0], self.width).astype(self.parent.dtype)
        return Columns(jax.lax.dynamic_update_slice(self.parent, v, (0, self.start)), self.start, self.shape)


def values(*args):
    """Each argument's array: a :class:`Columns` materialised, anything else as it is."""
    return tuple(a.value() if isinstance(a, Columns) else a for a in args)


def index_array(name: str, arr, ranks, *, fill: int = -1) -> jax.Array:
    """Checks an index table (integer dtype, rank) and returns it as int32.

    Narrowed by :func:`pallas_kernels.contract.as_int32`: a concrete value beyond
    int32 is a ``ValueError``; a traced one becomes ``fill`` (an out-of-range value
    for the argument, so the op masks it).
    """
    contract.check_rank(name, arr, ranks)
    return jnp.asarray(contract.as_int32(name, arr, fill=fill))


def check_index_values(name: str, arr, num_lines: int, null_block_id: int) -> None:
    """Concrete indices must lie in ``[0, num_lines)`` or equal ``null_block_id``."""
    contract.check_values_in_range(name, arr, 0, num_lines, allow=(null_block_id,))


def valid_index(idx, num_lines: int, null_block_id: int):
    """True where ``idx`` names a real row: not null and inside ``[0, num_lines)``."""
    return (idx != null_block_id) & (idx >= 0) & (idx < num_lines)


def sequence_bounds(cu, num_tokens: int):
    """(bos, lens) int32 ``[n]`` of the sequences of an int32 offsets array ``cu [n + 1]``.

    The one rule for malformed offsets (every flavour of every op uses it):
    sequence ``b`` is real only if every offset ``cu[0..b+1]`` lies in
    ``[0, num_tokens]`` and they are non-decreasing up to ``b + 1``. Any other
    sequence (and every one after a bad offset) gets ``bos = num_tokens`` and
    ``lens = 0``: it reads and writes nothing, and the real ones stay disjoint and
    in order. Comparisons only, so no offset arithmetic can overflow.
    """
    lo, hi = cu[:-1], cu[1:]
    good = offsets_good(lo, hi, num_tokens)
    ok = jnp.cumsum(jnp.logical_not(good).astype(jnp.int32)) == 0
    bos = jnp.where(ok, lo, num_tokens).astype(jnp.int32)
    lens = jnp.where(ok, hi - jnp.where(ok, lo, 0), 0).astype(jnp.int32)
    return bos, lens


def offsets_good(lo, hi, num_tokens: int):
    """Sequence ``[lo, hi)`` is well formed on its own: ``0 <= lo <= hi <= num_tokens``.

    :func:`sequence_bounds` makes sequence ``b`` real only if this holds for every
    sequence up to ``b`` (kernels that read the offsets themselves apply the same rule).
    """
    return (lo >= 0) & (hi >= lo) & (hi <= num_tokens)


def offsets(name: str, cu, n: int, num_tokens: int):
    """Checks an offsets array (rank 1, ``[n + 1]``) and returns it as int32.

    Concrete: values must be non-decreasing within ``[0, num_tokens]`` (checked
    before narrowing), else ``ValueError``. Traced: see :func:`sequence_bounds`.
    """
    contract.check_rank(name, cu, 1)
    contract.check_shape(name, cu, (n + 1,))
    contract.check_dtype(name, cu, "integer")
    contract.check_non_decreasing(name, cu)
    contract.check_values_in_range(name, cu, 0, num_tokens + 1)
    return jnp.asarray(contract.as_int32(name, cu))


def segments(cu_seqlens, n: int, num_tokens: int, name: str = "cu_seqlens"):
    """(bos, lens) int32 ``[n]`` from a cumulative-length array, or one token per row."""
    if cu_seqlens is None:
        bos = jnp.arange(n, dtype=jnp.int32)
        return bos, jnp.ones((n,), jnp.int32)
    return sequence_bounds(offsets(name, cu_seqlens, n, num_tokens), num_tokens)


def varlen_batch(cache_indices, query_start_loc, has_initial_state, num_tokens: int,
                 num_lines: int, null_block_id: int):
    """Checks a packed prefill batch's per-request arrays; returns them as (int32, int32, bool).

    ``query_start_loc [R + 1]`` non-decreasing within ``[0, num_tokens]`` gives the
    ``R`` sequences. ``cache_indices [>= R]`` in ``[0, num_lines)`` or null, and
    ``has_initial_state [>= R]``: as in vLLM's ``causal_conv1d_fn`` (whose batch is
    ``query_start_loc``'s), entries past the ``R`` sequences are padding, ignored
    (they are still range-checked when concrete). Both come back cut to ``[R]``.
    """
    contract.check_rank("cache_indices", cache_indices, 1)
    contract.check_dtype("cache_indices", cache_indices, "integer")
    check_index_values("cache_indices", cache_indices, num_lines, null_block_id)
    ci = index_array("cache_indices", cache_indices, 1)
    contract.check_rank("query_start_loc", query_start_loc, 1)
    R = np.shape(query_start_loc)[0] - 1
    if R < 0:
        raise ValueError("query_start_loc must have shape [num_sequences + 1], got [0]")
    if ci.shape[0] < R:
        raise ValueError(
            f"cache_indices must have at least one entry per sequence of query_start_loc "
            f"(shape [{R + 1}], so >= {R} entries), got shape {list(ci.shape)}"
        )
    qsl = offsets("query_start_loc", query_start_loc, R, num_tokens)
    contract.check_rank("has_initial_state", has_initial_state, 1)
    if np.shape(has_initial_state)[0] < R:
        raise ValueError(
            f"has_initial_state must have at least one entry per sequence of query_start_loc "
            f"(>= {R} entries), got shape {list(np.shape(has_initial_state))}"
        )
    return ci[:R], qsl, jnp.asarray(has_initial_state).astype(bool)[:R]


def token_segment_ids(bos, lens, num_tokens: int):
    """For each token t: (segment id, position in segment, valid).

    Segments are contiguous and in order (cu_seqlens non-decreasing); a token that
    lies in no segment (padding) is invalid.
    """
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    eos = bos + lens
    # segment = first b with eos[b] > t
    seg = jnp.searchsorted(eos, t, side="right", method="compare_all").astype(jnp.int32)
    n = bos.shape[0]
    seg_c = jnp.where(seg < n, seg, 0)
    valid = (seg < n) & (t >= jnp.take(bos, seg_c, mode="clip")) & (n > 0)
    pos = t - jnp.take(bos, seg_c, mode="clip")
    return jnp.where(valid, seg_c, 0), jnp.where(valid, pos, 0), valid
