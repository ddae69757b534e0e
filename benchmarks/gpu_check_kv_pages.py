"""GPU check of ``write_kv_pages`` (ragged-paged-attention cache layout), compiled.

Run on a machine with an NVIDIA GPU, from the repository root:

    PYTHONPATH=. python benchmarks/gpu_check_kv_pages.py

Each case runs the GPU flavour (``backend="pallas_gpu"``) and the jnp
reference on the GPU and compares the whole cache bit for bit with numpy: K of
head ``h`` at combined head ``2h``, V at ``2h + 1`` (packed rank-5 caches at
``[c // packing, c % packing]``; fp8 = saturate(x / scale) in float32, round to
nearest even, per-head scales). Caches are random with a NaN-filled null page
0. Then a donated cache must be updated in place. One PASS/FAIL line per case;
exit status 1 if any fails. ``--allow-cpu`` runs it on a CPU (interpret mode;
there the in-place case checks the buffer only). Checked that way here: 7/7;
with the expectation's K and V swapped, a case fails.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from kvjax.constants import PAD_SLOT_ID
from pallas_kernels import write_kv_pages
from _gpu_check import case, on_gpu_or_allowed, run_cases, summary  # noqa: E402

FP8 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16
BACKENDS = ("pallas_gpu", "reference")


def bits(x):
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def same_bits(a, b) -> str:
    a, b = bits(a), bits(b)
    if a.shape != b.shape:
        return f"shape {a.shape} != {b.shape}"
    diff = np.argwhere(a != b)
    if diff.size == 0:
        return ""
    i = tuple(int(k) for k in diff[0])
    return f"{len(diff)} elements differ, first at {i}: {a[i]:#x} vs {b[i]:#x}"


def np_quantize(x, scale):
    y = np.asarray(x).astype(np.float32) / np.float32(scale)
    y = np.where(y > 448.0, np.float32(448.0), y)
    y = np.where(y < -448.0, np.float32(-448.0), y)
    return y.astype(FP8)


def poisoned(rng, shape, dtype):
    if np.dtype(dtype) == np.dtype(FP8):
        c = rng.integers(0, 256, size=shape, dtype=np.uint8)
        c[0] = 0x7F
        return c.view(FP8)
    c = rng.standard_normal(shape).astype(dtype)
    c[0] = np.nan
    return c


def expected(key, value, pages, slots, scales=None):
    out = pages.copy()
    page_size, H = pages.shape[1], key.shape[1]
    packed = pages.ndim == 5
    p = pages.shape[3] if packed else 1
    for t, s in enumerate(np.asarray(slots).tolist()):
        if not 0 <= s < pages.shape[0] * page_size:
            continue
        for h in range(H):
            for c, x, sc in ((2 * h, key, None if scales is None else scales[0]),
                             (2 * h + 1, value, None if scales is None else scales[1])):
                row = x[t, h] if sc is None else np_quantize(x[t, h], sc[h])
                if packed:
                    out[s // page_size, s % page_size, c // p, c % p] = row
                else:
                    out[s // page_size, s % page_size, c] = row
    return out


def prefill_slots(rng, n, num_pages, page_size):
    """Whole-page runs of consecutive slots (a prefill chunk), pages 1.. in random order."""
    pages = rng.choice(np.arange(1, num_pages), size=-(-n // page_size), replace=False)
    return (pages[:, None] * page_size + np.arange(page_size)).reshape(-1)[:n].astype(np.int32)


def check(seed, *, T, H, D, num_pages, page_size, dtype=BF16, fp8=False, packed=False,
          slots=None, jit=False):
    rng = np.random.default_rng(seed)
    key = (rng.standard_normal((T, H, D)) * (100 if fp8 else 1)).astype(dtype)
    value = (rng.standard_normal((T, H, D)) * (100 if fp8 else 1)).astype(dtype)
    cdt = FP8 if fp8 else dtype
    p = 4 // np.dtype(cdt).itemsize
    row = (2 * H // p, p, D) if packed else (2 * H, D)
    pages = poisoned(rng, (num_pages, page_size) + row, cdt)
    if slots is None:
        slots = rng.choice(np.arange(page_size, num_pages * page_size), size=T, replace=False)
        slots = np.where(rng.random(T) < 0.25, PAD_SLOT_ID, slots).astype(np.int32)
    scales = None
    args = ()
    if fp8:
        scales = (rng.uniform(0.2, 2.0, H).astype(np.float32), rng.uniform(0.2, 2.0, H).astype(np.float32))
        args = ("fp8", scales[0], scales[1])
    want = expected(key, value, pages, slots, scales)
    problems = []
    for backend in BACKENDS:
        def call(k, v, c, s, *a, backend=backend):
            return write_kv_pages(k, v, c, s, *a, backend=backend)

        fn = jax.jit(call) if jit else call
        d = same_bits(np.asarray(fn(key, value, pages, slots, *args)), want)
        if d:
            problems.append(f"{backend}: {d}")
    return "; ".join(problems)


@case("kv_pages bf16 decode T=64 H=8 D=128 page 16, PAD mixed in")
def _():
    return check(0, T=64, H=8, D=128, num_pages=1024, page_size=16)


@case("kv_pages bf16 packed [pages, 16, 8, 2, 128] prefill runs T=512")
def _():
    rng = np.random.default_rng(1)
    return check(1, T=512, H=8, D=128, num_pages=256, page_size=16, packed=True,
                 slots=prefill_slots(rng, 512, 256, 16))


@case("kv_pages fp8 per-head scales, packed [pages, 16, 2, 4, 128], prefill T=300")
def _():
    rng = np.random.default_rng(2)
    return check(2, T=300, H=4, D=128, num_pages=256, page_size=16, fp8=True, packed=True,
                 slots=prefill_slots(rng, 300, 256, 16))


@case("kv_pages f32 H=3 D=80 (row 480 wide, not a power of two)")
def _():
    return check(3, T=37, H=3, D=80, num_pages=64, page_size=16, dtype=np.float32)


@case("kv_pages all PAD: cache bitwise unchanged (page 0 stays NaN)")
def _():
    return check(4, T=64, H=8, D=128, num_pages=64, page_size=16,
                 slots=np.full((64,), PAD_SLOT_ID, np.int32))


@case("kv_pages under jit: out-of-range slots write nothing")
def _():
    n = 64 * 16
    slots = np.asarray([n, 20, n + 5, 2**31 - 1, 33, -1, 4 * n, 40], np.int32)
    return check(5, T=8, H=8, D=128, num_pages=64, page_size=16, slots=slots, jit=True)


@case("kv_pages donated cache updated in place (same buffer, small temporaries)")
def _():
    rng = np.random.default_rng(6)
    key = rng.standard_normal((64, 8, 128)).astype(BF16)
    value = rng.standard_normal((64, 8, 128)).astype(BF16)
    pages = jnp.asarray(poisoned(rng, (4096, 16, 16, 128), BF16))  # 256 MiB
    slots = jnp.asarray(rng.choice(np.arange(16, 4096 * 16), 64, replace=False).astype(np.int32))
    fn = jax.jit(lambda k, v, c, s: write_kv_pages(k, v, c, s, backend="pallas_gpu"),
                 donate_argnums=(2,))
    compiled = fn.lower(key, value, pages, slots).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    ptr = pages.unsafe_buffer_pointer()
    out = fn(key, value, pages, slots)
    out.block_until_ready()
    if out.unsafe_buffer_pointer() != ptr:
        return "the output is not the donated buffer"
    # Generic interpret mode (a CPU run) copies refs to emulate masks: only a GPU shows this.
    if temp > (1 << 20) and jax.default_backend() != "cpu":
        return f"temporary memory {temp} B: a copy of the cache?"
    return ""


def main() -> int:
    if not on_gpu_or_allowed("write_kv_pages compiled for the GPU"):
        return 1
    run_cases()
    return summary()


if __name__ == "__main__":
    sys.exit(main())
