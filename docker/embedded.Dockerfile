# The embedded worker: the pure-PyTorch DFlash engine on CPU with the bundled tiny-coder target
# and drafter, for trying the stack anywhere. Build from the repository root:
#   docker build -f docker/embedded.Dockerfile -t ghcr.io/dflash-serving/embedded:<appVersion> .
# `make images` does it with the names and tags the chart pulls (REGISTRY=... for yours).
FROM python:3.11-slim AS build
WORKDIR /src
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --upgrade pip \
 && /opt/venv/bin/pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml README.md ./
COPY service/ service/
COPY wire/ wire/
COPY launcher/ launcher/
COPY engine/ engine/
# engine/assets/tiny-coder (target + DFlash drafter) ships as package data.
RUN /opt/venv/bin/pip install --no-cache-dir '.[engine,tracing]' \
 && /opt/venv/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"

FROM python:3.11-slim
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# No OMP_NUM_THREADS: the worker sizes its threads from the CPUs the container may use
# (affinity and cgroup quota, less one for its HTTP side: engine/threads.py).
RUN groupadd --system --gid 10001 dflash \
 && useradd --system --uid 10001 --gid dflash --no-create-home --shell /usr/sbin/nologin dflash
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]
ENTRYPOINT ["dflash-worker", "--backend", "embedded"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
