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

# The stages are the folders stages/NN_name (each described by its stage.toml): `make stage 6`
# and `make stage 06` both name stages/06_*. Nothing here lists them. (sort drops the duplicates
# of numbers without a leading 0, such as 10, which a rule may not name twice.)
STAGE_FOLDERS := $(notdir $(wildcard $(REPO)/stages/[0-9][0-9]_*))
STAGE_NUMBERS := $(foreach f,$(STAGE_FOLDERS),$(shell echo $(f) | cut -c1-2))
STAGE_GOALS := $(sort $(STAGE_NUMBERS) $(patsubst 0%,%,$(STAGE_NUMBERS)))
STAGE := $(word 2,$(MAKECMDGOALS))

.PHONY: help stage test check demo bench bench-abi notebooks lab install wheel abi-check cuda-toolkit doctor fix-abi \
	diff new-stage \
	lint gpu-check test-template test-standalone fuzz sanitize racecheck exercise verify test-exercises \
	nvcc-check \
	book book-check \
	clean \
	distclean env \
	env-check $(STAGE_GOALS)

help:
	@echo "PyTorch C++/CUDA extension workbook"
	@echo
	@echo "  make demo        build what this machine runs (CPU-only without a GPU), check each op, time it"
	@echo "  make test        build everything and run the whole test suite (without a GPU: the CUDA"
	@echo "                   stages CPU-only, their kernels on the emulated device)"
	@echo "  make nvcc-check  the CUDA stages built with nvcc, loaded, their CUDA kernels registered (what"
	@echo "                   make test leaves out without a GPU; CI runs it)"
	@echo "  make check       the contributor's loop: builds and tests what your changes can break (the"
	@echo "                   stages, tests/ files and notebooks they reach; a kernel under the sanitizers),"
	@echo "                   saying why; BASE=origin/main: a branch's changes; DRY=1: the plan only"
	@echo "  make test-template   new-stage and a copied stage, built and tested in a copy of the repo"
	@echo "  make test-standalone make racecheck and make sanitize, each on one stage into an empty build"
	@echo "                   folder: the checks stand alone (CI runs it first)"
	@echo "  make stage N     build stage N and run its tests, e.g. make stage 3"
	@echo "  make fuzz        thousands of random inputs per op against its float64 reference (minutes)"
	@echo "  make sanitize    the stages' C++ built with ASan+UBSan (build/sanitize/), their tests run on it"
	@echo "                   the default: stages with their own CPU C++, gradchecks left out (minutes);"
	@echo "                   FULL=1: every stage, every test (most of an hour on 2 cores)"
	@echo "  make racecheck   every stage's CUDA kernels on the emulated device under ThreadSanitizer (N: one):"
	@echo "                   a race between two emulated threads is reported with both lines (minutes)"
	@echo "  make diff N      the lesson of stage N: its files against the stage before, side by side in diff -u"
	@echo "                   (the exercises' solutions folded; SOLUTIONS=1 shows them)"
	@echo "  make exercise N  your copy of stage N to write, exercises/NN_name/, its exercises as TODOs"
	@echo "                   RESET=1: start afresh; REVEAL=name: put one solution in (REVEAL=all: every one)"
	@echo "                   diff -ru stages/NN_name exercises/NN_name shows the solutions"
	@echo "  make verify N    build your copy of stage N and run the stage's tests on it"
	@echo "  make test-exercises  every stage carved: each copy builds and fails its tests"
	@echo "  make bench       time every op against its baselines (CPU; GPU if present), writes bench/results/"
	@echo "  make bench-abi   the stable ABI's cost: stage 10's extops against the ATen build's (09), interleaved"
	@echo "                   OP=name for one op (OP=lltm, OP=deform_conv2d); BENCH_ARGS=--smoke for a quick run"
	@echo "  make notebooks   execute every notebook headless (executed copies in build/notebooks/)"
	@echo "  make lab         open the notebooks in JupyterLab (installs it into the env on first use)"
	@echo "  make book        the workbook as a static site, build/book/index.html: lessons, diffs,"
	@echo "                   executed notebooks with their pictures (executes stale notebooks first)"
	@echo "  make book-check  make book, then its link/image test and every page in headless Chromium"
	@echo "  make new-stage NAME=my_op   start a stage of your own from the production pattern"
	@echo "  make lint        ruff (Python) and clang-format (C++/CUDA) over the tree"
	@echo "  make gpu-check   on a GPU machine: build, test, sanitize and time the CUDA stages (OUT=dir)"
	@echo "  make install     pip-install the production library into this Python"
	@echo "  make wheel       the stable-ABI library (stage 10) as one abi3 wheel, in dist/"
	@echo "  make abi-check   that wheel, built once, tested under two torch versions (TORCH=2.x.y)"
	@echo "  make cuda-toolkit  install nvcc and CUDA headers from pip where no matching toolkit is found"
	@echo "  make doctor      check the build environment: torch and its ABI, compiler, ninja, CUDA, GPUs"
	@echo "  make fix-abi STAGE=N   repair a stage built with the wrong C++11 ABI (CHECK=1: only report)"
	@echo "  make env         create .venv and install requirements.txt (other targets do it too)"
	@echo "  make clean       remove build/ (every build output and JIT cache) and build-standalone/"
	@echo "  make distclean   remove build/ and .venv"
	@echo
	@echo "  PYTHON=/path/to/python make ...   use that interpreter (with torch) instead of .venv"
	@echo "  MAX_JOBS=N make ...               parallel compile jobs (now $(MAX_JOBS))"
	@echo
	@echo "The stages (found in stages/, each described by its stage.toml):"
	@$(BOOTSTRAP_PYTHON) -m workbook.build.stages || echo "  (could not read them: see the error above)"

# -- environment ------------------------------------------------------------------------------

env: $(ENV_READY)

$(VENV)/.installed: requirements.txt requirements-book.txt scripts/bootstrap.sh
	@scripts/bootstrap.sh venv $(VENV) $(BOOTSTRAP_PYTHON)
	@touch $@

env-check:
	@scripts/bootstrap.sh check $(PY)

# -- building and testing ---------------------------------------------------------------------

# `make stage 3`: the number is a goal of its own, which does nothing (see the last rule). Each
# stage's tests run in a pytest process of their own (python -m workbook.testing.suite says why).
stage: $(ENV_READY)
	@if [ -z "$(STAGE)" ]; then echo "usage: make stage N   (N: one of $(patsubst 0%,%,$(STAGE_NUMBERS)))"; exit 2; fi
	@$(PY) -m workbook.build $(STAGE)
	@$(PY) -m workbook.testing.suite $(STAGE)

test: $(ENV_READY)
	@$(PY) -m workbook.build all
	@$(PY) -m workbook.testing.suite all

# Where no GPU is visible, make test builds the CUDA stages that have a CPU fallback CPU-only and
# runs their CUDA tests on the emulated device (workbook.build.emulate.choose_builds): this builds
# them with nvcc, as a GPU machine does, and checks each loads with its CUDA kernels.
nvcc-check: $(ENV_READY)
	@$(PY) -m workbook.build.nvcc_check

# What the working tree's changes (against HEAD, or BASE=ref) can break, built and tested; the plan
# and why first (workbook.testing.check says how it chooses). FILES="a b": as if only those changed.
check: $(ENV_READY)
	@$(PY) -m workbook.testing.check $(if $(BASE),--base $(BASE)) \
		$(if $(filter 1 yes true,$(DRY)),--dry-run) $(FILES)

# pytest-xdist's workers for the checks made of a few long tests (each mostly one process on one
# core): as many as make test runs parts side by side (WORKBOOK_TEST_JOBS, else the cores, at
# most 3).
SIDE_BY_SIDE := -n $(shell n=$${WORKBOOK_TEST_JOBS:-$$(nproc 2>/dev/null || echo 2)}; \
	[ "$$n" -gt 3 ] && [ -z "$$WORKBOOK_TEST_JOBS" ] && n=3; echo $$n)

# The template's own acceptance checks: `make new-stage` and a copied stage folder, each built and
# tested in a copy of the repository (a few minutes). CI runs them after `make test`.
test-template: $(ENV_READY)
	@$(PY) -m pytest -q -rs $(SIDE_BY_SIDE) -m template $(REPO)/tests

# The checks stand alone: racecheck and sanitize, each on one stage, into an empty build folder,
# as from a clean clone (tests/test_standalone.py). CI runs it first.
test-standalone: $(ENV_READY)
	@$(PY) -m pytest -q -rs -m standalone $(REPO)/tests/test_standalone.py

# Property-based fuzzing, the long run: thousands of hypothesis examples per op (sizes, dtypes,
# layouts, thread counts) against the float64 references, with hypothesis' statistics. `make
# test` runs the short pass of the same tests (tests/test_fuzz.py).
fuzz: $(ENV_READY)
	@$(PY) -m workbook.build all
	@WORKBOOK_FUZZ=long $(PY) -m pytest -q -rs --hypothesis-show-statistics $(REPO)/tests/test_fuzz.py

# The stages' C++ compiled with AddressSanitizer and UndefinedBehaviorSanitizer into build/sanitize/,
# and their tests run against it with the runtimes preloaded; any report fails the run.
# The default is a subset that fits CI; FULL=1 checks everything (workbook.net.sanitize says what).
sanitize: $(ENV_READY)
	@$(PY) -m workbook.net.sanitize $(if $(filter 1 yes true,$(FULL)),--full)

# The stages' CUDA kernels built for the emulated device with ThreadSanitizer into build/racecheck/,
# every emulated thread a thread of its own to the checker, and the stages' CUDA tests run on them:
# a race on shared or global memory fails the run with both lines (workbook.net.racecheck).
racecheck: $(ENV_READY)
	@$(PY) -m workbook.net.racecheck $(STAGE)

# -- exercises (workbook.teaching.exercises) ------------------------------------------------

# `make exercise 2`: exercises/02_lltm_cpp, stage 2 with every EXERCISE region of its sources a
# TODO; refuses to replace an existing copy unless RESET=1. REVEAL=name puts that exercise's
# solution into the copy (REVEAL=all: every one); VERIFY=1 tests the copy (= make verify 2).
exercise: $(ENV_READY)
	@if [ -z "$(STAGE)" ]; then echo "usage: make exercise N [RESET=1 | REVEAL=name | VERIFY=1]   (N: one of $(patsubst 0%,%,$(STAGE_NUMBERS)))"; exit 2; fi
	@if [ -n "$(VERIFY)" ]; then $(PY) -m workbook.teaching.exercises verify $(STAGE); \
	elif [ -n "$(REVEAL)" ]; then $(PY) -m workbook.teaching.exercises reveal $(STAGE) $(filter-out all,$(REVEAL)); \
	else $(PY) -m workbook.teaching.exercises carve $(STAGE) $(if $(filter 1 yes true,$(RESET)),--reset); fi

# `make verify 2`: builds exercises/02_lltm_cpp under build/exercises/ and runs stage 2's tests on it
# (PYTEST_ARGS="--tb=short -x": pytest options, say for the tracebacks; TEST='file::test[case]':
# that test alone; SANITIZE=1: built with ASan and UBSan, whose report names a bad access's line).
verify: $(ENV_READY)
	@if [ -z "$(STAGE)" ]; then echo "usage: make verify N [ONLY=exercise] [TEST=id] [SANITIZE=1]   (after make exercise N)"; exit 2; fi
	@$(PY) -m workbook.teaching.exercises verify $(STAGE) $(if $(ONLY),--only $(ONLY)) $(if $(TEST),--test '$(TEST)') $(if $(filter 1 yes true,$(SANITIZE)),--sanitize) $(if $(PYTEST_ARGS),-- $(PYTEST_ARGS))

# Every stage carved in a temporary folder and built under build/test-exercises/: the copy builds
# and fails the tests of its exercises (without a GPU the CUDA exercises run on the emulated CUDA
# device; with WORKBOOK_CUDA=off they are compiled, not run). 12 to 15 minutes on 2 cores with
# the compiler cache empty; not part of `make test`.
test-exercises: $(ENV_READY)
	@$(PY) -m pytest -q -rs $(SIDE_BY_SIDE) --durations=0 --durations-min=1 -m exercises \
		$(REPO)/tests/test_exercises.py

# `make diff 5`: what stage 5 changes, file against file (the pairs are in its stage.toml), the
# exercises' solutions folded; SOLUTIONS=1 shows them.
diff: $(ENV_READY)
	@if [ -z "$(STAGE)" ]; then echo "usage: make diff N"; exit 2; fi
	@$(PY) -m workbook.build.stages --diff $(STAGE) $(if $(filter 1 yes true,$(SOLUTIONS)),--solutions)

demo: $(ENV_READY)
	@$(PY) $(REPO)/scripts/demo.py

# OP=lltm for one op; BENCH_ARGS="--smoke" for a quick run, "--device cuda" for the GPU only,
# "--dtype bfloat16" for inputs in another dtype (a report of its own).
bench: $(ENV_READY)
	@$(PY) -m workbook.build all
	@$(PY) $(REPO)/bench/run.py $(if $(OP),--op $(OP)) $(BENCH_ARGS)
	@$(if $(OP),,$(PY) $(REPO)/bench/stable_abi.py $(if $(findstring --smoke,$(BENCH_ARGS)),--smoke))

# What the stable ABI costs: stage 10's extops against the newest ATen build's (stage 09), timed in turn in two processes.
# The two stages are the ones bench/stable_abi.py compares (found on disk), built first.
bench-abi: $(ENV_READY)
	@for n in $$($(PY) -c "import sys; sys.path[:0] = ['$(REPO)/bench']; import stable_abi; \
		print(*stable_abi.STAGES)"); do $(PY) -m workbook.build $$n || exit 1; done
	@$(PY) $(REPO)/bench/stable_abi.py $(BENCH_ARGS)

# -- notebooks ---------------------------------------------------------------------------------

# Execute every notebook headless, each in a fresh Jupyter kernel of this interpreter with this
# environment; the executed copies go to build/notebooks/ (notebooks/ stays without outputs).
# NB=03 runs only the notebooks whose name contains 03.
notebooks: $(ENV_READY)
	@$(PY) $(REPO)/scripts/run_notebooks.py $(NB)

# The book: a static site of the stage lessons, their diffs and the executed notebooks, under
# build/book/ (scripts/book.py says what goes in). It reuses the executed copies in
# build/notebooks/ that are current and executes the others; REUSE=1 takes them as they are.
# mistune and Pygments come from requirements-book.txt (requirements.txt includes it); with
# PYTHON=... they are installed on first use.
book: $(ENV_READY)
	@$(PY) -c "import mistune, pygments" 2>/dev/null || \
		$(PY) -m pip install --disable-pip-version-check --quiet -r $(REPO)/requirements-book.txt
	@$(PY) $(REPO)/scripts/book.py $(if $(filter 1 yes true,$(REUSE)),--reuse)

# The book checked: the link/image test (tests/test_book.py, against the book just built), then
# every page in headless Chromium (Debian's chromium), screenshots in build/book/shots/.
book-check: book
	@WORKBOOK_BOOK=$(BUILD)/book $(PY) -m pytest -q -rs $(REPO)/tests/test_book.py
	@$(PY) $(REPO)/scripts/book_browser.py --book $(BUILD)/book

# JupyterLab on notebooks/, in this environment. Not a requirement: installed into the
# environment the first time `make lab` runs.
lab: $(ENV_READY)
	@$(PY) -c "import jupyterlab" 2>/dev/null || \
		$(PY) -m pip install --disable-pip-version-check --quiet jupyterlab
	@cd $(REPO)/notebooks && $(PY) -m jupyterlab

# -- the production module ----------------------------------------------------------------------

# Install the production library (the last stage whose stage.toml says `production = true`).
install: $(ENV_READY)
	@$(PY) -m pip install --no-build-isolation "$$($(PY) -m workbook.build.stages --production)"

# The stable-ABI library (stage 10) as a wheel, in dist/: one build for every torch from 2.10 and
# every CPython from 3.10 (tagged cp310-abi3).
wheel: $(ENV_READY)
	@$(PY) -m pip wheel --no-build-isolation --no-deps -w $(REPO)/dist $(REPO)/stages/10_stable_abi
	@ls -1 $(REPO)/dist/*.whl

# That wheel, built once, tested under the pinned torch and under torch 2.13.0 (TORCH=2.x.y for
# another) in a venv kept in ~/.cache/workbook/abi-check/: scripts/abi_check.py says how.
abi-check: $(ENV_READY)
	@$(PY) $(REPO)/scripts/abi_check.py $(if $(TORCH),--torch $(TORCH))

# nvcc and CUDA headers from pip wheels, matching torch's CUDA (a no-op where one is found).
cuda-toolkit: $(ENV_READY)
	@$(PY) -m workbook.build.toolkit install || echo "[cuda] no CUDA toolkit: stage 4 is skipped, stage 5 builds CPU-only"

# -- diagnosing and repairing the environment ----------------------------------------------

# No prerequisite: the doctor must run even where the environment cannot be made.
doctor:
	@py="$(PY)"; command -v "$$py" >/dev/null 2>&1 || py=$(BOOTSTRAP_PYTHON); "$$py" $(REPO)/scripts/doctor.py

# make fix-abi STAGE=N (a stage number or a path to an extension .so; without STAGE: every built
# stage); CHECK=1 only reports.
fix-abi: $(ENV_READY)
	@PYTHON="$(PY)" $(REPO)/scripts/fix_abi.sh $(if $(CHECK),--check) $(STAGE)

clean:
	rm -rf $(BUILD) $(REPO)/build-standalone

distclean: clean
	rm -rf $(VENV)

# The GPU check in one command (scripts/device_check.sh says what it runs); OUT= for the results.
gpu-check: $(ENV_READY)
	@PYTHON="$(PY)" $(REPO)/scripts/device_check.sh

# -- your own stage, and keeping the tree tidy -------------------------------------------------

# make new-stage NAME=my_op: stages/NN_my_op from the production pattern (a small, working op).
new-stage: $(ENV_READY)
	@if [ -z "$(NAME)" ]; then echo "usage: make new-stage NAME=my_op"; exit 2; fi
	@$(PY) $(REPO)/scripts/new_stage.py $(NAME)

# ruff and clang-format, installed into the environment from requirements-dev.txt on first use.
lint: $(ENV_READY)
	@$(PY) -c "import ruff, clang_format" 2>/dev/null || \
		$(PY) -m pip install --disable-pip-version-check --quiet -r $(REPO)/requirements-dev.txt
	@$(PY) $(REPO)/scripts/lint.py

# The N of `make stage N`, `make diff N`.
$(STAGE_GOALS):
	@case "$(firstword $(MAKECMDGOALS))" in stage|fix-abi|diff|exercise|verify|racecheck) ;; *) echo "did you mean: make stage $@";; esac
