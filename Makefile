# kvroute — the two commands a new machine needs: `make demo` and `make test`.
# Everything is installed into .venv; nothing has to be installed by hand beforehand.

PYTHON ?= python3
VENV   := .venv
BIN    := $(CURDIR)/$(VENV)/bin
STAMP  := $(VENV)/.deps-stamp
EXTRAS ?= test,dev,sim,events,gateway
RUN    := VIRTUAL_ENV=$(CURDIR)/$(VENV) PATH="$(BIN):$$PATH"
# The stable-ABI level of the extension: abi3-py310 on Python >= 3.10, where PyO3 can use the
# fast (vectorcall) calling convention — about 70 ns less per call — and abi3-py39 on 3.9.
ABI3    = $(shell $(BIN)/python -c 'import sys; print("abi3-py310" if sys.version_info >= (3, 10) else "abi3-py39")')

.PHONY: demo test test-rust test-python bench lint fmt build wheels clean

demo: build
	$(RUN) kvroute simulate

test: test-rust test-python

test-rust:
	cargo test --no-default-features --locked

test-python: build
	$(RUN) python -m pytest -q tests

bench: EXTRAS = test,dev,sim,events,gateway,bench
bench: build
	$(RUN) python -m pytest -q benches --benchmark-columns=min,median,mean,ops,rounds --benchmark-sort=name

lint: build
	cargo fmt --all -- --check
	cargo clippy --all-targets --locked -- -D warnings
	cargo clippy --all-targets --no-default-features --locked -- -D warnings
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
	$(RUN) maturin develop --release --locked -q -F pyo3/$(ABI3) --extras $(EXTRAS)

# Release wheels: one for every CPython >= 3.9, and a faster one pip prefers on >= 3.10.
wheels: $(STAMP)
	$(RUN) maturin build --release --locked -F pyo3/abi3-py39 -o dist
	$(RUN) maturin build --release --locked -F pyo3/abi3-py310 -o dist

clean:
	rm -rf $(VENV) target python/kvroute/_core*.so
