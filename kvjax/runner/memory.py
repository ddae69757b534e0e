"""Memory a runner configuration needs, estimated before anything is compiled.

:func:`estimate_memory` adds up the persistent device state (the model's KV and
state pools from its :class:`~kvjax.models.interface.PoolSpec`, request rows and
block tables: exact sizes, no allocation), the temporaries of the largest bucket's
step and of the dense reference used for the parity check, as the model states
them (``step_temp_bytes`` / ``dense_temp_bytes``, optional: 0 when absent). :func:`check_fits` compares the total with
:func:`available_memory` and raises :class:`InsufficientMemoryError` naming the
flag to lower.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np

from kvjax.runner.runner import RunnerConfig, output_area_words
from kvjax.state import BlockTables, RequestState

GIB = 1024**3
# Smallest padded length of a dense-reference call (fewer compiles for short requests).
MIN_DENSE_LENGTH = 16


def dense_reference_length(num_tokens: int, max_model_len: int) -> int:
    """Padded length of a dense-reference call for ``num_tokens`` tokens.

    The next power of two ``>= max(num_tokens, MIN_DENSE_LENGTH)``, at most
    ``max_model_len`` (which is always enough): the oracle is quadratic in its
    length, so it is shaped by the request, not by ``max_model_len``; powers of
    two keep the number of compiles logarithmic.
    """
    if not 0 < num_tokens <= max_model_len:
        raise ValueError(f"num_tokens must be in [1, max_model_len={max_model_len}], got {num_tokens}")
    return min(max_model_len, 1 << (max(num_tokens, MIN_DENSE_LENGTH) - 1).bit_length())


def _pool_bytes(pool) -> int:
    """Bytes of one :class:`~kvjax.models.interface.PoolSpec` (one data rank's whole pool)."""
    return int(np.prod(pool.shape)) * np.dtype(pool.dtype).itemsize


def _nbytes(tree) -> int:
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a configuration needs, by part (see the module docstring)."""

    kv_cache: int  # the model's KV pools
    states: int  # the model's recurrent-state pools
    rows_and_tables: int  # RequestState and BlockTables
    step: int  # temporaries of the largest bucket's step, plus its input and output areas
    dense_reference: int  # the parity oracle on the longest request

    #: each part and the flags that size it
    FLAGS = {
        "kv_cache": "--num-blocks / --block-size",
        "states": "--max-num-seqs / --num-spec-tokens",
        "rows_and_tables": "--max-num-seqs / --max-model-len",
        "step": "--max-model-len / --max-num-batched-tokens / --token-sizes",
        "dense_reference": "--max-model-len / the longest request",
    }

    @property
    def total(self) -> int:
        return sum(self.parts().values())

    def parts(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def largest(self) -> str:
        """The part that needs the most memory."""
        parts = self.parts()
        return max(parts, key=parts.get)

    def times(self, n: int) -> "MemoryEstimate":
        """``n`` of these in one memory (e.g. the data ranks of a CPU mesh, all in host RAM)."""
        return MemoryEstimate(**{k: v * n for k, v in self.parts().items()})

    def describe(self) -> str:
        """``total 1.23 GiB (kv_cache 0.5 GiB, ...)``."""
        inner = ", ".join(f"{k} {_gib(v)}" for k, v in self.parts().items())
        return f"{_gib(self.total)} ({inner})"


def _gib(n: int) -> str:
    """``n`` bytes in the largest unit that keeps the number >= 1 (B, KiB, MiB, GiB)."""
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def estimate_memory(config: RunnerConfig, longest_request: int | None = None) -> MemoryEstimate:
    """Estimate the memory :class:`~kvjax.runner.Runner` needs for ``config``; allocates nothing.

    Args:
      config: the runner configuration.
      longest_request: tokens (prompt + output) of the longest request checked
        against the dense reference; ``None``: ``config.max_model_len``; 0: no
        dense reference.
    """
    c, m = config, config.model
    g = c.kv_group
    pools = m.pool_specs(c.cache_sizes)
    kv_bytes = sum(_pool_bytes(p) for p in pools if p.kind == "kv")
    state_bytes = sum(_pool_bytes(p) for p in pools if p.kind == "state")
    rows = jax.eval_shape(lambda: RequestState.create(c.max_num_seqs, c.max_model_len, c.num_speculative_tokens))
    tables = jax.eval_shape(lambda: BlockTables.create(c.specs, c.max_num_seqs, num_cache_blocks=c.num_blocks))

    # Step: the model's temporaries for the largest bucket, every row addressing the whole table.
    T = max(b.num_tokens for b in c.bucket_spec.buckets)
    S = g.table_width * g.kernel_block_size
    model_temp = m.step_temp_bytes(T, S, c.cache_sizes) if hasattr(m, "step_temp_bytes") else 0
    # The input area holds the new requests' token rows ([U, max_model_len]); the output area the
    # largest bucket's outputs (with return_logits, [L, vocab] float32 logits). The request rows
    # and tables are updated in place: no second copy.
    output_area = 4 * output_area_words(c, m.vocab_size)
    step = model_temp + 4 * c.max_new_requests * c.max_model_len + output_area

    # Dense reference: as the model states it (tests/runner/test_memory.py compares with XLA's
    # memory_analysis()).
    if longest_request is None:
        longest_request = c.max_model_len
    if longest_request:
        n = dense_reference_length(min(longest_request, c.max_model_len), c.max_model_len)
        dense = m.dense_temp_bytes(n) if hasattr(m, "dense_temp_bytes") else 0
    else:
        dense = 0
    return MemoryEstimate(kv_cache=kv_bytes, states=state_bytes,
                          rows_and_tables=_nbytes((rows, tables)), step=step, dense_reference=dense)


def available_memory(device: jax.Device | None = None) -> tuple[int | None, str]:
    """``(bytes, where)``: free memory of ``device`` (default: this process's first device;
    in a multi-process run the global first device may belong to another process).

    Accelerators: ``bytes_limit - bytes_in_use`` from ``memory_stats()``. CPU: the
    host's ``MemAvailable`` (``/proc/meminfo``), else ``None`` (unknown).
    """
    device = device or jax.local_devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)), f"{device.device_kind} memory"
        return None, f"{device.device_kind} memory"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available host RAM"
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "available host RAM"
    except (ValueError, OSError, AttributeError):
        return None, "host RAM"


class InsufficientMemoryError(ValueError):
    """A configuration's estimate exceeds the memory available; the message names the flag."""


#: Share of the available memory a configuration may use: the rest is left to the runtime
#: (XLA compiles, executables, Python).
USABLE_FRACTION = 0.9


def check_fits(estimate: MemoryEstimate, available: int | None, where: str = "memory") -> None:
    """Raise :class:`InsufficientMemoryError` unless ``estimate.total <= USABLE_FRACTION * available``.

    ``available=None`` (unknown) passes.
    """
    if available is None or estimate.total <= USABLE_FRACTION * available:
        return
    big = estimate.largest()
    raise InsufficientMemoryError(
        f"this configuration needs an estimated {estimate.describe()}, more than the "
        f"{_gib(available)} of {where}; the largest part, {big}, is sized by "
        f"{MemoryEstimate.FLAGS[big]}: lower one of them")
