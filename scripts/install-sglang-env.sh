#!/usr/bin/env bash
# Builds an isolated virtual environment holding SGLang 0.5.23 on a CPU-only machine: its own
# server-argument parser and validation (prepare_server_args, ServerArgs.resolve_once,
# check_server_args), and its real OpenAI-compatible server for PLAIN decoding on a CPU torch
# (DFlash itself needs cuda/npu/xpu). SGLang's wheel without its dependency list (which pulls
# a CUDA torch), the CPU torch, and exactly the pure-Python packages those paths import (about
# 2.5 GB, most of it torch and triton). Used by tests/engine/worker/test_sglang_backend.py and
# tests/deploy/test_chart_engines.py (argv checks) and tests/e2e/test_sglang_cpu.py (the server
# behind the gateway). torchvision is left out (PyPI's is a CUDA build): the tests give SGLang
# a stand-in (tests/fixtures/sglang_cpu/sitecustomize.py), with a pure-torch rotary kernel.
set -euo pipefail
VENV=${1:-.venv-sglang}
PY="$VENV/bin/python"
[ -x "$PY" ] || python3 -m venv "$VENV"

# Keep pip from ever swapping the CPU torch for a PyPI (CUDA) one.
CONS="$(mktemp)"; trap 'rm -f "$CONS"' EXIT
echo "torch==2.13.0" > "$CONS"

# 1. CPU torch (2.13.0+cpu, served from the local wheel dir; pin it: an unpinned torch resolves to CUDA 2.14.1).
"$PY" -m pip install -q -c "$CONS" "torch==2.13.0"

# 2. SGLang itself, without its (CUDA) dependency list.
"$PY" -m pip install -q --no-deps "sglang==0.5.23"

# 3. Only what `import sglang.srt.server_args` + resolve_once() + check_server_args() import.
#    Installed --no-deps from a full pin list so the result is exact.
"$PY" -m pip install -q --no-deps -c "$CONS" \
  aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 \
  annotated-types==0.8.0 anyio==4.16.0 apache-tvm-ffi==0.1.11 asttokens==3.0.2 \
  attrs==26.1.0 certifi==2026.10.19.post1 charset-normalizer==3.5.2 click==8.5.1 \
  compressed-tensors==0.18.0 dill==0.4.1 distro==1.9.0 einops==0.8.2 executing==2.3.0 \
  filelock==4.2.12 frozenlist==1.8.0 fsspec==2026.9.0 gguf==0.19.0 h11==0.16.0 \
  hf-xet==1.8.0 httpcore==1.0.9 httpcore2==2.16.2 httpx==0.28.1 httpx2==2.16.2 \
  huggingface_hub==1.33.0 idna==3.20 ipython==9.18.1 ipython_pygments_lexers==1.1.1 \
  jedi==0.20.1 Jinja2==3.1.6 jiter==0.19.0 loguru==0.7.3 markdown-it-py==4.3.0 \
  MarkupSafe==3.0.4 matplotlib-inline==0.2.2 mdurl==0.1.2 mpmath==1.3.0 msgspec==0.22.0 \
  multidict==7.2.1 networkx==3.6.1 numpy==2.4.6 openai==2.8.0 orjson==3.13.0 \
  packaging==26.3 parso==0.8.7 partial-json-parser==0.2.1.1.post7 pexpect==4.9.0 \
  pillow==13.0.0 prompt_toolkit==3.0.53 propcache==0.5.4 psutil==7.2.2 ptyprocess==0.7.0 \
  pure_eval==0.2.4 pybase64==1.5.1 pydantic==2.14.4 pydantic_core==2.50.5 \
  Pygments==2.21.0 PyYAML==6.0.4 pyzmq==27.3.0 regex==2026.11.19 requests==2.34.2 \
  rich==15.0.0 safetensors==0.8.0 sentencepiece==0.2.1 shellingham==1.5.4 sniffio==1.3.1 \
  stack-data==0.6.3 starlette==1.10.0 sympy==1.14.0 tokenizers==0.23.2 tqdm==4.70.1 \
  traitlets==5.16.1 transformers==5.19.0 triton==3.9.0 truststore==0.10.5 typer==0.29.2 \
  typing-inspection==0.4.5 typing_extensions==4.16.0 urllib3==2.8.0 wcwidth==0.9.4 \
  yarl==1.25.1

# 4. What the HTTP server and its scheduler import besides (uvicorn, FastAPI, xgrammar, ...).
"$PY" -m pip install -q --no-deps -c "$CONS" \
  cffi==2.1.1 fastapi==0.165.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
  opentelemetry-api==1.45.2 prometheus_client==0.26.0 pycparser==3.12 python-multipart==0.0.34 \
  referencing==0.37.0 rpds-py==2026.9.1 setproctitle==1.3.8 soundfile==0.13.1 \
  uvicorn==0.54.0 uvloop==0.23.0 xgrammar==0.2.7

# 5. Guard: no CUDA torch, no torchvision (PyPI's is a CUDA build that breaks on CPU torch;
#    the tests give SGLang a stand-in), no nvidia-* wheels.
"$PY" - <<'PY'
import importlib.metadata as m, sys
v = m.version("torch")
bad = [d.metadata["Name"] for d in m.distributions()
       if d.metadata["Name"].lower().startswith(("nvidia-", "cuda-", "torchvision"))]
if not v.endswith("+cpu") or bad:
    sys.exit(f"unexpected install: torch={v} extra={bad}")
import sglang.srt.server_args  # noqa: F401
import fastapi, uvicorn, xgrammar  # noqa: F401,E401
print(f"sglang-env ready: torch {v}, sglang {m.version('sglang')}")
PY
