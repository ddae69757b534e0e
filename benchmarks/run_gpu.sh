#!/usr/bin/env bash
# Every GPU check and benchmark of kvjax in one command (run from the repository root):
#
#     bash benchmarks/run_gpu.sh OUTDIR [SECONDS] [extra bench_kernels.py arguments...]
#
# OUTDIR receives: env.log (GPU, versions, the kernel files' hashes, the checks' exit
# codes), checks.log (the gpu_check scripts of the KV write, Mamba, token combine, paged
# attention, the cuDNN attention of a fresh prefill (MLA split form, GQA mixer), the MoE
# router kernel, and the grouped-matmul / MoE tests,
# one after another in the file; they run side by side, no timing depends on them; the pytest part runs on the host's CPU, as
# tests/conftest.py sets JAX_PLATFORMS: kernels interpreted and their Triton modules lowered
# for CUDA and verified, not run on the GPU, which the model benchmarks and
# gpu_check_demo_parity.py do), runner.json / runner.log
# (bench_runner.py --device-steps; RUNNER=0 skips it) and kernels.json / kernels.log
# (bench_kernels.py).
# SECONDS (default 480) bounds the whole run: bench_kernels.py gets what is left after
# the checks (up to 300 s) and the runner (up to 130 s) and skips what would not fit (recorded
# in its JSON); with nothing left it does not run (env.log says so; no kernels.json).
set -u
out=${1:-gpu-results}
budget=${2:-480}
shift $(( $# > 2 ? 2 : $# ))
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python3}
start=$SECONDS
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  $PY -c "import jax, jaxlib, torch, triton; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'torch', torch.__version__, 'triton', triton.__version__); print(jax.devices())"
  sha256sum pallas_kernels/*.py benchmarks/*.py
} > "$out/env.log" 2>&1

timeout 170 $PY benchmarks/gpu_check_kv_write.py > "$out/check_kv_write.log" 2>&1 &
p1=$!
timeout 170 $PY benchmarks/gpu_check_mamba.py > "$out/check_mamba.log" 2>&1 &
p2=$!
timeout 170 $PY benchmarks/gpu_check_token_combine.py > "$out/check_token_combine.log" 2>&1 &
p3=$!
timeout 170 $PY benchmarks/gpu_check_paged_attention.py --out "$out" --budget-s 120 \
  > "$out/check_paged_attention.log" 2>&1 &
p4=$!
timeout 170 $PY -m pytest -q -n0 -p no:cacheprovider tests/kernels/test_grouped_matmul.py \
  tests/models/test_moe_apply.py > "$out/check_grouped_matmul.log" 2>&1 &
p5=$!
timeout 170 $PY benchmarks/gpu_check_mla_split.py > "$out/check_mla_split.log" 2>&1 &
p6=$!
timeout 170 $PY benchmarks/gpu_check_fresh_prefill.py > "$out/check_fresh_prefill.log" 2>&1 &
p7=$!
# (the router check takes ~140 s alone; beside the others it ran out of 170 s on 2026-11-29)
timeout 300 $PY benchmarks/gpu_check_moe_route.py > "$out/check_moe_route.log" 2>&1 &
p8=$!
wait $p1; r1=$?
wait $p2; r2=$?
wait $p3; r3=$?
wait $p4; r4=$?
wait $p5; r5=$?
wait $p6; r6=$?
wait $p7; r7=$?
wait $p8; r8=$?
echo "checks exit codes: kv_write=$r1 mamba=$r2 token_combine=$r3 paged_attention=$r4" \
  "grouped_matmul=$r5 mla_split=$r6 fresh_prefill=$r7 moe_route=$r8 ($((SECONDS - start)) s)" >> "$out/env.log"
for f in check_kv_write check_mamba check_token_combine check_paged_attention check_grouped_matmul \
    check_mla_split check_fresh_prefill check_moe_route; do
  echo "===== $f.log"
  cat "$out/$f.log"
done > "$out/checks.log"
rm -f "$out"/check_*.log
grep -hE "^(PASS|FAIL)|checks passed|passed" "$out/checks.log" | tail -n 80

if [ "${RUNNER:-1}" != 0 ]; then  # RUNNER=0 skips the runner benchmark
  timeout 130 $PY benchmarks/bench_runner.py --device-steps --json "$out/runner.json" > "$out/runner.log" 2>&1
  echo "runner exit code: $? ($((SECONDS - start)) s)" >> "$out/env.log"
fi

left=$(( budget - (SECONDS - start) ))
if [ "$left" -gt 0 ]; then
  timeout $(( left + 20 )) $PY benchmarks/bench_kernels.py --json "$out/kernels.json" --deadline "$left" "$@" \
    > "$out/kernels.log" 2>&1
  echo "bench_kernels exit code: $? ($((SECONDS - start)) s)" >> "$out/env.log"
else
  echo "bench_kernels not run: no time left of $budget s" >> "$out/env.log"
fi
tail -n 4 "$out/env.log"
