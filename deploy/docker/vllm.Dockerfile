# syntax=docker/dockerfile:1
#
# GPU vLLM with this package's worker hook. The hook is a vLLM general plugin: installing the package
# into vLLM's Python environment is all it takes (entry point vllm.general_plugins:hidden_state_hook;
# if you set VLLM_PLUGINS, it must include hidden_state_hook).
#
#   docker build -f deploy/docker/vllm.Dockerfile -t vllm-hidden-state/vllm:0.1.0-gpu .
#
# Pinned to the GPU vLLM version the hook supports (pyproject extra `gpu`: vllm==0.33.0).

FROM vllm/vllm-openai:v0.33.0
# The image's system Python holds vLLM; install next to it (pip, or uv where the image has no pip).
# Base dependencies only: the only-if-needed upgrade strategy leaves vLLM's own pins (torch,
# starlette, ...) alone.
ENV PIP_BREAK_SYSTEM_PACKAGES=1 \
    UV_BREAK_SYSTEM_PACKAGES=1
COPY . /tmp/vllm-hidden-state-proxy
RUN if python3 -m pip --version > /dev/null 2>&1; then \
      python3 -m pip install --no-cache-dir --no-compile /tmp/vllm-hidden-state-proxy; \
    else \
      uv pip install --system --no-cache /tmp/vllm-hidden-state-proxy; \
    fi \
 && rm -rf /tmp/vllm-hidden-state-proxy \
 && python3 -c "from importlib.metadata import entry_points; assert any(e.name == 'hidden_state_hook' for e in entry_points(group='vllm.general_plugins')), 'worker hook not registered'"
# Both sides read the ring directory from this variable; compose and the chart set it explicitly.
ENV HIDDEN_STATE_PROXY_RING_DIR=/run/vllm-hidden-states \
    HIDDEN_STATE_PROXY_RING_DIR_MODE=0750
# The module entry point works for every vLLM distribution (the upstream image uses `vllm serve`).
ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server"]
CMD ["--host", "0.0.0.0", "--port", "8001"]
