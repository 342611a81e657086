# make venv: build .venv (CPU torch pinned for the dev env); make test: venv + lint + docs + the test suite;
# make lint: ruff over the repository and mypy over impel/; make docs: the mkdocs site, warnings as errors;
# make demo: venv + the seed exercise (impel's Trainer = transformers' on impel, genre classifier, 2 CPU ranks);
# make bench: venv + benchmarks (not part of make test).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.impel-installed
TORCH  := torch==2.13.0
DEEPSPEED := deepspeed==0.19.8
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# DeepSpeed's C++ ops are built once per venv: in the shared ~/.cache another checkout's venv rebuilds them over
# this one's (torch keys the cache by name, not by path), and CLI tests that give their jobs a fresh
# XDG_CACHE_HOME would each build their own copy
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions

.PHONY: venv test lint docs demo bench clean deepspeed-ops deepspeed-shm-op

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[dev,examples,plot,deepspeed]' $(TORCH) $(DEEPSPEED)
	touch $(STAMP)

# DeepSpeed's CPU ops are C++ extensions compiled on first use and cached in $TORCH_EXTENSIONS_DIR: build them
# here so that no test waits minutes for a compiler. NVMe offload's async_io op needs libaio, installed with apt
# when running as root; without it the NVMe training test skips (and impel's error names libaio-dev).
# `make deepspeed-ops` builds them all; `make test` builds the shared-memory op first and the async_io and
# pin-memory ops (minutes of compiling, for the NVMe test alone) in the background at low priority while the
# suite runs: the tiers that start ranks leave a third of the CPU idle. The DeepSpeed training tests run last,
# after that build has finished.
DS_OPS = env DS_ACCELERATOR=cpu $(BIN)/python -c "import sys; from deepspeed.accelerator import get_accelerator as acc; \
	op = acc().create_op_builder; aio = op('AsyncIOBuilder').is_compatible(verbose=False); \
	names = {'shm': ['ShareMemCommBuilder'], 'aio': aio * ['AsyncIOBuilder', 'PinMemoryBuilder']}; \
	[op(n).load(verbose=False) for key in sys.argv[1:] for n in names[key]]"
AIO_STATUS := $(VENV)/aio-ops.status
DS_TESTS := tests/multiprocess/test_deepspeed_training.py

deepspeed-ops: deepspeed-shm-op
	$(DS_OPS) aio

deepspeed-shm-op: venv
	@# a build killed midway leaves its lock file, and torch then waits for it forever: drop locks older than 30 min
	@find "$${TORCH_EXTENSIONS_DIR:-$$HOME/.cache/torch_extensions}" -name lock -mmin +30 -delete 2>/dev/null || true
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! dpkg -s libaio-dev >/dev/null 2>&1; then \
		(apt-get update -qq && apt-get install -y -qq libaio-dev >/dev/null) || echo "libaio-dev not installed"; fi
	$(DS_OPS) shm

# ruff -q prints nothing when clean; mypy checks impel/ only, its cache in the venv (a cold run: ~20 s of CPU)
lint: venv
	$(BIN)/ruff check -q .
	$(BIN)/mypy --cache-dir $(VENV)/.mypy_cache impel

# the documentation site (mkdocs.yml, docs/): a broken link, anchor or nav entry fails the build (~2 s); the site goes
# into the venv, outside the tracked tree. docs/cli.md is generated: tests/unit/test_docs.py checks it is current
docs: venv
	$(BIN)/mkdocs build --strict --quiet --site-dir $(abspath $(VENV))/site

# the unit tier (one process per test, mostly single-threaded) runs on both cores with pytest-xdist; the tiers that
# start ranks (tests/multiprocess, tests/cli) run one test at a time, so that each has the cores its ranks expect
test: venv deepspeed-shm-op lint docs
	rm -f $(AIO_STATUS)
	(nice -n 19 $(DS_OPS) aio > $(VENV)/aio-ops.log 2>&1; echo $$? > $(AIO_STATUS)) &
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 tests/unit
	$(BIN)/python -m pytest -q -p no:cacheprovider tests --ignore=tests/unit --ignore=$(DS_TESTS)
	@while [ ! -f $(AIO_STATUS) ]; do sleep 2; done; if [ "$$(cat $(AIO_STATUS))" != 0 ]; then \
		cat $(VENV)/aio-ops.log; echo "building DeepSpeed's async_io op failed (above)"; exit 1; fi
	$(BIN)/python -m pytest -q -p no:cacheprovider $(DS_TESTS)

demo: venv
	$(BIN)/impel launch --config_file examples/configs/ddp_cpu.yaml examples/train_genre_classifier.py

bench: venv
	$(BIN)/python -m pip install -q -e '.[bench]' $(TORCH)
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) build *.egg-info
