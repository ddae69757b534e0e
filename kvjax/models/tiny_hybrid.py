"""The tiny hybrid model: embedding -> attention / Mamba2 layers -> final norm -> lm head.

Byte-level (256 tokens), float32, random weights from a fixed seed (nothing is
downloaded). One :func:`forward_step` runs a whole mixed step — prefill chunks
and decode rows of a :class:`~kvjax.state.StepBatch` — against the paged KV
caches and the recurrent-state pools, and returns the logits rows and the
updated caches. :func:`kvjax.models.dense_forward` is its oracle.

Typical use::

    params = init_params(config, seed=0)
    caches = init_caches(config, num_blocks, block_size, num_state_slots)
    step = jax.jit(forward_step, static_argnames=("config", "backend"),
                   donate_argnames=("caches",))
    logits, caches = step(params, config, batch, caches, state_indices)
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from pallas_kernels import contract as validation
from kvjax.models.attention import AttentionLayer, _dense_init, rms_norm
from kvjax.models.caches import HybridCaches, kv_storage_dtype
from kvjax.models.config import TinyHybridConfig
from kvjax.models.dense import dense_forward
from kvjax.models.interface import DATA, MODEL, CacheSizes, PoolSpec
from kvjax.models.mamba_layer import MambaLayer
from kvjax.models.moe import MoELayer
from kvjax.models.step_context import StepContext, make_step_context
from kvjax.state.step_batch import StepBatch


class TinyHybrid(nn.Module):
    """The model as a linen module; params ``embed``, ``layer_{i}``, ``final_norm``, ``lm_head``.

    ``expert_axis``: mesh axis the MoE experts are sharded over (inside ``shard_map``;
    see :mod:`kvjax.models.moe`), ``None`` for unsharded experts. ``model_axis``: mesh
    axis the attention and Mamba heads are sharded over (``config`` then gives one
    shard's heads; see :func:`kvjax.runner.mesh.tp_shard_config`).
    """

    config: TinyHybridConfig
    expert_axis: str | None = None
    model_axis: str | None = None

    def setup(self):
        c = self.config

        def make(kind, name):
            if kind == "moe":
                return MoELayer(c, self.expert_axis, name=name)
            return (AttentionLayer if kind == "attn" else MambaLayer)(c, self.model_axis, name=name)

        self.embed = self.param("embed", nn.initializers.normal(1.0), (c.vocab_size, c.d_model))
        self.layers = tuple(make(t, f"layer_{i}") for i, t in enumerate(c.layer_types))
        self.final_norm = self.param("final_norm", nn.initializers.ones, (c.d_model,))
        self.lm_head = self.param("lm_head", _dense_init, (c.d_model, c.vocab_size))

    def declare(self):
        """Creates every param (``init`` entry point; runs no forward)."""
        for layer in self.layers:
            layer.declare()

    def __call__(
        self,
        input_ids: jax.Array,  # int32 [T]
        logits_indices: jax.Array,  # int32 [L]
        ctx: StepContext,
        caches: HybridCaches,
        backend: str,
    ) -> tuple[jax.Array, HybridCaches]:
        c = self.config
        x = jnp.take(self.embed, input_ids, axis=0, mode="clip")  # ids validated upstream
        keys, values = list(caches.key), list(caches.value)
        convs, ssms = list(caches.conv_state), list(caches.ssm_state)
        ia = im = 0
        for layer, kind in zip(self.layers, c.layer_types):
            if kind == "attn":
                rpa = caches.kv_layout == "rpa"
                x, keys[ia], v = layer(
                    x, ctx, keys[ia], None if rpa else values[ia], caches.kv_cache_dtype,
                    backend, kv_layout=caches.kv_layout,
                )
                if not rpa:
                    values[ia] = v
                ia += 1
            elif kind == "moe":
                x = layer(x, ctx.token_real, backend)
            else:
                x, convs[im], ssms[im] = layer(x, ctx, convs[im], ssms[im], backend)
                im += 1
        h = rms_norm(x[logits_indices], self.final_norm, c.rms_eps)
        logits = h @ self.lm_head
        new = caches.replace(
            key=tuple(keys), value=tuple(values), conv_state=tuple(convs), ssm_state=tuple(ssms)
        )
        return logits, new


def init_params(config: TinyHybridConfig, seed: int = 0) -> dict:
    """Random float32 params from ``seed`` (deterministic): ``{"params": {...}}``.

    Shapes (``d = d_model``, ``V = vocab_size``): ``embed [V, d]``,
    ``final_norm [d]``, ``lm_head [d, V]``, and per layer ``layer_{i}`` the
    params listed in :class:`AttentionLayer` / :class:`MambaLayer`.
    """
    if not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    return _init_fn(config)(jax.random.key(seed))


@functools.cache
def _init_fn(config: TinyHybridConfig):
    """The jitted init for ``config``.

    One program instead of ~30 eagerly compiled RNG ops; it is a handful of random
    draws run once, so XLA's backend optimisation is off (about half the start-up time).
    """
    model = TinyHybrid(config)
    return jax.jit(
        lambda key: model.init(key, method=TinyHybrid.declare),
        compiler_options={"xla_backend_optimization_level": 0},
    )


def forward_step(
    params: dict,
    config: TinyHybridConfig,
    batch: StepBatch,
    caches: HybridCaches,
    state_indices: jax.Array,
    num_accepted_tokens: jax.Array | None = None,
    *,
    backend: str = "reference",
    expert_axis: str | None = None,
    model_axis: str | None = None,
) -> tuple[jax.Array, HybridCaches]:
    """One model step over a padded mixed batch. Pure; jit with static ``config``/``backend``.

    Args:
      params: from :func:`init_params`.
      config: static.
      batch: ``T`` tokens, ``R`` rows, ``L`` logits rows (from ``build_step_batch``);
        attention uses ``block_tables[config.kv_group]`` / ``slot_mappings[config.kv_group]``.
      caches: from :func:`init_caches` (donate them at the ``jit``).
      state_indices: int32 ``[R]``: each batch row's recurrent-state slot (all Mamba
        layers share it), ``NULL_BLOCK_ID`` for padded rows; or, for speculative
        decoding, ``[R, 1 + k]`` per-token destination slots (prefill chunks use
        column 0). Padded rows are forced to ``NULL_BLOCK_ID`` whatever is passed.
      num_accepted_tokens: int32 ``[R]``, required with 2-D ``state_indices``:
        tokens accepted in the row's previous step (>= 1); the initial SSM state is
        column ``num_accepted_tokens - 1`` and the conv window is read at that offset.
      backend: kernel backend (``"reference"``, ``"auto"``, ``"pallas"``, ...).
      expert_axis: inside ``shard_map``, the mesh axis the MoE experts are sharded
        over (``params`` then hold this member's experts); ``None`` otherwise.
      model_axis: inside ``shard_map``, the mesh axis the heads are sharded over
        (``config``, ``params`` and ``caches`` are then one shard's); ``None`` otherwise.

    Returns:
      ``(logits float32 [L, vocab_size], caches)``: logits of the tokens at
      ``batch.logits_indices`` (rows past ``batch.num_logits`` are finite but
      meaningless), and the caches with this step's K/V and recurrent states written.
      Pad tokens and padded rows write no KV and no state and do not affect real rows.
    """
    if not isinstance(caches, HybridCaches):
        raise ValueError(f"caches must be a HybridCaches (see init_caches), got {type(caches)}")
    na, nm = config.num_attn_layers, config.num_mamba_layers
    if (len(caches.key), len(caches.conv_state)) != (na, nm):
        raise ValueError(
            f"caches hold {len(caches.key)} attention and {len(caches.conv_state)} Mamba "
            f"layers, the config has {na} and {nm}"
        )
    validation.check_shape("batch.input_ids", batch.input_ids, (batch.num_tokens_padded,))
    ctx = make_step_context(batch, state_indices, num_accepted_tokens, config.kv_group)
    if ctx.is_speculative and nm:
        k = ctx.state_indices.shape[1] - 1
        have = caches.conv_state[0].shape[2] - (config.conv_width - 1)
        if have < k:
            raise ValueError(
                f"state_indices has 1 + {k} columns but the conv states were sized for "
                f"num_spec_tokens={have} (init_caches(..., num_spec_tokens={k}))"
            )
    return TinyHybrid(config, expert_axis, model_axis).apply(
        params, batch.input_ids, batch.logits_indices, ctx, caches, backend
    )


_EXPERT_PARAMS = ("w_gate", "w_up", "w_down")
# PartitionSpecs of each layer kind's params (absent: replicated).
_LAYER_PARAM_SPECS = {
    "attn": {"wq": P(None, MODEL), "wk": P(None, MODEL), "wv": P(None, MODEL), "wo": P(MODEL, None)},
    "mamba": {"in_proj": P(None, MODEL), "conv_weight": P(MODEL, None), "conv_bias": P(MODEL),
              "dt_bias": P(MODEL), "A_log": P(MODEL), "D": P(MODEL), "gate_norm": P(MODEL),
              "out_proj": P(MODEL, None)},
    "moe": {name: P(DATA) for name in _EXPERT_PARAMS},
}


@dataclasses.dataclass(frozen=True)
class TinyHybridModel:
    """The tiny hybrid as a :class:`~kvjax.models.interface.Model` (hashable).

    Pools, in layer order: per attention layer ``key[i]`` and ``value[i]`` (``kv_layout="flash"``)
    or ``kv_pages[i]`` (``"rpa"``), per Mamba layer ``conv_state[i]`` and ``ssm_state[i]``
    (:class:`~kvjax.models.caches.HybridCaches` is the model's own view of them).

    Tensor parallelism (:meth:`shard`): attention KV heads (with their query heads) and Mamba
    heads are split over "model"; ``wq/wk/wv`` and the Mamba ``in_proj`` are column shards,
    ``wo`` / ``out_proj`` row shards summed over the axis. The Mamba ``in_proj`` / conv params
    are laid out per shard (:meth:`layout_for_shards`: ``[z | x | B | C | dt]`` of the shard's
    heads, B and C repeated in every shard), and so are the conv states. MoE experts are split
    over "data".
    """

    config: TinyHybridConfig = TinyHybridConfig()

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def kv_groups(self) -> tuple[int, ...]:
        return (self.config.kv_group,) if self.config.num_attn_layers else ()

    @property
    def uses_state(self) -> bool:
        return self.config.num_mamba_layers > 0

    @property
    def description(self) -> str:
        c = self.config
        return f"the tiny hybrid model ({len(c.layer_types)} layers: {', '.join(c.layer_types)})"

    def pool_specs(self, sizes: CacheSizes) -> tuple[PoolSpec, ...]:
        c = self.config
        rpa = sizes.kv_layout == "rpa"
        kv_dtype = np.dtype(kv_storage_dtype(sizes.kv_cache_dtype)).name
        kv_shape = (sizes.num_kernel_blocks, sizes.kernel_block_size, c.num_kv_heads * (2 if rpa else 1),
                    c.head_dim)
        kv_axes = (None, None, MODEL, None)
        conv = (sizes.num_state_slots, c.conv_dim, c.conv_width - 1 + sizes.num_spec_tokens)
        ssm = (sizes.num_state_slots, c.mamba_num_heads, c.mamba_head_dim, c.mamba_d_state)
        specs = []
        ia = im = 0
        for kind in c.layer_types:
            if kind == "attn":
                names = ("kv_pages",) if rpa else ("key", "value")
                specs += [PoolSpec(f"{n}[{ia}]", "kv", kv_shape, kv_dtype, kv_axes, c.kv_group) for n in names]
                ia += 1
            elif kind == "mamba":
                specs.append(PoolSpec(f"conv_state[{im}]", "state", conv, "float32", (None, MODEL, None)))
                specs.append(PoolSpec(f"ssm_state[{im}]", "state", ssm, "float32", (None, MODEL, None, None)))
                im += 1
        return tuple(specs)

    def init_params(self, seed: int = 0):
        return init_params(self.config, seed)

    def param_partitioning(self, params):
        def spec(path, leaf):
            keys = [getattr(k, "key", None) for k in path]
            layer = next((k for k in keys if isinstance(k, str) and k.startswith("layer_")), None)
            if layer is None:
                return P()
            kind = self.config.layer_types[int(layer.split("_")[1])]
            return _LAYER_PARAM_SPECS[kind].get(keys[-1], P())

        return jax.tree_util.tree_map_with_path(spec, params)

    def check_mesh(self, data: int, model: int) -> None:
        """ValueError unless this model can be split ``data`` x ``model`` ways."""
        c = self.config
        if "moe" in c.layer_types and c.moe_num_experts % data:
            raise ValueError(f"moe_num_experts={c.moe_num_experts} must be a multiple of the data axis "
                             f"size {data} (experts are sharded over 'data')")
        self.shard(model)

    def shard(self, model_size: int) -> "TinyHybridModel":
        M = model_size
        c = self.config
        if M == 1:
            return self
        if c.num_kv_heads % M or c.mamba_num_heads % M:
            raise ValueError(
                f"model={M} must divide num_kv_heads={c.num_kv_heads} and "
                f"mamba_num_heads={c.mamba_num_heads} (heads are sharded over 'model')"
            )
        if c.num_mamba_layers and c.mamba_n_groups != 1:
            raise ValueError(f"tensor parallelism needs mamba_n_groups == 1, got {c.mamba_n_groups}")
        return TinyHybridModel(dataclasses.replace(
            c, num_heads=c.num_heads // M, num_kv_heads=c.num_kv_heads // M, mamba_num_heads=c.mamba_num_heads // M))

    def layout_for_shards(self, params, model_size: int):
        M = model_size
        if M == 1:
            return params
        c = self.config
        di, H, bc = c.d_inner, c.mamba_num_heads, 2 * c.mamba_n_groups * c.mamba_d_state
        dl, Hl = di // M, H // M
        out = jax.tree.map(np.asarray, params)
        for i, kind in enumerate(c.layer_types):
            if kind != "mamba":
                continue
            lp = dict(out["params"][f"layer_{i}"])
            ip = lp["in_proj"]
            z, x, b_c, dt = ip[:, :di], ip[:, di:2 * di], ip[:, 2 * di:2 * di + bc], ip[:, 2 * di + bc:]
            lp["in_proj"] = np.concatenate([np.concatenate(
                [z[:, m * dl:(m + 1) * dl], x[:, m * dl:(m + 1) * dl], b_c, dt[:, m * Hl:(m + 1) * Hl]], 1)
                for m in range(M)], 1)
            for name in ("conv_weight", "conv_bias"):
                w = lp[name]
                lp[name] = np.concatenate([np.concatenate([w[m * dl:(m + 1) * dl], w[di:]], 0)
                                           for m in range(M)], 0)
            out["params"][f"layer_{i}"] = lp
        return out

    def apply(self, params, ctx: StepContext, pools: dict, *, backend: str, sizes: CacheSizes,
              expert_axis: str | None = None, model_axis: str | None = None):
        c = self.config
        rpa = sizes.kv_layout == "rpa"
        na, nm = c.num_attn_layers, c.num_mamba_layers
        caches = HybridCaches(
            key=tuple(pools[f"{'kv_pages' if rpa else 'key'}[{i}]"] for i in range(na)),
            value=() if rpa else tuple(pools[f"value[{i}]"] for i in range(na)),
            conv_state=tuple(pools[f"conv_state[{i}]"] for i in range(nm)),
            ssm_state=tuple(pools[f"ssm_state[{i}]"] for i in range(nm)),
            kv_cache_dtype=sizes.kv_cache_dtype, kv_layout=sizes.kv_layout,
        )
        logits, caches = TinyHybrid(c, expert_axis, model_axis).apply(
            params, ctx.input_ids, ctx.logits_indices, ctx, caches, backend)
        out = {}
        for i in range(na):
            if rpa:
                out[f"kv_pages[{i}]"] = caches.key[i]
            else:
                out[f"key[{i}]"], out[f"value[{i}]"] = caches.key[i], caches.value[i]
        for i in range(nm):
            out[f"conv_state[{i}]"], out[f"ssm_state[{i}]"] = caches.conv_state[i], caches.ssm_state[i]
        return logits, out

    def dense_logits(self, params, tokens, *, kv_cache_dtype: str = "auto"):
        return dense_forward(params, self.config, tokens, kv_cache_dtype)

    def step_temp_bytes(self, num_tokens: int, table_tokens: int, sizes: CacheSizes) -> int:
        """Temporaries of a step of ``num_tokens`` tokens whose rows address ``table_tokens`` keys:
        the jnp paged attention gathers, per token, every addressable key as float32 (K and V,
        one masked copy each) and holds scores and probabilities ``[T, Hq, S]``; with the rpa
        layout the XLA path of JAX's ragged paged attention (off the TPU) first gathers each
        token's pages whole, K and V interleaved, in the storage dtype. XLA:CPU's
        memory_analysis() of the compiled step agrees within 15% (tests/runner/test_memory.py)."""
        c, T, S = self.config, num_tokens, table_tokens
        if not c.num_attn_layers:
            return 0
        out = (2 * T * S * c.num_kv_heads * c.head_dim + 3 * T * c.num_heads * S) * 4
        if sizes.kv_layout == "rpa":
            per_token = 2 * c.num_kv_heads * c.head_dim * np.dtype(kv_storage_dtype(sizes.kv_cache_dtype)).itemsize
            out += T * S * per_token
        return out

    def dense_temp_bytes(self, n: int) -> int:
        """Temporaries of :meth:`dense_logits` on ``n`` tokens: scores and probabilities
        ``[H, n, n]`` float32 and the ``[n, n]`` causal mask (an upper bound)."""
        c = self.config
        return n * n * (2 * 4 * c.num_heads + 1) if c.num_attn_layers else 0
