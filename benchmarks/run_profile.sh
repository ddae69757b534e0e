#!/usr/bin/env bash
# The GPU profile of kvjax (benchmarks/profile_gpu.py) under XLA's default flags and with
# XLA command buffers (CUDA graphs) extended to custom calls, while loops and conditionals:
#
#     bash benchmarks/run_profile.sh OUTDIR
#
# OUTDIR receives env.log, profile_<tag>.json / .log per flag set and hlo/ (optimised HLO of
# every case). PROFILE_ARGS overrides the cases (default: --kv --step).
set -u
out=${1:-gpu-profile}
mkdir -p "$out/hlo"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python3}
CB_FLAGS=${CB_FLAGS:-"--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"}
args=${PROFILE_ARGS:-"--kv --step"}
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv
  $PY -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
  echo "command-buffer flags: $CB_FLAGS"
  XLA_FLAGS="$CB_FLAGS" $PY -c "import jax; print('flags accepted:', jax.jit(lambda x: x + 1)(1))"
  echo "flags probe exit code: $?"
} > "$out/env.log" 2>&1
cat "$out/env.log"
timeout ${T_DEFAULT:-200} $PY benchmarks/profile_gpu.py $args --tag default --json "$out/profile_default.json" \
  --hlo-dir "$out/hlo" > "$out/profile_default.log" 2>&1
echo "default exit code: $?" | tee -a "$out/env.log"
XLA_FLAGS="$CB_FLAGS" timeout ${T_CB:-200} $PY benchmarks/profile_gpu.py $args --tag cmdbuf \
  --json "$out/profile_cmdbuf.json" --hlo-dir "$out/hlo" > "$out/profile_cmdbuf.log" 2>&1
echo "cmdbuf exit code: $?" | tee -a "$out/env.log"
