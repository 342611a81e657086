# make venv: build .venv (CPU torch pinned for the dev env); make test: venv + the test suite;
# make demo: venv + a real training run; make bench: venv + benchmarks (not part of make test).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.impel-installed
TORCH  := torch==2.13.0
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: venv test demo bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[dev,examples]' $(TORCH)
	touch $(STAMP)

test: venv
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

demo: venv
	$(BIN)/impel launch --config_file examples/configs/ddp_cpu.yaml examples/train_causal_lm.py --max_steps 60

bench: venv
	$(BIN)/python -m pip install -q -e '.[bench]' $(TORCH)
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) build *.egg-info
