import os

# Tests run on the CPU; the GPU checks live in benchmarks/.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
