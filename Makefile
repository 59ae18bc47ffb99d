# fitserve: every target does its own setup (a venv at .venv with pinned deps, the default model).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
WHEELS  := $(wildcard /opt/wheels)
PIPOPTS := $(if $(WHEELS),--find-links $(WHEELS),)
PROMPT  ?= Write a haiku about paged attention.

.PHONY: setup model pull serve generate test test-kernels test-fast lint bench soak fuzz browser clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and exactly pinned: an unpinned torch would pull a multi-GB CUDA build
	$(BIN)/pip install -q $(PIPOPTS) torch==2.13.0
	# the ray extra too: tests/e2e/test_replicas.py runs replicas on a local Ray Serve
	$(BIN)/pip install -q $(PIPOPTS) -e ".[test,ray]"
	touch $(STAMP)

# The C++ kernels this CPU's tier uses, built into FITSERVE_HOME's cache now (a few minutes on
# 2 cores the first time, ~2 s once cached) so no server start or first request compiles one.
setup: $(STAMP)
	$(BIN)/python -m fitserve.kernels.cpu.build || \
		echo "some C++ kernels did not build: their paths run pure torch (see above)"

# The default model's file alone (no kernel build): `make test` fetches it while kernels build.
model: $(STAMP)
	$(BIN)/fitserve pull smollm2-135m

pull: setup model

serve: pull
	$(BIN)/fitserve serve

generate: pull
	$(BIN)/fitserve generate --chat "$(PROMPT)"

lint: $(STAMP)
	$(BIN)/ruff check fitserve tests benchmarks
	$(BIN)/mypy fitserve/ledger fitserve/tools/planner fitserve/tools/sheets fitserve/kv fitserve/sched

# Headless Chromium for the dashboard test (Debian packages; the test skips without them).
browser:
	test -x /usr/bin/chromium || (apt-get update -qq && apt-get install -y -qq chromium chromium-driver) || \
		echo "chromium not installed: the dashboard test will be skipped"

# Two workers (pytest-xdist), tests handed out in file groups and stolen back at the end so
# neither idles: many tests wait on subprocesses, servers and Python, so two share the 2 cores
# well. Each worker, and every server it starts, runs torch on its share of the cores
# (tests/conftest.py): two workers of 2 threads on 2 cores made each parallel region wait for a
# descheduled thread. On an AVX2-only Zen 3 from a fresh clone: 14.3 min of pytest (was 20.9-27.2
# with 2 threads per worker). The peak-RSS tests run alone after the rest: a process's peak
# RSS counts the shared libraries' file pages it maps, and with a second worker loading models
# beside it this host's page cache (and its proactive reclaim) moves that by tens of MiB.
#
# Before pytest, the steps it needs run side by side (make -j, each step's output kept together):
# this CPU's kernels (setup), the lower tiers' kernels that the tier-subprocess tests load
# (tests/tier_builds.py), the model's download, lint (mypy keeps one core busy for ~30 s) and the
# browser check. One after another, the download, mypy and each single-file compile left a core
# idle, and the lower tiers were compiled inside pytest, where both workers keep both cores busy.
test: $(STAMP)
	$(MAKE) --no-print-directory -j5 --output-sync=target setup test-kernels model lint browser
	$(BIN)/pytest -q -n 2 --dist worksteal -m "not peak_rss" --durations=30
	$(BIN)/pytest -q -m peak_rss

# The lower-tier C++ kernels of the tier-subprocess tests (a test compiles any that are missing).
test-kernels: $(STAMP)
	$(BIN)/python -m tests.tier_builds

test-fast: setup
	$(BIN)/pytest -q -m "not slow"

bench: pull
	$(BIN)/python benchmarks/bench_engine.py

# The long reliability runs (CI runs small versions of both): mixed load with disconnects, and
# schemathesis over the server's own /openapi.json.
soak: pull
	$(BIN)/python benchmarks/soak.py --requests 1000 --rounds 2

fuzz: pull
	$(BIN)/python benchmarks/fuzz_api.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
