#!/usr/bin/env bash
# vllm-router (PyPI; a Rust router with a Python launcher) in a venv of its own under .tools/,
# for `dflash-bench gateway --peers` only: it is never a dependency of the project.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${VLLM_ROUTER_VERSION:-0.1.17}"
VENV=.tools/vllm-router
if [ ! -x "$VENV/bin/vllm-router" ] || ! "$VENV/bin/pip" show vllm-router 2>/dev/null | grep -qx "Version: $VERSION"; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "vllm-router==$VERSION"
fi
"$VENV/bin/pip" show vllm-router | grep -E '^(Name|Version):'
