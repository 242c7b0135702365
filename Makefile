# `make test` and `make demo` work on a fresh machine: they create .venv first.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo lint bench clean etcd

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: an unpinned resolve could pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests
	$(BIN)/mypy

test: lint etcd
	$(BIN)/pytest -q --durations=12

# the etcd server of the --rdzv-backend etcd tests (Debian's etcd-server); where it cannot
# be installed (no root, no apt) those tests are skipped, saying so
etcd:
	@command -v etcd >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -qq etcd-server >/dev/null 2>&1 || \
	    { apt-get update -qq && apt-get install -y -qq etcd-server >/dev/null; }; }; } || \
	  echo "no etcd server here: the --rdzv-backend etcd tests will be skipped"

demo: $(STAMP)
	$(BIN)/tierswap demo

bench: $(STAMP)
	$(BIN)/tierswap bench snapshot

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
