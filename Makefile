# Every target that needs Python creates .venv first. torch is installed pinned and first:
# a later dependency range (torch>=2.6) is then already satisfied and pip fetches nothing.
PY      := .venv/bin/python
PIP     := $(PY) -m pip
TORCH   := torch==2.13.0
TORCHTITAN := torchtitan==0.2.2 triton==3.9.0 torchdata==0.11.0
# what importing torchtitan's models pulls in besides (none of them requires torch)
TORCHTITAN_DEPS := datasets==5.2.0 einops==0.8.2 tensorboard==2.21.0
TORCHAO := torchao==0.18.0
# DeepSpeed's own config check of `autopar export --to deepspeed` (tests/api): an sdist,
# built without its ops (DS_BUILD_OPS=0) and without its dependencies (which would resolve
# another torch), and what importing it needs beyond what the rest installs (pydantic,
# psutil, numpy, packaging, tqdm, einops).
DEEPSPEED := deepspeed==0.18.2
DEEPSPEED_DEPS := py-cpuinfo==9.0.0 hjson==3.1.0 msgpack==1.2.4 ninja==1.13.2 nvidia-ml-py==13.615.71
# Megatron-Core's TransformerConfig checks `autopar export --to megatron` (tests/api); its
# training arguments are not in any package (bench/megatron_args.py runs them from a checkout).
MEGATRON_CORE := megatron-core==0.16.1
STAMP   := .venv/.installed
# Debian's Chromium for the headless browser tests (installed once, with apt-get).
CHROMIUM := /usr/bin/chromium
SUDO    := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup demo test lint format bench serve clean postgresql

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet $(TORCH)
	$(PIP) install --quiet -e '.[dev]'
	# torchtitan's own config parser, model flavors and pipeline split check `autopar export
	# --to torchtitan` in the tests: installed without its dependencies (which would resolve
	# another torch); what its config module imports is in the dev extra (tyro, tomli),
	# triton and torchdata for its imports, and the rest of what its models import.
	$(PIP) install --quiet --no-deps $(TORCHTITAN)
	$(PIP) install --quiet $(TORCHTITAN_DEPS)
	# torchao's float8 training (executor/fp8.py; its test runs where a GPU is): it has no
	# runtime dependencies, and --no-deps keeps pip from resolving another torch.
	$(PIP) install --quiet --no-deps $(TORCHAO)
	DS_BUILD_OPS=0 $(PIP) install --quiet --no-deps $(DEEPSPEED) $(DEEPSPEED_DEPS)
	$(PIP) install --quiet --no-deps $(MEGATRON_CORE)
	$(PY) -c "import torch; v = torch.__version__; assert v.startswith('2.13.0'), v"
	touch $(STAMP)

# The demo's local run: a GPT small enough for a laptop, large enough that its operators,
# not Python, set the step time; one process per core, at most 4 (processes sharing a core
# time-share it, which no profile predicts). The machine is measured once (operators of this
# model, collectives, memory bandwidth) into out/local-measured.yaml; delete out/ to re-measure.
DEMO_MODEL := --model gpt-350m --config layers=4 hidden=256 heads=4 vocab=1024
DEMO_NPROC := $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; [ $$n -lt 2 ] && n=2; echo $$n)

demo: setup out/local-measured.yaml
	.venv/bin/autopar clusters
	.venv/bin/autopar estimate --model gpt-39b --cluster aws-p3.16xlarge --nodes 8 \
		--dp 1 --tp 8 --pp 8 --microbatches 256 --global-batch 1024 --checkpointing --dtype fp16
	.venv/bin/autopar plan --model gpt-1.3b --cluster dgx-a100-80g --global-batch 512 \
		--seq 1024 -o out/plan-gpt-1.3b.json
	.venv/bin/autopar plan $(DEMO_MODEL) --cluster out/local-measured.yaml --op-db out/ops.db \
		--global-batch 16 --seq 128 --dtype fp32 --no-baselines --executable-only \
		--tp-layout megatron -o out/plan-cpu.json
	.venv/bin/autopar execute out/plan-cpu.json --steps 6

out/local-measured.yaml: $(STAMP)
	mkdir -p out
	.venv/bin/autopar profile-ops $(DEMO_MODEL) --seq 128 --dtype fp32 --cluster cpu-local \
		--db out/ops.db --batches 1,2,4,8,16 --concurrency $(DEMO_NPROC) --threads 1
	.venv/bin/autopar profile-cluster --nproc-per-node $(DEMO_NPROC) --repeats 3 \
		--op-db out/ops.db -o out/local-measured.yaml

# Test files spread over one pytest worker per core, at most 4 (pytest-xdist; a file's tests
# stay together, sharing its module fixtures): on 2 cores tests/planner took 200 s against 353
# s in one process. The distributed cases start 2-4 gloo ranks each, so more workers than
# cores would only time-share them. Files run in tests/conftest.py's order (slow ones first).
TEST_WORKERS := $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)

test: setup $(CHROMIUM) postgresql
	$(PY) -m pytest -q --durations=25 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

$(CHROMIUM):
	$(SUDO) apt-get update -qq
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium

# Debian's PostgreSQL server binaries: the tests start a throw-away cluster of their own
# (tests/service/postgres.py); the package's own service is not used.
postgresql:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { \
		$(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends postgresql; }

# The REST service on loopback with the SQLite store in ./autopar-data (docs: /docs).
serve: setup
	AUTOPAR_DATA_DIR=$${AUTOPAR_DATA_DIR:-autopar-data} .venv/bin/autopar serve --host 127.0.0.1 --port $${PORT:-8000}

lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

format: setup
	.venv/bin/ruff check --fix .
	.venv/bin/ruff format .

bench: setup
	$(PIP) install --quiet -e '.[dev,bench]'
	$(PY) bench/trace_bench.py
	$(PY) bench/calibration.py
	$(PY) bench/ilp_bench.py
	$(PY) bench/execute_bench.py
	$(PY) bench/executor_overhead.py
	$(PY) bench/service_bench.py
	$(PY) bench/prediction_error.py
	$(PY) bench/suite.py
	$(PY) bench/plot_suite.py
	$(PY) bench/search_scale.py
	$(PY) bench/hf_conformance.py

clean:
	rm -rf .venv build *.egg-info .pytest_cache .ruff_cache
