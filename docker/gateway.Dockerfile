# The gateway: torch-free, slim, non-root. Build from the repository root:
#   docker build -f docker/gateway.Dockerfile -t ghcr.io/dflash-serving/gateway:<appVersion> .
# `make images` does it with the names and tags the chart pulls (REGISTRY=... for yours).
FROM python:3.11-slim AS build
WORKDIR /src
# Only the gateway's sources: the core install has no torch and no engine dependencies.
COPY pyproject.toml README.md ./
COPY service/ service/
COPY wire/ wire/
COPY launcher/ launcher/
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --upgrade pip \
 && /opt/venv/bin/pip install --no-cache-dir '.[tracing,capture-s3,capture-gcs]' \
 && ! /opt/venv/bin/python -c "import torch" 2>/dev/null

FROM python:3.11-slim
COPY --from=build /opt/venv /opt/venv
# In a container the gateway listens on every interface (its default is 127.0.0.1).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    DFLASH_GATEWAY_HOST=0.0.0.0
RUN groupadd --system --gid 10001 dflash \
 && useradd --system --uid 10001 --gid dflash --no-create-home --shell /usr/sbin/nologin dflash
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]
ENTRYPOINT ["dflash-gateway"]
CMD ["--port", "8000"]
