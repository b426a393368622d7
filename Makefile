# `make train` and `make test` set everything up themselves on a fresh machine: a .venv and the package, pinned
# by constraints.txt (CPU torch where there is no GPU, no CUDA downloads). `make train` installs only what the
# main job needs; `make test` adds the test, lint and peer-library extras. The `vitkit` command lives in
# .venv/bin: `source .venv/bin/activate` puts it on a shell's PATH, and the set-up targets say so when they end.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
DEV_STAMP := $(VENV)/.installed-dev-stamp
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
# printed in single quotes: no apostrophe in it
ON_PATH := vitkit is installed in $(VENV)/bin: run `source $(VENV)/bin/activate` to put it on your PATH (once in \
each new shell); the vitkit commands in the README then work as written

.PHONY: install install-dev train test lint docs format bench clean

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e .
	@touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	@touch $(DEV_STAMP)

install: $(STAMP)
	@echo '$(ON_PATH)'

install-dev: $(DEV_STAMP)
	@echo '$(ON_PATH)'

train: $(STAMP)
	$(VENV)/bin/vitkit train $(ARGS)
	@echo '$(ON_PATH)'

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check vitkit tests benchmarks
	$(VENV)/bin/ruff format --check vitkit tests benchmarks
	$(VENV)/bin/mypy

format: $(DEV_STAMP)
	$(VENV)/bin/ruff check --fix vitkit tests benchmarks
	$(VENV)/bin/ruff format vitkit tests benchmarks

# the documentation (docs/, mkdocs.yml), with the API reference read from this tree's docstrings; --strict turns
# every warning (a broken link, an API name that no longer exists) into a failure. `$(VENV)/bin/mkdocs serve`
# previews it.
docs: $(DEV_STAMP)
	$(VENV)/bin/mkdocs build --strict --quiet --site-dir build/site

# about 8 minutes on 2 quiet cores: two pytest workers (pytest-xdist), a test file each at a time; pytest prints a
# dot per test and the share of the suite done. TEST_WORKERS=1 runs it in one process.
TEST_WORKERS ?= 2
test: lint docs
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# one model's images/s, FLOPs, utilisation and memory (benchmarks/bench_vit.py --help), e.g.
# make bench ARGS="--model vit_s16 --compare hf"
bench: $(DEV_STAMP)
	$(PY) benchmarks/bench_vit.py $(ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
