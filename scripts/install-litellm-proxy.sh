#!/usr/bin/env bash
# LiteLLM's proxy (PyPI `litellm[proxy]`, the version the client tests pin) in a venv of its
# own under .tools/, for `dflash-bench gateway --peers --litellm` only: never a dependency.
set -euo pipefail
cd "$(dirname "$0")/.."
# The version pyproject.toml pins for the client tests (one pin for the SDK and the proxy).
VERSION="${LITELLM_VERSION:-$(sed -n 's/.*"litellm==\([0-9.]*\)".*/\1/p' pyproject.toml)}"
[ -n "$VERSION" ] || { echo "no litellm pin in pyproject.toml" >&2; exit 1; }
VENV=.tools/litellm-proxy
if [ ! -x "$VENV/bin/litellm" ] || ! "$VENV/bin/pip" show litellm 2>/dev/null | grep -qx "Version: $VERSION"; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "litellm[proxy]==$VERSION"
fi
"$VENV/bin/pip" show litellm | grep -E '^(Name|Version):'
