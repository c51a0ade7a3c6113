#!/usr/bin/env bash
# Builds an isolated virtual environment holding vLLM 0.33.0's own argument parser and
# config resolution, on a CPU-only machine. vLLM's wheel pins CUDA torch and GPU packages,
# so it is installed without dependencies on top of the CPU torch, plus the pure-Python
# packages its `vllm serve` parser and EngineArgs.create_engine_config() import.
# Used only by the worker's contract test (tests/engine/test_vllm_contract.py).
set -euo pipefail
ENV_DIR=${1:-.venv-vllm}
test -x "$ENV_DIR/bin/python" || python3 -m venv "$ENV_DIR"
PIP="$ENV_DIR/bin/python -m pip install -q"
$PIP torch==2.13.0
$PIP --no-deps vllm==0.33.0
$PIP numpy regex cachetools psutil sentencepiece requests tqdm blake3 py-cpuinfo \
  "transformers>=5.16.1,<5.21" "huggingface_hub>=1.31" tokenizers safetensors protobuf \
  "fastapi[standard]>=0.133,<0.137" aiohttp openai pydantic orjson prometheus_client pillow \
  prometheus-fastapi-instrumentator tiktoken partial-json-parser jsonschema pyzmq msgspec \
  pyyaml einops cloudpickle watchfiles python-json-logger pybase64 cbor2 ijson setproctitle \
  filelock typing_extensions "mistral_common[image]" "oss-harmony>=0.0.11" "mcp>=2.2,<3" \
  "anthropic>=0.71" "model-hosting-container-standards>=0.1.14,<1" opentelemetry-sdk \
  opentelemetry-api opentelemetry-exporter-otlp opentelemetry-semantic-conventions-ai \
  "compressed-tensors==0.17.0" "depyf==0.20.0" "outlines_core==0.2.14" \
  "lm-format-enforcer==0.11.3" "xgrammar==0.2.8" "llguidance>=1.7,<1.8" ninja "lark==1.2.2"
VLLM_TARGET_DEVICE=cpu "$ENV_DIR/bin/python" -c "import vllm.engine.arg_utils; print('vllm env ok')"
