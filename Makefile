# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv if it is
# missing and install what they need. Choose another torch with e.g. TORCH="torch==2.9.1",
# or TORCH= to keep whatever torch the environment has.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=
# Test processes (pytest-xdist; 0: one process). Files are the unit of distribution, so a
# module's shared run is trained once; half the suite waits on subprocesses, so two workers
# help even on two cores. The longest files start first (tests/scheduling.py: the seconds each took in
# tests/file_durations.json), and every log ends with the 30 slowest tests.
PYTEST_WORKERS ?= 2
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Node 22 and the MCP test tools (the conformance suite, the Inspector) that
# tests/mcp/test_conformance.py runs, at the versions pinned in tests/mcp/node/package-lock.json.
MCP_TOOLS := $(VENV)/node22

.PHONY: install sandbox browser slurm mcp-tools demo test test-fast lint bench clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@if [ -n "$(TORCH)" ]; then $(BIN)/python -m pip install --quiet "$(TORCH)"; fi
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	@touch $(STAMP)

install: $(STAMP)

# The sandbox of runs (bubblewrap; see SECURITY.md). Installed where this runs as root with
# apt-get; never fails the build: without it runs fall back and report isolation partial/none.
sandbox:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null) \
	      || echo "bubblewrap could not be installed: runs fall back to partial isolation"; \
	  else \
	    echo "bubblewrap is not installed (install the bubblewrap package): runs fall back to partial isolation"; \
	  fi; }

# Installed from the npm registry with npm ci (no install scripts) where npm is; never fails the
# build: without them their tests skip with the reason. Again only when the lock file changes.
mcp-tools:
	@if ! command -v npm >/dev/null 2>&1; then \
	  echo "npm is not installed: the MCP conformance and Inspector --strict tests skip"; \
	elif ! { [ -f $(MCP_TOOLS)/.installed ] && cmp -s tests/mcp/node/package-lock.json $(MCP_TOOLS)/package-lock.json; }; then \
	  rm -f $(MCP_TOOLS)/.installed && mkdir -p $(MCP_TOOLS) \
	  && cp tests/mcp/node/package.json tests/mcp/node/package-lock.json $(MCP_TOOLS)/ \
	  && npm ci --prefix $(MCP_TOOLS) --ignore-scripts --no-audit --no-fund --loglevel=error \
	  && touch $(MCP_TOOLS)/.installed \
	  || echo "the MCP test tools could not be installed in $(MCP_TOOLS): their tests skip"; \
	fi

# Headless Chromium (Debian's chromium, and a font) for the run view's browser test,
# tests/mcp/test_run_view.py. Installed where this runs as root with apt-get; never fails the
# build: without it the browser tests skip and say why.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      chromium fonts-dejavu-core >/dev/null) \
	      || echo "chromium could not be installed: the run view's browser tests skip"; \
	  else \
	    echo "chromium is not installed (install the chromium package): the run view's browser tests skip"; \
	  fi; }

# A single-machine SLURM (Debian's slurm-wlm and munge) for tests/mcp/test_slurm_cluster.py, whose
# fixture configures and starts it on 127.0.0.1 in a temp dir. Installed where this runs as root
# with apt-get; never fails the build: without it those tests skip and say why.
slurm:
	@{ command -v slurmctld && command -v slurmd && command -v munged; } >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null) \
	      || echo "slurm-wlm could not be installed: the tests against a real SLURM skip"; \
	  else \
	    echo "slurm-wlm is not installed (install slurm-wlm and munge as root): the tests against a real SLURM skip"; \
	  fi; }

demo: $(STAMP) sandbox
	$(BIN)/python examples/demo.py

test: $(STAMP) sandbox browser slurm mcp-tools lint
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --durations=30 $(PYTEST_ARGS)

# ruff (pyflakes, pycodestyle) over the tree; mypy over the contracts between the layers.
lint: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m mypy

# The quick part of the suite: no torchrun launches, no runs longer than a few seconds.
test-fast: $(STAMP) sandbox browser slurm
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m "not multiprocess and not slow" $(PYTEST_ARGS)

# CPU benchmarks, each printing ratios against a peer measured in the same run (~15 min).
# bench/gpu.py and bench/muon_vs_adamw.py are run by hand (a GPU machine; ~8 min).
bench: $(STAMP)
	$(BIN)/python bench/throughput.py
	$(BIN)/python bench/openmp_wait.py
	$(BIN)/python bench/mcp_startup.py
	$(BIN)/python bench/apply_skill.py
	$(BIN)/python bench/agent_budget.py

clean:
	rm -rf $(VENV) demo-workspace .pytest_cache .hypothesis
