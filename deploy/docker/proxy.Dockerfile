# The hidden-state proxy alone: the package's base dependencies only (no torch, no vLLM).
# It runs beside vLLM (compose service or Kubernetes sidecar) and reads the shared-memory ring.
#
#   docker build -f deploy/docker/proxy.Dockerfile -t vllm-hidden-state/proxy:0.1.0 .
#
# Build arguments (compose.yaml passes them from the environment; docs/deploy.md):
#   BASE_IMAGE        a Debian-based image with Python 3.11+ as `python` and its venv module. Pin
#                     it by digest too (python:3.11-slim-bookworm@sha256:...) for byte-for-byte
#                     reproducible builds, or name your registry's copy.
#   PIP_INDEX_URL     the package index (a mirror). pip reads it, and PIP_TRUSTED_HOST, from the
#   PIP_TRUSTED_HOST  environment; they are build arguments, so they stay out of the image.
# Both stay visible in `docker history`: never put a password in an index URL here.

ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG PIP_TRUSTED_HOST=
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# The dependencies come from pyproject.toml alone, so a change under src/ rebuilds only the
# package's own layer below.
COPY pyproject.toml /src/
RUN python -m venv /opt/venv \
 && python -c "import tomllib; p = tomllib.load(open('/src/pyproject.toml', 'rb'))['project']; print(*p['dependencies'], sep='\n')" > /tmp/requirements.txt \
 && /opt/venv/bin/pip install --no-compile -r /tmp/requirements.txt
COPY pyproject.toml README.md LICENSE /src/
COPY src /src/src
# The runtime stage copies the venv as is (same base image, same paths). The last two commands
# prove the dependency set: the CLI works and torch is absent.
RUN /opt/venv/bin/pip install --no-compile --no-deps /src \
 && /opt/venv/bin/hidden-state-proxy proxy --help > /dev/null \
 && ! /opt/venv/bin/python -c "import torch" 2> /dev/null

FROM ${BASE_IMAGE}
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# uid/gid 10001. The ring directory is shared with vLLM through this group: compose mounts the ring
# tmpfs with gid=10001 and the setgid bit, the Helm chart sets fsGroup 10001. Not named `proxy`:
# Debian's base-passwd already has a user and group `proxy` (uid/gid 13) in every Debian image.
RUN groupadd --gid 10001 hidden-state-proxy \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin hidden-state-proxy
COPY --from=build /opt/venv /opt/venv
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["hidden-state-proxy", "proxy"]
CMD ["--upstream", "http://127.0.0.1:8001", "--host", "0.0.0.0", "--port", "8000"]
