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

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from pallas_kernels import contract as validation
from kvjax.models.attention import AttentionLayer, _dense_init, rms_norm
from kvjax.models.caches import HybridCaches
from kvjax.models.config import TinyHybridConfig
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
                x = layer(x, ctx.token_real)
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
