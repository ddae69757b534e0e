"""Helpers shared by the Mamba ops (``mamba_ssu``, ``mamba_conv``, ``mamba_scan``).

Argument checks for index tables and packed batches, the null-row predicate,
token -> sequence lookup for packed batches, and vLLM's softplus.
"""

from __future__ import annotations

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
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be a Python int, got {value!r}")
    return int(value)


def check_float(name: str, arr) -> None:
    contract.check_dtype(name, arr, "floating")


def index_array(name: str, arr, ranks) -> jax.Array:
    """Checks an index table (integer dtype, rank) and returns it as int32."""
    contract.check_rank(name, arr, ranks)
    contract.check_dtype(name, arr, "integer")
    return jnp.asarray(arr).astype(jnp.int32)


def check_index_values(name: str, arr, num_lines: int, null_block_id: int) -> None:
    """Concrete indices must lie in ``[0, num_lines)`` or equal ``null_block_id``."""
    contract.check_values_in_range(name, arr, 0, num_lines, allow=(null_block_id,))


def valid_index(idx, num_lines: int, null_block_id: int):
    """True where ``idx`` names a real row: not null and inside ``[0, num_lines)``."""
    return (idx != null_block_id) & (idx >= 0) & (idx < num_lines)


def segments(cu_seqlens, n: int, num_tokens: int, name: str = "cu_seqlens"):
    """(bos, lens) int32 ``[n]`` from a cumulative-length array, or one token per row."""
    if cu_seqlens is None:
        bos = jnp.arange(n, dtype=jnp.int32)
        return bos, jnp.ones((n,), jnp.int32)
    cu = index_array(name, cu_seqlens, 1)
    contract.check_non_decreasing(name, cu)
    contract.check_values_in_range(name, cu, 0, num_tokens + 1)
    return cu[:-1], cu[1:] - cu[:-1]


def varlen_batch(cache_indices, query_start_loc, has_initial_state, num_tokens: int,
                 num_lines: int, null_block_id: int):
    """Checks a packed prefill batch's per-request arrays; returns them as (int32, int32, bool).

    ``cache_indices [R]`` in ``[0, num_lines)`` or null, ``query_start_loc [R + 1]``
    non-decreasing within ``[0, num_tokens]``, ``has_initial_state [R]``.
    """
    ci = index_array("cache_indices", cache_indices, 1)
    R = ci.shape[0]
    qsl = index_array("query_start_loc", query_start_loc, 1)
    contract.check_shape("query_start_loc", qsl, (R + 1,))
    contract.check_non_decreasing("query_start_loc", qsl)
    contract.check_values_in_range("query_start_loc", qsl, 0, num_tokens + 1)
    contract.check_rank("has_initial_state", has_initial_state, 1)
    contract.check_shape("has_initial_state", has_initial_state, (R,))
    check_index_values("cache_indices", ci, num_lines, null_block_id)
    return ci, qsl, jnp.asarray(has_initial_state).astype(bool)


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
