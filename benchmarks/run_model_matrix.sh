#!/usr/bin/env bash
# Issue 24's matrix: the hybrids' decode rows, their prefill rows (profiled), their transformers
# peers, DeepSeek with its transformers peer, the short-table baseline, the host-overlap rows and a
# probe of one launch with the sampler's filtering branch (its conditional must run inside the
# step's CUDA graph: no host-side conditional in the probe's events). Run from the repository root:
#
#     KVJAX_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/run_model_matrix.sh OUTDIR [PART ...]
#
# (KVJAX_COMMIT names the code in every row: expand it where the commit was made; a copy of the
# working tree sent to another machine may carry a stale HEAD, as on 2026-11-28; each run also
# records `source_sha`, a hash of the library source it ran).
#
# Every part is too much for one 10-minute device call: name the parts of each call (default:
# all). Each part has its own time limit, so one that fails leaves the others' JSON; join the
# parts' model-*.json with benchmarks/merge_model_runs.py (--prefill-from model-hybrids-prefill.json
# --baseline model-granite-mml1k.json).
set -u
out=${1:-model-matrix}
shift
parts=${*:-probe-sampling overlap hybrids hybrids-prefill hybrids-peers deepseek granite-mml1k long-hybrids long-deepseek}
# (deepseek-kvjax, deepseek-prefill8k and probe-dispatch, not in the default: DeepSeek's kvjax rows
# without their transformers peers, its 8k prefill, profiled, and probe_launch.py --dispatch.
# long-hybrids and long-deepseek are the cells whose runner is larger: 16k at batch 64 (profiled),
# 4k at batch 256 (16k at batch 256 does not run: the hybrids' KV pool passes the GPU kernels' int32
# offsets, DeepSeek's latent cache would be 131 GB); join them as plain parts.)
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python3}
B=benchmarks/bench_model.py
s=$SECONDS
part() {  # part NAME TIMEOUT COMMAND... (only the parts named on the command line)
  local name=$1 limit=$2
  shift 2
  case " $parts " in *" $name "*) ;; *) return 0 ;; esac
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
part hybrids-prefill 200 $PY $B --gpu-run "$out/hybrids-prefill" --preset granite-4.0-h-micro \
  --preset nemotron-h-8b --decode 1024:1 --prefill 2048,8192 --no-peers --profile-prefill --profile-batch 1 \
  --max-model-len 32768 --budget-s 190
part hybrids-peers 150 $PY $B --gpu-run "$out/hybrids-peers" --preset granite-4.0-h-micro --preset nemotron-h-8b \
  --decode 1024:1,16,64,256 --prefill 2048 --peers-only --budget-s 140
part deepseek 230 $PY $B --gpu-run "$out/deepseek" --preset deepseek-v2-lite --decode 1024:1,16,64,256 \
  --decode 4096:1,16,64 --prefill 2048 --max-model-len 32768 --profile-batch 1 --budget-s 220
part deepseek-kvjax 130 $PY $B --gpu-run "$out/deepseek-kvjax" --preset deepseek-v2-lite --decode 1024:1,16,64,256 \
  --decode 4096:1,16,64 --prefill 2048 --max-model-len 32768 --profile-batch 1 --no-peers --budget-s 120
part deepseek-prefill8k 100 $PY $B --gpu-run "$out/deepseek-prefill8k" --preset deepseek-v2-lite --decode '' \
  --prefill 8192 --max-model-len 32768 --profile-prefill --no-peers --budget-s 90
part granite-mml1k 90 $PY $B --gpu-run "$out/granite-mml1k" --preset granite-4.0-h-micro \
  --decode 1024:1,16,64,256 --prefill '' --no-peers --budget-s 80
part long-hybrids 200 $PY $B --gpu-run "$out/long-hybrids" --preset granite-4.0-h-micro --preset nemotron-h-8b \
  --decode 16384:64 --decode 4096:256 --prefill '' --max-model-len 32768 --profile-batch 64 --no-peers --budget-s 190
part long-deepseek 180 $PY $B --gpu-run "$out/long-deepseek" --preset deepseek-v2-lite \
  --decode 16384:1,16,64 --decode 4096:256 --prefill '' --max-model-len 32768 --profile-batch 64 --no-peers --budget-s 170
# where a launch's host time goes (argument handling against the graph's launch), Granite b1 / b64
part probe-dispatch 120 $PY benchmarks/probe_launch.py --preset granite-4.0-h-micro --batch 1,64 --dispatch \
  --variants runner --out "$out/probe-dispatch"
for p in hybrids hybrids-prefill hybrids-peers deepseek deepseek-kvjax deepseek-prefill8k granite-mml1k \
    long-hybrids long-deepseek; do
  [ -f "$out/$p/model.json" ] && cp "$out/$p/model.json" "$out/model-$p.json"
  rm -rf "$out/$p"
done
