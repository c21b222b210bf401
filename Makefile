# Every target sets itself up: `make demo` and `make test` work on a fresh clone.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev
DEMO_STAMP := $(VENV)/.installed-demo
DOCS_STAMP := $(VENV)/.installed-docs
EXTRAS ?= dev

.PHONY: venv demo test test-order check lint typecheck typing-tests docs bench-cpu clean

venv: $(STAMP)

# torch first: take the CPU wheel (2.13.0) unless a torch is already present, so that the
# package's `torch>=2.6` is met and no resolver picks a multi-GB CUDA build.
define install_torch
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --progress-bar on torch==2.13.0
endef

# What the tests, `make check` and the wheel test need: the dev extra (every other extra's
# packages pinned), torchtitan and Megatron-Core.
$(STAMP): pyproject.toml
	$(install_torch)
	$(BIN)/pip install --progress-bar on -e '.[$(EXTRAS)]'
	# torchtitan without its declared deps (datasets, wandb, tensorboard, torchdata): what
	# it imports on CPU is pinned in the torchtitan extra (in dev too).
	$(BIN)/pip install --progress-bar on --no-deps torchtitan==0.3.0
	# Megatron-Core the same way (what it imports on CPU is pinned in the megatron extra,
	# in dev too); its metadata asks for Python >= 3.12, the tests run it on this venv's.
	$(BIN)/pip install --progress-bar on --no-deps --ignore-requires-python megatron-core==0.19.2
	touch $(STAMP)

# The demo needs the package and its demo extra only (tqdm, matplotlib).
$(DEMO_STAMP): pyproject.toml
	$(install_torch)
	$(BIN)/pip install --progress-bar on -e '.[demo]'
	touch $(DEMO_STAMP)

$(DOCS_STAMP): $(STAMP)
	$(BIN)/pip install --progress-bar on -e '.[$(EXTRAS),docs]'
	touch $(DOCS_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/python -m moe_overlap demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

# Order independence (not run by CI; about three times `make test`): the suite with its test
# files in reverse order (`--reverse-files`, tests/conftest.py; each file's tests keep their
# order), then each test file alone in a fresh process. A test that passes only after, or
# only without, another depends on state a test left; tests/conftest.py already fails a test
# that leaves torch's process state changed (tests/torch_state.py). Runs both parts, lists
# the files that fail alone, and fails at the end if either part failed.
test-order: $(STAMP)
	@status=0; $(BIN)/python -m pytest -q --reverse-files || status=1; \
	failed=""; for f in $$(find tests -name 'test_*.py' | sort); do \
		echo "== $$f"; $(BIN)/python -m pytest -q "$$f" || failed="$$failed $$f"; \
	done; \
	if [ -n "$$failed" ]; then echo "failed alone:$$failed"; status=1; fi; \
	exit $$status

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy
	$(BIN)/pyright

check: lint typecheck

docs: $(DOCS_STAMP)
	$(BIN)/sphinx-build -W --keep-going -b html docs docs/_build/html

clean:
	rm -rf $(VENV) docs/_build .mypy_cache .pytest_cache .ruff_cache
