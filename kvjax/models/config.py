"""Static configuration of the tiny hybrid (attention + Mamba2) model."""

from __future__ import annotations

import dataclasses

LAYER_TYPES = ("attn", "mamba", "moe")


@dataclasses.dataclass(frozen=True)
class TinyHybridConfig:
    """Hyper-parameters of :mod:`kvjax.models.tiny_hybrid` (hashable: a ``jit`` static arg).

    Attributes:
      vocab_size: byte-level vocabulary (256).
      d_model: residual width.
      layer_types: one entry per layer, ``"attn"``, ``"mamba"`` or ``"moe"`` (a
        mixture-of-experts feed-forward block, :mod:`kvjax.models.moe`).
      num_heads, num_kv_heads, head_dim: attention (GQA: query head ``h`` reads
        KV head ``h // (num_heads // num_kv_heads)``).
      rope_theta: RoPE base (rotate-half / NeoX layout).
      mamba_num_heads, mamba_head_dim, mamba_d_state, mamba_n_groups: the SSM
        (``d_inner = mamba_num_heads * mamba_head_dim``; B and C have
        ``mamba_n_groups`` groups of ``mamba_d_state``).
      conv_width: depthwise causal conv width (4).
      rms_eps: epsilon of every RMS norm.
      kv_group: the KV-cache group (index into ``StepBatch.block_tables`` and
        ``slot_mappings``) that the attention layers use.
      moe_num_experts, moe_top_k, moe_ffn_dim: the MoE blocks (experts, experts per
        token, hidden width of each SwiGLU expert); unused without ``"moe"`` layers.
      k_scale, v_scale: fp8 KV-cache scales (stored = saturate(x / scale)); unused
        when the cache dtype is ``"auto"``.
    """

    vocab_size: int = 256
    d_model: int = 64
    layer_types: tuple[str, ...] = ("attn", "mamba", "attn", "mamba")
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    mamba_num_heads: int = 4
    mamba_head_dim: int = 16
    mamba_d_state: int = 8
    mamba_n_groups: int = 1
    conv_width: int = 4
    rms_eps: float = 1e-5
    kv_group: int = 0
    k_scale: float = 1.0
    v_scale: float = 1.0
    moe_num_experts: int = 8
    moe_top_k: int = 2
    moe_ffn_dim: int = 32

    def __post_init__(self):
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        for name in (
            "vocab_size", "d_model", "num_heads", "num_kv_heads", "head_dim",
            "mamba_num_heads", "mamba_head_dim", "mamba_d_state", "mamba_n_groups",
            "moe_num_experts", "moe_top_k", "moe_ffn_dim",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"TinyHybridConfig.{name} must be a positive int, got {v!r}")
        if not self.layer_types:
            raise ValueError("TinyHybridConfig.layer_types must name at least one layer")
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(
                f"TinyHybridConfig.layer_types entries must be one of {LAYER_TYPES}, got {bad[0]!r}"
            )
        if self.moe_top_k > self.moe_num_experts:
            raise ValueError(
                f"moe_top_k={self.moe_top_k} must be <= moe_num_experts={self.moe_num_experts}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.mamba_num_heads % self.mamba_n_groups:
            raise ValueError(
                f"mamba_num_heads={self.mamba_num_heads} must be a multiple of "
                f"mamba_n_groups={self.mamba_n_groups}"
            )
        if not isinstance(self.conv_width, int) or self.conv_width < 2:
            raise ValueError(f"conv_width must be an int >= 2, got {self.conv_width!r}")
        if not isinstance(self.kv_group, int) or self.kv_group < 0:
            raise ValueError(f"kv_group must be a non-negative int, got {self.kv_group!r}")
        for name in ("k_scale", "v_scale", "rms_eps", "rope_theta"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"TinyHybridConfig.{name} must be a positive number, got {v!r}")

    @property
    def num_attn_layers(self) -> int:
        return sum(t == "attn" for t in self.layer_types)

    @property
    def num_mamba_layers(self) -> int:
        return sum(t == "mamba" for t in self.layer_types)

    @property
    def num_moe_layers(self) -> int:
        return sum(t == "moe" for t in self.layer_types)

    @property
    def d_inner(self) -> int:
        """SSM width: ``mamba_num_heads * mamba_head_dim``."""
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv (x, B and C): ``d_inner + 2 * n_groups * d_state``."""
        return self.d_inner + 2 * self.mamba_n_groups * self.mamba_d_state

    @property
    def in_proj_dim(self) -> int:
        """``in_proj`` output: ``[z (d_inner), xBC (conv_dim), dt (mamba_num_heads)]``."""
        return self.d_inner + self.conv_dim + self.mamba_num_heads
