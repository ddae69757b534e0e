"""The model's paged KV caches and recurrent-state pools, as one pytree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.models.config import TinyHybridConfig

# kv_cache_dtype strings (as in vLLM) -> storage dtype of the KV caches.
_KV_DTYPES = {"auto": jnp.float32, "fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn}


# Where the attention layers keep K/V: "flash" (vLLM's separate key/value caches)
# or "rpa" (JAX's ragged-paged-attention cache, K and V interleaved on one axis).
KV_LAYOUTS = ("flash", "rpa")


def check_kv_layout(kv_layout) -> str:
    """``kv_layout`` if it is one of :data:`KV_LAYOUTS`, else ``ValueError``."""
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    return kv_layout


def kv_storage_dtype(kv_cache_dtype: str):
    """Storage dtype for a ``kv_cache_dtype`` string (``"auto"`` -> float32)."""
    try:
        return _KV_DTYPES[kv_cache_dtype]
    except (KeyError, TypeError):
        raise ValueError(
            f"kv_cache_dtype must be one of {sorted(_KV_DTYPES)}, got {kv_cache_dtype!r}"
        ) from None


@struct.dataclass
class HybridCaches:
    """Every piece of per-step-mutated device memory of the model.

    Attributes (tuples in layer order, one entry per layer of that type):
      key, value: per attention layer, ``[num_blocks, block_size, num_kv_heads,
        head_dim]`` (float32, or float8_e4m3fn for fp8); axis 0 counts kernel
        blocks, block 0 is the reserved null block. With ``kv_layout="rpa"``,
        ``key`` holds each layer's ``kv_pages [num_blocks, block_size,
        2 * num_kv_heads, head_dim]`` (see ``pallas_kernels.write_kv_pages``)
        and ``value`` is empty.
      conv_state: per Mamba layer, float32 ``[num_state_slots, conv_dim,
        conv_width - 1 + num_spec_tokens]``; slot 0 reserved.
      ssm_state: per Mamba layer, float32 ``[num_state_slots, mamba_num_heads,
        mamba_head_dim, mamba_d_state]``; slot 0 reserved.
      kv_cache_dtype: ``"auto"``, ``"fp8"`` or ``"fp8_e4m3"`` (meta field).
      kv_layout: ``"flash"`` or ``"rpa"`` (meta field).
    """

    key: tuple[jax.Array, ...]
    value: tuple[jax.Array, ...]
    conv_state: tuple[jax.Array, ...]
    ssm_state: tuple[jax.Array, ...]
    kv_cache_dtype: str = struct.field(pytree_node=False, default="auto")
    kv_layout: str = struct.field(pytree_node=False, default="flash")

    @property
    def kv_arrays(self) -> list[jax.Array]:
        """K and V of every attention layer (what ``zero_blocks`` zeroes for fresh blocks)."""
        if self.kv_layout == "rpa":
            return list(self.key)
        return [a for kv in zip(self.key, self.value) for a in kv]

    @property
    def state_arrays(self) -> list[jax.Array]:
        """Conv and SSM state of every Mamba layer (axis 0 = state slot)."""
        return [a for cs in zip(self.conv_state, self.ssm_state) for a in cs]

    def replace_kv_arrays(self, arrays) -> "HybridCaches":
        """Inverse of :attr:`kv_arrays` (e.g. with the result of ``zero_blocks``)."""
        arrays = list(arrays)
        if self.kv_layout == "rpa":
            if len(arrays) != len(self.key):
                raise ValueError(f"expected {len(self.key)} kv_pages arrays, got {len(arrays)}")
            return self.replace(key=tuple(arrays))
        if len(arrays) != 2 * len(self.key):
            raise ValueError(f"expected {2 * len(self.key)} KV arrays, got {len(arrays)}")
        return self.replace(key=tuple(arrays[0::2]), value=tuple(arrays[1::2]))

    def replace_state_arrays(self, arrays) -> "HybridCaches":
        """Inverse of :attr:`state_arrays`."""
        arrays = list(arrays)
        if len(arrays) != 2 * len(self.conv_state):
            raise ValueError(f"expected {2 * len(self.conv_state)} state arrays, got {len(arrays)}")
        return self.replace(conv_state=tuple(arrays[0::2]), ssm_state=tuple(arrays[1::2]))


def init_caches(
    config: TinyHybridConfig,
    num_blocks: int,
    block_size: int,
    num_state_slots: int,
    kv_cache_dtype: str = "auto",
    *,
    num_spec_tokens: int = 0,
    kv_layout: str = "flash",
) -> HybridCaches:
    """Zeroed caches for ``config``.

    Args:
      num_blocks: kernel blocks per KV cache (block 0 is the null block).
      block_size: the kernel block size of the attention group
        (``KVGroupSpec.kernel_block_size``).
      num_state_slots: recurrent-state slots per Mamba layer (slot 0 reserved).
      kv_cache_dtype: ``"auto"`` (float32) or ``"fp8"``/``"fp8_e4m3"``.
      num_spec_tokens: speculative tokens per decode step; the conv states get
        ``num_spec_tokens`` extra columns for vLLM's sliding speculative window.
      kv_layout: ``"flash"`` (key and value caches) or ``"rpa"`` (one combined
        ``kv_pages`` per layer).

    Returns:
      :class:`HybridCaches` (shapes in its docstring).
    """
    for name, v, lo in (
        ("num_blocks", num_blocks, 2),
        ("block_size", block_size, 1),
        ("num_state_slots", num_state_slots, 2),
    ):
        if not isinstance(v, int) or v < lo:
            raise ValueError(
                f"{name} must be an int >= {lo} (index 0 is reserved), got {v!r}"
            )
    if not isinstance(num_spec_tokens, int) or num_spec_tokens < 0:
        raise ValueError(f"num_spec_tokens must be a non-negative int, got {num_spec_tokens!r}")
    kv_dtype = kv_storage_dtype(kv_cache_dtype)
    check_kv_layout(kv_layout)
    c = config
    rpa = kv_layout == "rpa"
    kv_shape = (num_blocks, block_size, c.num_kv_heads * (2 if rpa else 1), c.head_dim)
    conv_shape = (num_state_slots, c.conv_dim, c.conv_width - 1 + num_spec_tokens)
    ssm_shape = (num_state_slots, c.mamba_num_heads, c.mamba_head_dim, c.mamba_d_state)
    na, nm = c.num_attn_layers, c.num_mamba_layers
    return HybridCaches(
        key=tuple(jnp.zeros(kv_shape, kv_dtype) for _ in range(na)),
        value=() if rpa else tuple(jnp.zeros(kv_shape, kv_dtype) for _ in range(na)),
        conv_state=tuple(jnp.zeros(conv_shape, jnp.float32) for _ in range(nm)),
        ssm_state=tuple(jnp.zeros(ssm_shape, jnp.float32) for _ in range(nm)),
        kv_cache_dtype=kv_cache_dtype,
        kv_layout=kv_layout,
    )
