#!/usr/bin/env bash
# The runner's decode step on the GPU, one command (run from the repository root):
#
#     bash benchmarks/run_step.sh OUTDIR
#
# OUTDIR receives runner.json / .log (bench_runner.py --device-steps: host-synchronised
# step), profile_step*.json / .log (profile_gpu.py --step: kernels, memcpys, device time and
# its model / runner split, pipelined step, enqueue time) under XLA's default flags, with
# command buffers extended to whole steps (CB_FLAGS) and with the former fixed 128-token
# Mamba chunks, and demo_*.json / .log (python -m kvjax demo --quiet) under both flag sets.
set -u
out=${1:-gpu-step}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python3}
CB_FLAGS=${CB_FLAGS:-"--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"}
s=$SECONDS
step() {  # step NAME TIMEOUT COMMAND...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "$name exit code $? ($((SECONDS - s)) s)" | tee -a "$out/env.log"
}
date -u > "$out/env.log"
echo "CB_FLAGS=$CB_FLAGS" >> "$out/env.log"
step demo_default 90 $PY -m kvjax demo --quiet --json "$out/demo_default.json"
XLA_FLAGS="$CB_FLAGS" step demo_cmdbuf 90 $PY -m kvjax demo --quiet --json "$out/demo_cmdbuf.json"
step profile_step 110 $PY benchmarks/profile_gpu.py --step --tag default --json "$out/profile_step.json"
XLA_FLAGS="$CB_FLAGS" step profile_step_cmdbuf 110 $PY benchmarks/profile_gpu.py --step --tag cmdbuf \
  --json "$out/profile_step_cmdbuf.json"
step profile_step_chunk128 90 $PY benchmarks/profile_gpu.py --step --no-adapt-chunk --tag chunk128 \
  --json "$out/profile_step_chunk128.json"
step runner 150 $PY benchmarks/bench_runner.py --device-steps --json "$out/runner.json"
