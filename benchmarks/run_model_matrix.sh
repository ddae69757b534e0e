#!/usr/bin/env bash
# Issue 24's decode matrix, the short-table baseline, DeepSeek with its transformers peer, the
# host-overlap rows and a probe of one launch with the sampler's filtering branch (its conditional
# must run inside the step's CUDA graph: no host-side conditional in the probe's events), in one
# device call (run from the repository root):
#
#     KVJAX_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/run_model_matrix.sh OUTDIR
#
# Each part has its own time limit, so one that fails leaves the others' JSON. The hybrids'
# prefill rows and their transformers rows are not re-run here (merge them from an earlier part:
# benchmarks/merge_model_runs.py).
set -u
out=${1:-model-matrix}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python3}
B=benchmarks/bench_model.py
s=$SECONDS
part() {  # part NAME TIMEOUT COMMAND...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "$name exit code $? ($((SECONDS - s)) s)" | tee -a "$out/parts.log"
}
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/parts.log" 2>&1
part probe-sampling 75 $PY benchmarks/probe_launch.py --preset granite-4.0-h-micro --batch 1 --sampling \
  --variants runner --out "$out/probe-sampling"
part overlap 150 $PY benchmarks/bench_overlap.py --preset granite-4.0-h-micro --requests 16,64 --steps 30 \
  --budget-s 120 --json "$out/overlap-granite.json"
part hybrids 200 $PY $B --gpu-run "$out/hybrids" --preset granite-4.0-h-micro --preset nemotron-h-8b \
  --decode 1024:1,16,64,256 --decode 4096:1,16,64 --decode 16384:1,16 --prefill '' --no-peers \
  --max-model-len 32768 --profile-batch 1 --budget-s 190
part deepseek 230 $PY $B --gpu-run "$out/deepseek" --preset deepseek-v2-lite --decode 1024:1,16,64,256 \
  --decode 4096:1,16,64 --prefill 2048 --max-model-len 32768 --profile-batch 1 --budget-s 220
part granite-mml1k 90 $PY $B --gpu-run "$out/granite-mml1k" --preset granite-4.0-h-micro \
  --decode 1024:1,16,64,256 --prefill '' --no-peers --budget-s 80
for p in hybrids deepseek granite-mml1k; do
  [ -f "$out/$p/model.json" ] && cp "$out/$p/model.json" "$out/model-$p.json"
  rm -rf "$out/$p"
done
