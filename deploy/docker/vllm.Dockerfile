# GPU vLLM with this package's worker hook. The hook is a vLLM general plugin: installing the package
# into vLLM's Python environment is all it takes (entry point vllm.general_plugins:hidden_state_hook;
# if you set VLLM_PLUGINS, it must include hidden_state_hook).
#
#   docker build -f deploy/docker/vllm.Dockerfile -t vllm-hidden-state/vllm:0.1.0-gpu .
#
# Pinned to the GPU vLLM version the hook supports (pyproject extra `gpu`: vllm==0.34.0).
#
# It differs from vllm-cpu.Dockerfile only where it must: the base image holds vLLM and torch
# already, so only the package's base dependencies are installed, next to them in the image's
# system Python. Build arguments (compose.yaml passes them from the environment; docs/deploy.md):
#   BASE_IMAGE        the upstream vLLM image, or your registry's copy of it
#   PIP_INDEX_URL     the package index (a mirror); pip reads it and PIP_TRUSTED_HOST from the
#   PIP_TRUSTED_HOST  environment (uv gets them as its own variables)
# They stay visible in `docker history`: never put a password in an index URL here.

ARG BASE_IMAGE=vllm/vllm-openai:v0.34.0

FROM ${BASE_IMAGE}
# The image's system Python holds vLLM; install next to it (pip, or uv where the image has no pip).
# The only-if-needed upgrade strategy leaves vLLM's own pins (torch, starlette, ...) alone.
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    UV_BREAK_SYSTEM_PACKAGES=1
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG PIP_TRUSTED_HOST=
# The dependencies come from pyproject.toml alone, so a change under src/ rebuilds only the
# package's own layer below.
COPY pyproject.toml /tmp/vllm-hidden-state-proxy/
RUN python3 -c "import tomllib; p = tomllib.load(open('/tmp/vllm-hidden-state-proxy/pyproject.toml', 'rb'))['project']; print(*p['dependencies'], sep='\n')" > /tmp/requirements.txt \
 && if python3 -m pip --version > /dev/null 2>&1; then \
      python3 -m pip install --no-compile -r /tmp/requirements.txt; \
    else \
      env UV_INDEX_URL="$PIP_INDEX_URL" ${PIP_TRUSTED_HOST:+UV_INSECURE_HOST="$PIP_TRUSTED_HOST"} \
        uv pip install --system --no-cache -r /tmp/requirements.txt; \
    fi \
 && rm /tmp/requirements.txt \
 && python3 -c "import torch, transformers, vllm"
COPY pyproject.toml README.md LICENSE /tmp/vllm-hidden-state-proxy/
COPY src /tmp/vllm-hidden-state-proxy/src
RUN if python3 -m pip --version > /dev/null 2>&1; then \
      python3 -m pip install --no-compile --no-deps /tmp/vllm-hidden-state-proxy; \
    else \
      env UV_INDEX_URL="$PIP_INDEX_URL" ${PIP_TRUSTED_HOST:+UV_INSECURE_HOST="$PIP_TRUSTED_HOST"} \
        uv pip install --system --no-cache --no-deps /tmp/vllm-hidden-state-proxy; \
    fi \
 && rm -rf /tmp/vllm-hidden-state-proxy \
 && python3 -c "from importlib.metadata import entry_points; assert any(e.name == 'hidden_state_hook' for e in entry_points(group='vllm.general_plugins')), 'worker hook not registered'"
# Both sides read the ring directory from this variable; compose and the chart set it explicitly.
ENV HIDDEN_STATE_PROXY_RING_DIR=/run/vllm-hidden-states \
    HIDDEN_STATE_PROXY_RING_DIR_MODE=0770
# The module entry point works for every vLLM distribution (the upstream image uses `vllm serve`).
ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server"]
CMD ["--host", "0.0.0.0", "--port", "8001"]
