# Two commands for a newcomer (README "Quick start"):
#   make demo   set up everything, then run the main job (examples/generate.py)
#   make test   set up everything, then run the test suite
VENV ?= .venv
PYTHON := $(VENV)/bin/python
# The main job compares against plain transformers by default (identical tokens,
# and what the same limit does to it); `make demo DEMO_ARGS=` runs cxlalloc alone.
DEMO_ARGS ?= --compare

.PHONY: setup demo test lint format-check build clean dev-build coverage

setup:
	bash scripts/bootstrap.sh $(VENV)

demo: setup
	$(PYTHON) examples/generate.py $(DEMO_ARGS) $(ARGS)

test: setup lint
	$(PYTHON) -m pytest -q -ra --durations=25 tests $(ARGS)

# The linter (rules in pyproject.toml, [tool.ruff]); `make test` runs it first.
LINT_PATHS := cxlalloc cxlalloc_apps tests scripts examples
lint: setup
	$(VENV)/bin/ruff check $(LINT_PATHS)

# C++ formatting against .clang-format, only where clang-format is installed.
CPP_SOURCES = $(shell find csrc -name '*.cpp' -o -name '*.h')
format-check:
	@if ! command -v clang-format >/dev/null 2>&1; then \
		echo "format-check: clang-format not installed; skipped"; \
	elif [ ! -f .clang-format ]; then \
		echo "format-check: no .clang-format in the repository; skipped"; \
	else \
		clang-format --dry-run --Werror $(CPP_SOURCES); \
	fi

# The coverage matrix (docs/coverage.md, docs/coverage.json): every causal-LM / seq2seq
# architecture of the installed transformers, plain vs wrapped with KV spilling.  Reruns
# every architecture; `make coverage COVERAGE_ARGS=` resumes an interrupted run instead.
COVERAGE_ARGS ?= --force
coverage: setup
	$(PYTHON) scripts/coverage_matrix.py --jobs 2 $(COVERAGE_ARGS) $(ARGS)

# Rebuild the extension after editing csrc/ (setup already did it once).
build:
	$(PYTHON) -m pip install -q --no-build-isolation -e .

clean:
	rm -rf build *.egg-info cxlalloc/*.so

# Incremental rebuild for development (recompiles changed .cpp files only).
dev-build:
	CXLALLOC_INCREMENTAL=1 $(PYTHON) setup.py -q build_ext --inplace
