# `make test` and `make demo` work on a fresh machine: they create .venv first.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo lint bench bench-peers clean etcd gpu-check gpu-wheels compat

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

# two pytest workers, a file to each at a time (a file's jobs share its baselines); a short
# base folder, since the agents' Unix sockets live in the tests' run folders (107 bytes);
# torch's compiler cache (made by importing torch._dynamo) goes there too, not in /tmp
test: lint etcd
	@base=$$(mktemp -d /tmp/tsw.XXXX); \
	TORCHINDUCTOR_CACHE_DIR=$$base/inductor \
	$(BIN)/pytest -q -n 2 --dist loadfile --basetemp=$$base --durations=12; rc=$$?; \
	rm -rf $$base; exit $$rc

# the etcd server of the --rdzv-backend etcd tests (Debian's etcd-server); where it cannot
# be installed (no root, no apt) those tests are skipped, saying so
etcd:
	@command -v etcd >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -qq etcd-server >/dev/null 2>&1 || \
	    { apt-get update -qq && apt-get install -y -qq etcd-server >/dev/null; }; }; } || \
	  echo "no etcd server here: the --rdzv-backend etcd tests will be skipped"

demo: $(STAMP)
	$(BIN)/tierswap demo

# every benchmark, one report: bench/results/<date>-<commit>/*.json and BENCHMARKS.md
# (`make bench QUICK=1` for the short run); the peers come in where `make bench-peers` ran
bench: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/tierswap bench all $(if $(QUICK),--quick)

# the peers' own virtual environment, never a dependency of the package: DLRover's flash
# checkpoint and torchft beside the same torch, and tierswap's reference model
PEERS := .venv-peers
PEER_PKGS := dlrover[torch]==0.6.1 torchft==0.2.0 grpcio numpy kubernetes

bench-peers: $(STAMP)
	test -x $(PEERS)/bin/python || $(PY) -m venv $(PEERS)
	$(PEERS)/bin/pip install -q torch==2.13.0
	$(PEERS)/bin/pip install -q -e . $(PEER_PKGS)
	$(BIN)/tierswap bench peers --peers-python $(PEERS)/bin/python

# On a machine with an NVIDIA GPU whose python3 brings its own torch (the device machine's
# has 2.11): the project runs from this checkout (PYTHONPATH), no venv and no torch install;
# the few packages that python3 lacks come as wheels made beforehand by `make gpu-wheels`
# (they travel in .whl, ignored by git). Ends within 8 minutes; the JSON goes to
# $OUT/gpu-check.json where OUT is set (the device tool's output folder), else here.
GPU_PY ?= python3
GPU_SITE := /tmp/tierswap-gpu-site
GPU_WHEELS := msgspec==0.22.0 zstandard==0.25.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 \
  setproctitle==1.3.8 xxhash==4.1.0

# (every third-party module the check and its jobs import, tried first: one that only a
# job's worker imports, cryptography say, would otherwise fail minutes in)
GPU_IMPORTS := msgspec, zstandard, cryptography.x509, xxhash, safetensors.torch, psutil, \
  fsspec, rich, numpy, pytest, pytest_timeout, setproctitle

gpu-check:
	@if ls .whl/*.whl >/dev/null 2>&1; then $(GPU_PY) -m pip install -q --no-index --no-deps \
	  --no-compile --no-cache-dir --upgrade --target $(GPU_SITE) .whl/*.whl; fi
	@PYTHONPATH=$(GPU_SITE) $(GPU_PY) -c 'import $(GPU_IMPORTS); xxhash.xxh3_64' || { \
	  echo "gpu-check: a package is missing: make gpu-wheels where pip works, carry .whl"; \
	  exit 2; }
	PYTHONPATH=$(GPU_SITE):$(CURDIR)/src PYTHONUNBUFFERED=1 $(GPU_PY) -m tierswap.cli bench \
	  gpu-check --json $${OUT:-.}/gpu-check.json

# The suite under the device machine's torch (2.11), in a venv of its own, so that an API
# that torch lacks there fails here and not in the GPU check's few minutes. PyPI's wheel of
# it is the CUDA build: about 4.6 GB installed, hence not part of `make test`. tierswap goes
# in without its deps (it asks for 2.13); the others at the versions .venv has.
COMPAT_TORCH ?= 2.11.0
COMPAT := .venv-torch$(COMPAT_TORCH)

compat: $(STAMP) etcd
	test -x $(COMPAT)/bin/python || $(PY) -m venv $(COMPAT)
	$(COMPAT)/bin/pip install -q torch==$(COMPAT_TORCH)
	$(COMPAT)/bin/pip install -q --no-deps -e .
	$(BIN)/pip freeze --exclude-editable | grep -v -i '^torch==' > $(COMPAT)/constraints.txt
	$(BIN)/python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
	  print("\n".join(d for d in p["dependencies"] + p["optional-dependencies"]["dev"] \
	  if not d.startswith("torch")))' > $(COMPAT)/requirements.txt
	$(COMPAT)/bin/pip install -q -c $(COMPAT)/constraints.txt -r $(COMPAT)/requirements.txt
	@base=$$(mktemp -d /tmp/tsw.XXXX); \
	TORCHINDUCTOR_CACHE_DIR=$$base/inductor \
	$(COMPAT)/bin/pytest -q -n 2 --dist loadfile --basetemp=$$base; rc=$$?; \
	rm -rf $$base; exit $$rc

gpu-wheels:
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform manylinux_2_34_x86_64 -d .whl $(GPU_WHEELS)

clean:
	rm -rf $(VENV) $(PEERS) .venv-torch* .pytest_cache .mypy_cache .ruff_cache
