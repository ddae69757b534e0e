"""Where do fp8 K/V differ on the GPU? Model-sized shapes through every path (debug aid)."""
import ml_dtypes
import jax, jax.numpy as jnp, numpy as np
from pallas_kernels.kv_write import reshape_and_cache_flash
from kvjax.models.dense import _fp8_round_trip

rng = np.random.default_rng(0)
T, H, D, NB, BS = 37, 2, 16, 16, 8
key = (rng.standard_normal((T, H, D)) * 3).astype(np.float32)
slots = rng.permutation(NB * BS)[:T].astype(np.int32)
want = np.clip(key, -448, 448).astype(ml_dtypes.float8_e4m3fn)
cache = jnp.zeros((NB, BS, H, D), jnp.float8_e4m3fn)
for backend in ("pallas_gpu", "reference"):
    for scale in (jnp.float32(1.0), np.float32(1.0), jnp.ones((1,), jnp.float32), jnp.ones((H,), jnp.float32)):
        kc, _ = reshape_and_cache_flash(key, key, cache, cache, slots, "fp8", scale, scale, backend=backend)
        got = np.asarray(kc).reshape(NB * BS, H, D)[slots]
        bad = (got.view(np.uint8) != want.view(np.uint8))
        print(backend, getattr(scale, "shape", ()), "mismatching bytes:", int(bad.sum()), "of", bad.size)
rt = np.asarray(jax.jit(lambda k: _fp8_round_trip(k, 1.0))(key))
print("dense round trip mismatches:", int((rt != want.astype(np.float32)).sum()))
# model-style call under jit with donation
f = jax.jit(lambda k, c, s: reshape_and_cache_flash(k, k, c, c, s, "fp8", jnp.float32(1.0), jnp.float32(1.0), backend="auto"))
kc, _ = f(key, cache, slots)
got = np.asarray(kc).reshape(NB * BS, H, D)[slots]
print("auto under jit mismatching bytes:", int((got.view(np.uint8) != want.view(np.uint8)).sum()))
