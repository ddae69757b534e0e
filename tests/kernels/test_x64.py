"""Every KV write flavour traces and writes the same bytes under ``jax_enable_x64``.

With x64 on, a Python int meeting an int32 array in ``lax`` (``lax.rem(slots, page_size)``)
is an int64: ``write_kv_pages(backend="pallas_tpu")`` failed to trace, even with int32
slots (issue 25, item 3). Each op runs once per flavour (the TPU and GPU kernels in
interpret mode, tiny shapes) with int32 slots and, under ``jit``, traced int64 slots; the
caches must equal those written with x64 off.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import pallas_kernels as pk

F32 = np.float32
BACKENDS = ("reference", "pallas_tpu", "pallas_gpu")


def _cases():
    rng = np.random.default_rng(0)
    k, v = rng.standard_normal((2, 3, 2, 4)).astype(F32)
    kv_c, k_pe = rng.standard_normal((3, 4)).astype(F32), rng.standard_normal((3, 2)).astype(F32)
    # Token 1 is PAD; tokens 0 and 2 land in consecutive slots of one page (a TPU token run).
    slots = np.array([5, -1, 6], np.int32)
    return {
        "reshape_and_cache_flash": (
            lambda sm, **kw: pk.reshape_and_cache_flash(
                k, v, np.zeros((3, 4, 2, 4), F32), np.zeros((3, 4, 2, 4), F32), sm, **kw),
            slots),
        "concat_and_cache_mla": (
            lambda sm, **kw: pk.concat_and_cache_mla(kv_c, k_pe, np.zeros((3, 4, 6), F32), sm, **kw),
            slots),
        "write_kv_pages": (
            lambda sm, **kw: pk.write_kv_pages(k, v, np.zeros((3, 4, 4, 4), F32), sm, **kw),
            slots),
        "zero_blocks": (
            lambda ids, **kw: pk.zero_blocks([np.ones((3, 4, 2), F32)], ids, **kw),
            np.array([2, -1], np.int32)),
    }


CASES = _cases()


def _bytes(out):
    return [np.asarray(a).tobytes() for a in jax.tree.leaves(out)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", sorted(CASES))
def test_write_flavours_trace_under_x64(op, backend):
    fn, ids = CASES[op]
    want = _bytes(fn(ids, backend=backend))  # x64 off
    with jax.enable_x64(True):
        got32 = _bytes(fn(ids, backend=backend))
        got64 = _bytes(jax.jit(lambda i: fn(i, backend=backend))(ids.astype(np.int64)))
    assert got32 == want, (op, backend, "int32 ids")
    assert got64 == want, (op, backend, "traced int64 ids")
