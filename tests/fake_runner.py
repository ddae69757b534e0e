"""What the demo's parity check (``kvjax.cli.demo.check_against_reference``) reads from a
Runner, without one: its model, config, unsharded params, their one device copy and the dense
reference over that copy (as ``Runner.dense_device_params`` and ``Runner.dense_reference``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from kvjax.runner import RunnerConfig


@dataclasses.dataclass(eq=False)
class FakeRunner:
    model: Any
    dense_params: Any
    config: RunnerConfig

    def __post_init__(self):
        self.dense_device_params = jax.device_put(self.dense_params)
        fn = jax.jit(lambda p, toks: self.model.dense_logits(p, toks, kv_cache_dtype=self.config.kv_cache_dtype))

        def reference(tokens):
            with jax.default_matmul_precision(self.config.matmul_precision):
                return fn(self.dense_device_params, tokens)

        self.dense_reference = reference
