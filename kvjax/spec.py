"""Static, hashable configuration of the runner state.

These objects live in pytree meta fields and in ``jax.jit`` static arguments,
so they are frozen dataclasses of plain Python ints.
"""

from __future__ import annotations

import dataclasses


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class KVGroupSpec:
    """One KV-cache group: layers sharing a block size and a block table.

    Attributes:
      block_size: logical (scheduler) block size in tokens.
      max_num_blocks: logical blocks one request row can hold.
      kernel_block_size: block size the kernels index; must divide
        ``block_size``. Logical block ``b`` expands to kernel blocks
        ``b*r .. b*r+r-1`` with ``r = block_size // kernel_block_size``.
      sliding_window: if set, tokens attend only to the last
        ``sliding_window`` positions, and gathered block tables null the
        leading blocks no query of the step can see.
    """

    block_size: int
    max_num_blocks: int
    kernel_block_size: int | None = None
    sliding_window: int | None = None

    def __post_init__(self):
        if self.kernel_block_size is None:
            object.__setattr__(self, "kernel_block_size", self.block_size)
        for name in ("block_size", "max_num_blocks", "kernel_block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"KVGroupSpec.{name} must be a positive int, got {v!r}")
        q, r = divmod(self.block_size, self.kernel_block_size)
        if r:
            raise ValueError(
                f"KVGroupSpec.kernel_block_size={self.kernel_block_size} must divide "
                f"block_size={self.block_size}"
            )
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window <= 0
        ):
            raise ValueError(
                f"KVGroupSpec.sliding_window must be None or a positive int, got {self.sliding_window!r}"
            )

    @property
    def blocks_per_kv_block(self) -> int:
        """``r``: kernel blocks per logical block."""
        return self.block_size // self.kernel_block_size

    @property
    def table_width(self) -> int:
        """Columns of a block-table row, in kernel blocks: ``max_num_blocks * r``."""
        return self.max_num_blocks * self.blocks_per_kv_block

    def blocks_to_add(self, num_tokens: int, num_held: int) -> int:
        """Logical blocks a request holding ``num_held`` must add to hold ``num_tokens`` tokens."""
        return max(cdiv(num_tokens, self.block_size) - num_held, 0)

    @classmethod
    def for_model_len(cls, block_size: int, max_model_len: int, **kw) -> "KVGroupSpec":
        """A group whose rows hold ``max_model_len`` tokens."""
        return cls(block_size=block_size, max_num_blocks=cdiv(max_model_len, block_size), **kw)
