# Quick start: `make demo` and `make test`. Both set up .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
PORT   ?= 8000
STEPS  ?=

.PHONY: setup setup-and-hook demo test test-unit test-gpu gpu-check gpu-rehearsal check check-min-versions lint typecheck bench bench-quick soak browser prometheus system-packages serve clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch: reuse an importable one; else the CPU build, never the default index's bare
# `torch`, which on Linux is the multi-GB CUDA build. First torch==X+cpu from pip's
# configured sources (a local wheel where there is one; PyPI has no +cpu builds, so this
# fails fast on a laptop), then the PyTorch CPU wheel index (it also serves torch's deps,
# and macOS wheels, which carry no +cpu tag).
# ninja and numpy come with it (what the C++ comm hook's build needs, and what torch
# imports if present), so that the build can start while the rest installs (`make test`).
TORCH_VERSION   ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_STAMP     := $(VENV)/.torch-stamp
$(TORCH_STAMP): | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || \
		$(BIN)/pip install -q torch==$(TORCH_VERSION)+cpu 2>/dev/null || \
		$(BIN)/pip install -q --index-url $(TORCH_CPU_INDEX) torch==$(TORCH_VERSION)
	$(BIN)/python -c "import ninja, numpy" 2>/dev/null || $(BIN)/pip install -q 'ninja>=1.11' 'numpy>=1.26'
	touch $@

# The packages: uv where it could be installed (6 s of CPU for .[dev], where pip spent 71 s
# resolving and compiling every file to bytecode, on the cores the C++ hook's build
# needs), pip otherwise. Either keeps the torch installed above (constraints.txt pins it:
# uv does not read pip's configuration, and a package asking for a newer torch must fail
# here, not fetch a multi-GB CUDA build).
CONSTRAINTS := $(VENV)/constraints.txt
$(CONSTRAINTS): | $(TORCH_STAMP)
	-$(BIN)/python -m uv --version >/dev/null 2>&1 || $(BIN)/pip install -q uv 2>/dev/null
	$(BIN)/python -c "import torch; print('torch==' + torch.__version__)" > $@
PKG_INSTALL = { $(BIN)/python -m uv --version >/dev/null 2>&1 && \
	$(BIN)/python -m uv pip install -q --python $(BIN)/python -c $(CONSTRAINTS) $(1); } || \
	$(BIN)/pip install -q -c $(CONSTRAINTS) $(1)

# Two stamps: `make demo` and `make serve` need only the hook and the server (DEMO_STAMP);
# `make setup` and `make test` add the test tools (`.[dev]`, which holds both, so it
# stamps the demo's set-up too).
DEMO_STAMP := $(VENV)/.demo-stamp
# A variable: a comma written in $(call)'s arguments would split them.
DEMO_EXTRAS := -e '.[hook,server]'
$(DEMO_STAMP): pyproject.toml | $(CONSTRAINTS)
	$(call PKG_INSTALL,$(DEMO_EXTRAS))
	touch $@

$(STAMP): pyproject.toml | $(CONSTRAINTS)
	$(call PKG_INSTALL,-e '.[dev]')
	touch $@ $(DEMO_STAMP)

setup: $(STAMP)

# setup, with the C++ DDP comm hook built (about 20 s of one core on a cold cache) while the
# rest of the packages install, once torch is in. The build imports torch before pip goes
# on; should it fail anyway, the tests build it again (tests/conftest.py).
HOOK_IMPORTED := $(VENV)/.native-hook-imported
setup-and-hook:
	@$(MAKE) --no-print-directory $(TORCH_STAMP) || exit 1; rm -f $(HOOK_IMPORTED); \
		$(BIN)/python -c "import torch.utils.cpp_extension; from trainer_hook import _native_comm_hook as n; \
			open('$(HOOK_IMPORTED)', 'w').close(); n.load()" & hook=$$!; \
		while [ ! -e $(HOOK_IMPORTED) ] && kill -0 $$hook 2>/dev/null; do sleep 0.2; done; \
		$(MAKE) --no-print-directory setup; status=$$?; \
		wait $$hook || status=1; rm -f $(HOOK_IMPORTED); exit $$status

# Debian's Chromium for the browser tests (Playwright's own download cannot work offline).
browser:
	@test -x /usr/bin/chromium || (apt-get update -qq && $(APT_CHROMIUM))

# Debian's Prometheus (prometheus, promtool) and docker-compose for the deploy/ tests. The
# package's own Prometheus service is stopped and disabled: tests start theirs on free ports.
prometheus:
	@test -x /usr/bin/prometheus -a -x /usr/bin/promtool -a -x /usr/bin/docker-compose || \
		(apt-get update -qq && $(APT_PROMETHEUS))
	@$(PROMETHEUS_SERVICE_OFF)

# Both of the above with one `apt-get update` (what `make test` runs).
system-packages:
	@need_browser=0; need_prom=0; test -x /usr/bin/chromium || need_browser=1; \
		test -x /usr/bin/prometheus -a -x /usr/bin/promtool -a -x /usr/bin/docker-compose || need_prom=1; \
		if [ $$need_browser = 1 ] || [ $$need_prom = 1 ]; then apt-get update -qq || exit 1; fi; \
		if [ $$need_browser = 1 ]; then $(APT_CHROMIUM) || exit 1; fi; \
		if [ $$need_prom = 1 ]; then $(APT_PROMETHEUS) || exit 1; fi
	@$(PROMETHEUS_SERVICE_OFF)

APT_CHROMIUM   = DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
APT_PROMETHEUS = DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	prometheus docker-compose >/dev/null
PROMETHEUS_SERVICE_OFF = if [ -d /run/systemd/system ]; then systemctl disable --now prometheus >/dev/null 2>&1; fi; \
	if [ -x /etc/init.d/prometheus ]; then /etc/init.d/prometheus stop >/dev/null 2>&1; \
	update-rc.d prometheus disable >/dev/null 2>&1; fi; true

demo: $(DEMO_STAMP)
	$(BIN)/rebalancer demo --port $(PORT) $(if $(STEPS),--steps $(STEPS),)

serve: $(DEMO_STAMP)
	$(BIN)/rebalancer serve --port $(PORT)

# Two pytest workers (pytest-xdist), a test file per worker at a time: most tests wait on
# real processes and servers, so two keep two cores busy. TEST_WORKERS=0 runs them in one.
# Nothing waits that need not: apt installs Chromium and Prometheus (one `apt-get update`)
# while the venv is set up and the C++ comm hook is built (setup-and-hook), instead of each
# step after the other. tests/conftest.py sends the slowest test files to the workers
# first, so that no long file is left to run alone at the end.
TEST_WORKERS ?= 2
test:
	@$(MAKE) --no-print-directory system-packages & apt=$$!; \
		$(MAKE) --no-print-directory setup-and-hook; status=$$?; \
		wait $$apt || status=1; exit $$status
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=25 -n $(TEST_WORKERS) --dist loadfile

# The fast lane: in-process tests only (no torchrun, servers, browser or installs), on the
# same workers as `make test`: about 80 s on 2 cores (2 minutes in one).
test-unit: $(STAMP)
	REBALANCER_UNIT_LANE=1 $(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) \
		-m "not multiproc and not browser and not install"

# The GPU checks (tests/gpu, marked gpu; docs/gpu.md): skipped without a CUDA device. No
# setup dependency: on a CUDA machine `make setup` would put the CPU build of torch into
# .venv, so these run with GPU_PYTHON (scripts/gpu-check passes the Python whose torch has CUDA).
GPU_PYTHON      ?= $(BIN)/python
GPU_PYTEST_ARGS ?=
test-gpu:
	$(GPU_PYTHON) -m pytest -q -p no:cacheprovider -rA -m gpu tests/gpu $(GPU_PYTEST_ARGS)

# test-gpu and the GPU bench in one go, results under $$OUT or bench/results/gpu/ (8 minutes at most).
gpu-check:
	scripts/gpu-check

# The same on CPU with the GPU parts faked: the script's plumbing and every test's logic.
gpu-rehearsal:
	PYTHON=$(GPU_PYTHON) scripts/gpu-check --rehearse

lint: $(STAMP)
	$(BIN)/ruff check rebalancer_wire trainer_hook backend frontend tests bench examples

typecheck: $(STAMP)
	$(BIN)/mypy rebalancer_wire trainer_hook backend frontend

check: lint typecheck test

# pyproject's lower bounds installed into a fresh venv and tested (about 4 minutes).
check-min-versions: $(STAMP)
	REBALANCER_CHECK_MIN_VERSIONS=1 $(BIN)/python -m pytest -q -p no:cacheprovider -s tests/test_min_versions.py

bench: $(STAMP)
	$(BIN)/python -m bench.run_all

bench-quick: $(STAMP)
	$(BIN)/python -m bench.run_all --quick

# Every launch path many times, each run timed out and checked for aborts and leaks
# (bench/soak.py). SOAK_RUNS per path; SOAK_PATHS all, main or a comma list; SOAK_ARGS
# e.g. --burn 2 or --max-minutes 30. Writes bench/results/soak.json.
SOAK_RUNS  ?= 20
SOAK_PATHS ?= all
SOAK_ARGS  ?=
soak: $(STAMP)
	$(BIN)/python -m bench.soak --runs $(SOAK_RUNS) --paths $(SOAK_PATHS) $(SOAK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
