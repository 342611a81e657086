# make venv: build .venv (CPU torch pinned for the dev env); make test: venv + lint + docs + the test suite;
# make lint: ruff over the repository and mypy over impel/; make docs: the mkdocs site, warnings as errors;
# make demo: venv + the seed exercise (Trainer, genre classifier, 2 CPU ranks);
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

.PHONY: venv test lint docs demo bench clean deepspeed-ops

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
deepspeed-ops: venv
	@# a build killed midway leaves its lock file, and torch then waits for it forever: drop locks older than 30 min
	@find "$${TORCH_EXTENSIONS_DIR:-$$HOME/.cache/torch_extensions}" -name lock -mmin +30 -delete 2>/dev/null || true
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! dpkg -s libaio-dev >/dev/null 2>&1; then \
		(apt-get update -qq && apt-get install -y -qq libaio-dev >/dev/null) || echo "libaio-dev not installed"; fi
	DS_ACCELERATOR=cpu $(BIN)/python -c "from deepspeed.accelerator import get_accelerator as acc; \
		op = acc().create_op_builder; aio = op('AsyncIOBuilder').is_compatible(verbose=False); \
		[op(n).load(verbose=False) for n in ['ShareMemCommBuilder'] + aio * ['AsyncIOBuilder', 'PinMemoryBuilder']]"

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
test: venv deepspeed-ops lint docs
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 tests/unit
	$(BIN)/python -m pytest -q -p no:cacheprovider tests --ignore=tests/unit

demo: venv
	$(BIN)/impel launch --config_file examples/configs/ddp_cpu.yaml examples/train_genre_classifier.py

bench: venv
	$(BIN)/python -m pip install -q -e '.[bench]' $(TORCH)
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) build *.egg-info
