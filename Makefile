# The workbook's front door. `make help` lists the targets.
#
# Every target runs in one Python environment: .venv, created and filled from requirements.txt
# the first time a target needs it, or the interpreter given as PYTHON=/path/to/python (which must
# already have torch; no venv is created then). Everything built goes under build/.

SHELL := /bin/bash
.DEFAULT_GOAL := help

REPO := $(abspath $(dir $(lastword $(MAKEFILE_LIST))))
BUILD := $(REPO)/build
VENV := $(REPO)/.venv
BOOTSTRAP_PYTHON ?= python3

ifdef PYTHON
  PY := $(PYTHON)
  ENV_READY := env-check
else
  PY := $(VENV)/bin/python
  ENV_READY := $(VENV)/.installed
endif

# Builds: all cores unless MAX_JOBS says otherwise; caches and bytecode under build/; the
# interpreter's bin folder first on PATH, so torch finds the ninja installed beside it.
export MAX_JOBS ?= $(shell nproc 2>/dev/null || echo 2)
export WORKBOOK_BUILD_DIR := $(BUILD)
export TORCH_EXTENSIONS_DIR := $(BUILD)/jit
export PYTHONPYCACHEPREFIX := $(BUILD)/pycache
export TORCHINDUCTOR_CACHE_DIR := $(BUILD)/inductor
export PYTHONPATH := $(REPO)/common$(if $(PYTHONPATH),:$(PYTHONPATH))
export PATH := $(dir $(abspath $(PY))):$(PATH)

PYTEST := $(PY) -m pytest -p no:cacheprovider
STAGE := $(word 2,$(MAKECMDGOALS))

.PHONY: help stage test demo bench notebooks lab install cuda-toolkit doctor fix-abi clean distclean env env-check \
	1 2 3 4 5

help:
	@echo "PyTorch C++/CUDA extension workbook"
	@echo
	@echo "  make demo        build the stages this machine can build, check them, time them"
	@echo "  make test        build everything and run the whole test suite"
	@echo "  make stage N     build stage N (1-5) and run its tests, e.g. make stage 3"
	@echo "  make bench       time every stage against PyTorch and torch.compile (CPU; GPU if present), writes bench/results/"
	@echo "  make notebooks   execute every notebook headless (executed copies in build/notebooks/)"
	@echo "  make lab         open the notebooks in JupyterLab (installs it into the env on first use)"
	@echo "  make install     pip-install the production module (import lltm) into this Python"
	@echo "  make cuda-toolkit  install nvcc and CUDA headers from pip where no matching toolkit is found"
	@echo "  make doctor      check the build environment: torch and its ABI, compiler, ninja, CUDA, GPUs"
	@echo "  make fix-abi STAGE=N   repair a stage built with the wrong C++11 ABI (CHECK=1: only report)"
	@echo "  make env         create .venv and install requirements.txt (other targets do it too)"
	@echo "  make clean       remove build/ (every build output and JIT cache)"
	@echo "  make distclean   remove build/ and .venv"
	@echo
	@echo "  PYTHON=/path/to/python make ...   use that interpreter (with torch) instead of .venv"
	@echo "  MAX_JOBS=N make ...               parallel compile jobs (now $(MAX_JOBS))"

# -- environment ------------------------------------------------------------------------------

env: $(ENV_READY)

$(VENV)/.installed: requirements.txt scripts/bootstrap.sh
	@scripts/bootstrap.sh venv $(VENV) $(BOOTSTRAP_PYTHON)
	@touch $@

env-check:
	@scripts/bootstrap.sh check $(PY)

# -- building and testing ---------------------------------------------------------------------

# `make stage 3`: the number is a goal of its own, which does nothing (see the last rule).
stage: $(ENV_READY)
	@if [ -z "$(STAGE)" ]; then echo "usage: make stage N   (N = 1..5)"; exit 2; fi
	@$(PY) -m workbook.build $(STAGE)
	@$(PYTEST) $$(ls $(REPO)/tests/test_stage0$(STAGE)_*.py) -q -rs

test: $(ENV_READY)
	@$(PY) -m workbook.build all
	@$(PYTEST) $(REPO)/tests -q -rs

demo: $(ENV_READY)
	@$(PY) $(REPO)/scripts/demo.py

# BENCH_ARGS="--smoke" for a quick run, "--device cuda" for the GPU section only.
bench: $(ENV_READY)
	@$(PY) -m workbook.build all
	@$(PY) $(REPO)/bench/lltm_bench.py $(BENCH_ARGS)

# -- notebooks ---------------------------------------------------------------------------------

# Execute every notebook headless, each in a fresh Jupyter kernel of this interpreter with this
# environment; the executed copies go to build/notebooks/ (notebooks/ stays without outputs).
# NB=03 runs only the notebooks whose name contains 03.
notebooks: $(ENV_READY)
	@$(PY) $(REPO)/scripts/run_notebooks.py $(NB)

# JupyterLab on notebooks/, in this environment. Not a requirement: installed into the
# environment the first time `make lab` runs.
lab: $(ENV_READY)
	@$(PY) -c "import jupyterlab" 2>/dev/null || \
		$(PY) -m pip install --disable-pip-version-check --quiet jupyterlab
	@cd $(REPO)/notebooks && $(PY) -m jupyterlab

# -- the production module ----------------------------------------------------------------------

# Install the production module, stage 05, as the package `lltm`.
install: $(ENV_READY)
	@$(PY) -m pip install --no-build-isolation $(REPO)/stages/05_cuda_accessors

# nvcc and CUDA headers from pip wheels, matching torch's CUDA (a no-op where one is found).
cuda-toolkit: $(ENV_READY)
	@$(PY) -m workbook.toolkit install || echo "[cuda] no CUDA toolkit: stage 4 is skipped, stage 5 builds CPU-only"

# -- diagnosing and repairing the environment ----------------------------------------------

# No prerequisite: the doctor must run even where the environment cannot be made.
doctor:
	@py="$(PY)"; command -v "$$py" >/dev/null 2>&1 || py=$(BOOTSTRAP_PYTHON); "$$py" $(REPO)/scripts/doctor.py

# make fix-abi STAGE=N (a stage number or a path to an extension .so; without STAGE: every built
# stage); CHECK=1 only reports.
fix-abi: $(ENV_READY)
	@PYTHON="$(PY)" $(REPO)/scripts/fix_abi.sh $(if $(CHECK),--check) $(STAGE)

clean:
	rm -rf $(BUILD)

distclean: clean
	rm -rf $(VENV)

# The N of `make stage N`.
1 2 3 4 5:
	@case "$(firstword $(MAKECMDGOALS))" in stage|fix-abi) ;; *) echo "did you mean: make stage $@";; esac
