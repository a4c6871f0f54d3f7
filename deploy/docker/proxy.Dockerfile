# syntax=docker/dockerfile:1
#
# The hidden-state proxy alone: the package's base dependencies only (no torch, no vLLM).
# It runs beside vLLM (compose service or Kubernetes sidecar) and reads the shared-memory ring.
#
#   docker build -f deploy/docker/proxy.Dockerfile -t vllm-hidden-state/proxy:0.1.0 .
#
# Pinned by tag; pin by digest too (FROM python:3.11-slim-bookworm@sha256:...) for byte-for-byte
# reproducible builds.

FROM python:3.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY . .
# Install into a venv that the runtime stage copies as is (same base image, same paths).
# The last two commands prove the dependency set: the CLI works and torch is absent.
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-compile . \
 && /opt/venv/bin/hidden-state-proxy proxy --help > /dev/null \
 && ! /opt/venv/bin/python -c "import torch" 2> /dev/null

FROM python:3.11-slim-bookworm
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# uid/gid 10001. The ring directory is shared with vLLM through this group: compose mounts the ring
# tmpfs with gid=10001 and the setgid bit, the Helm chart sets fsGroup 10001.
RUN groupadd --system --gid 10001 proxy \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin proxy
COPY --from=build /opt/venv /opt/venv
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["hidden-state-proxy", "proxy"]
CMD ["--upstream", "http://127.0.0.1:8001", "--host", "0.0.0.0", "--port", "8000"]
