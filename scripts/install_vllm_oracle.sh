#!/usr/bin/env bash
# Install vLLM 0.33.0 as a CPU-only differential-testing oracle for kvjax.
#
# What it installs, into the Python environment of $PYTHON (default: python):
#   * vllm==0.33.0 with --no-deps (its declared dependencies include a CUDA
#     torch 2.14.0, flashinfer, cutlass, ... which we never want);
#   * triton==3.8.0: the Triton that vLLM 0.33.0 is built for (vLLM pins
#     torch==2.14.0, which pins triton~=3.8.0). Its interpreter runs on a CPU
#     with numpy 2.4, so numpy is left alone;
#   * the pure-Python / small packages that the import chain of the four
#     kernels kvjax compares against pulls in (vllm.model_executor imports
#     vllm.distributed, vllm.config, transformers, openai, ...). Their version
#     ranges are read from the installed vLLM's own metadata.
# Everything is installed under a constraint file that pins torch==2.13.0
# (the CPU wheel), triton, numpy, jax, jaxlib and ml_dtypes to what is (or
# will be) installed, so nothing can drag in another torch or move numpy/jax.
#
# Run the oracle with CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 (kvjax.testing.vllm
# sets both itself). Idempotent: a second run changes nothing and says so.
set -euo pipefail

PY=${PYTHON:-python}
VLLM_VERSION=0.33.0
TRITON_VERSION=3.8.0
TORCH_VERSION=2.13.0

say() { printf '[install_vllm_oracle] %s\n' "$*"; }

pip_() { "$PY" -m pip "$@"; }

workdir=$(mktemp -d)
trap 'rm -rf "$workdir"' EXIT

pip_ list --format=freeze 2>/dev/null | sort >"$workdir/before.txt"

# 1. torch: the CPU wheel, never a CUDA one.
have_torch=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
if [[ "${have_torch%%+*}" != "$TORCH_VERSION" ]]; then
    say "torch is '${have_torch:-absent}'; installing torch==$TORCH_VERSION (CPU wheel)"
    pip_ install "torch==$TORCH_VERSION"
    have_torch=$("$PY" -c 'import torch; print(torch.__version__)')
fi
if "$PY" -c 'import sys, torch; sys.exit(0 if torch.version.cuda is None else 1)'; then
    say "torch $have_torch (CPU build): ok"
else
    say "torch $have_torch is a CUDA build; this script is for the CPU oracle only"
    exit 1
fi

# 2. The constraint file: pin what must not move.
{
    echo "torch==$TORCH_VERSION"
    echo "triton==$TRITON_VERSION"
    echo "vllm==$VLLM_VERSION"
    "$PY" - <<'EOF'
import importlib.metadata as md
for name in ("numpy", "jax", "jaxlib", "ml_dtypes"):
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        pass
EOF
} >"$workdir/constraints.txt"
say "constraints: $(tr '\n' ' ' <"$workdir/constraints.txt")"

# 3. vLLM itself and triton, without their dependencies.
say "pip install --no-deps vllm==$VLLM_VERSION triton==$TRITON_VERSION"
pip_ install --no-deps -c "$workdir/constraints.txt" \
    "vllm==$VLLM_VERSION" "triton==$TRITON_VERSION"

# 4. The light packages the kernels' import chain needs, with vLLM's own version
#    ranges (extras such as fastapi[standard] dropped: only the import is needed).
pip_ install -q -c "$workdir/constraints.txt" packaging
"$PY" - >"$workdir/light.txt" <<'EOF'
import importlib.metadata as md
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# Imported (directly or through vllm.model_executor / vllm.config /
# vllm.distributed / vllm.entrypoints) when the four kernel modules load.
NEEDED = {
    "aiohttp", "cachetools", "cbor2", "cloudpickle", "fastapi", "filelock",
    "llguidance", "msgspec", "openai", "oss-harmony", "partial-json-parser",
    "pillow", "psutil", "py-cpuinfo", "pybase64", "pydantic", "pyyaml",
    "pyzmq", "regex", "requests", "tqdm", "transformers", "typing-extensions",
    "xgrammar",
}
found = set()
for line in md.requires("vllm") or []:
    req = Requirement(line)
    name = canonicalize_name(req.name)
    if name not in NEEDED:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    found.add(name)
    print(f"{req.name}{req.specifier}")
for name in sorted(NEEDED - found):  # not declared by vLLM: any version
    print(name)
EOF
say "light packages: $(tr '\n' ' ' <"$workdir/light.txt")"
# shellcheck disable=SC2046
pip_ install -c "$workdir/constraints.txt" $(cat "$workdir/light.txt")

# 5. Check: the kernels import and one runs through the Triton interpreter.
say "checking that vLLM's kernels import and run on this CPU"
CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 "$PY" - <<'EOF'
import importlib.metadata as md
import torch
import vllm.model_executor.layers.mamba.ops.causal_conv1d  # noqa: F401
import vllm.model_executor.layers.mamba.ops.mamba_ssm  # noqa: F401
import vllm.v1.attention.ops.triton_reshape_and_cache_flash  # noqa: F401
from vllm.triton_utils import HAS_TRITON
from vllm.v1.worker.gpu.input_batch import combine_sampled_and_draft_tokens

assert HAS_TRITON, "vLLM disabled Triton (CUDA_VISIBLE_DEVICES must be empty)"
ids = torch.zeros(4, dtype=torch.int32)
li = combine_sampled_and_draft_tokens(
    ids, torch.tensor([0], dtype=torch.int32), torch.tensor([[7]]),
    torch.tensor([0, 2], dtype=torch.int32), torch.tensor([9], dtype=torch.int32),
    torch.tensor([5], dtype=torch.int32), torch.tensor([[8]]),
    torch.tensor([0, 2], dtype=torch.int32), 2)
assert ids.tolist() == [7, 8, 0, 0] and li.tolist() == [0, 1], (ids, li)
print("ok: vllm", md.version("vllm"), "triton", md.version("triton"),
      "torch", torch.__version__, "numpy", md.version("numpy"))
EOF
"$PY" -c 'import jax, jax.numpy as jnp; print("ok: jax", jax.__version__, jnp.arange(3).sum())'

pip_ list --format=freeze 2>/dev/null | sort >"$workdir/after.txt"
changes=$(comm -13 "$workdir/before.txt" "$workdir/after.txt" || true)
if [[ -z "$changes" ]]; then
    say "nothing changed: everything was already installed"
else
    say "installed or changed:"
    printf '  %s\n' $changes
fi
