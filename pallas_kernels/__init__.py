"""Pallas kernels for the KV cache and recurrent state, each with a jnp reference."""
