# The production worker: vLLM 0.33 (CUDA, DFlash support) plus our `dflash-worker` CLI, which
# validates the settings and execs `vllm serve` with DFlash. Build from the repository root:
#   docker build -f docker/worker.Dockerfile -t ghcr.io/dflash-serving/worker:<appVersion> .
# `make images` does it with the names and tags the chart pulls (REGISTRY=... for yours).
FROM vllm/vllm-openai:v0.33.0
WORKDIR /opt/dflash-serving
COPY pyproject.toml README.md ./
COPY service/ service/
COPY wire/ wire/
COPY launcher/ launcher/
COPY engine/ engine/
# The core dependencies only: vLLM's image already has its torch and CUDA stack, which must
# not be replaced (the [engine] extra pins a CPU torch; the [vllm] extra is this base image).
RUN python3 -m pip install --no-cache-dir '.[tracing,capture-s3,capture-gcs]' \
 && python3 -c "import vllm, engine.worker.cli; print('vllm', vllm.__version__)"
ENV HF_HOME=/cache/huggingface
EXPOSE 8000
# Arguments follow `vllm serve`: docker run IMAGE MODEL --speculative-config '{...}' --host 0.0.0.0
ENTRYPOINT ["dflash-worker", "--backend", "vllm"]
