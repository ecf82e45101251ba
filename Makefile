# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.devshim-installed
DISTRIBUTIONS := -e . -e kernels -e plugins/cpu_reference -e plugins/ascend -e plugins/sophgo -e plugins/cuda -e emulation
# what the install builds: the native sources (kernels, the CUDA redirect's wrappers) are compiled by pip, so a
# change to them reinstalls (the emulator's C++ source, emulation/devshim_emulation/csrc, is not: the first
# DEVSHIM_EMULATE run compiles it into ~/.cache/devshim, keyed by its hash, and the editable install reads it in place)
BUILD_INPUTS := pyproject.toml kernels/pyproject.toml plugins/*/pyproject.toml emulation/pyproject.toml \
	requirements-dev.txt constraints.txt \
	build_support/* setup.py devshim_core/integrations/cuda_redirect/_native.c \
	devshim_core/integrations/torch_distributed/_shm_sync.c \
	$(wildcard kernels/setup.py kernels/devshim_kernels/_native/*.c kernels/devshim_kernels/_native/*.h)
# a test run never compiles DeepSpeed ops; a stray attempt would land here, not in ~/.cache
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions

# the oldest DeepSpeed devshim supports, in a venv of its own: CI's second DeepSpeed (requirements-deepspeed-oldest.txt)
OLDEST_DEEPSPEED := 0.16.0
OLDEST_VENV ?= .venv-deepspeed-$(OLDEST_DEEPSPEED)
OLDEST_STAMP := $(OLDEST_VENV)/.devshim-installed
# the oldest megatron-core devshim supports, likewise: CI's second megatron-core (requirements-megatron-oldest.txt)
OLDEST_MEGATRON := 0.12.1
MEGATRON_OLDEST_VENV ?= .venv-megatron-core-$(OLDEST_MEGATRON)
MEGATRON_OLDEST_STAMP := $(MEGATRON_OLDEST_VENV)/.devshim-installed

.PHONY: install demo megatron-demo test test-compare-matrix test-conformance test-deepspeed-oldest test-megatron-oldest test-wheels lint bench stress chaos docs clean

install: $(STAMP)

$(STAMP): $(BUILD_INPUTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt -c constraints.txt $(DISTRIBUTIONS)
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/devshim info
	# DEVSHIM_AUTO=1 covers the launcher process too: it sizes the job with devshim's device_count()
	DEVSHIM_AUTO=1 DEVSHIM_CPU_DEVICE_COUNT=$${DEMO_RANKS:-2} OMP_NUM_THREADS=1 $(VENV)/bin/deepspeed \
		--master_port $${DEMO_PORT:-29511} examples/train_gpt.py --zero-stage 2 --steps $${DEMO_STEPS:-30}

# a small GPT trained by megatron-core with TP 2 + sequence parallel on 2 ranks, through the selected plugin
megatron-demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc-per-node 2 --master-port $${DEMO_PORT:-29512} \
		examples/megatron_gpt.py --tp 2 --sequence-parallel --steps $${DEMO_STEPS:-6}

# the main suite, then the emulated-device suites, each vendor in a process of its own (one PrivateUse1 name
# per process); the emulator is built once into ~/.cache/devshim and shared by every run and e2e job
test: $(STAMP)
	$(PY) -m pytest -m "not compare_matrix" $(PYTEST_ARGS)
	DEVSHIM_EMULATE=ascend $(PY) -m pytest tests/emulated $(PYTEST_ARGS)
	DEVSHIM_EMULATE=sophgo $(PY) -m pytest tests/emulated $(PYTEST_ARGS)
	$(MAKE) test-conformance
	$(MAKE) test-deepspeed-oldest
	$(MAKE) test-megatron-oldest
	$(MAKE) test-wheels

# devshim compare's planted mistakes beyond what make test runs (megatron-core on the emulated npu, and the
# reference-kernels spec): the three scripts on the host CPU, DeepSpeed and HF on the emulated npu (~2.5 min)
test-compare-matrix: $(STAMP)
	$(PY) -m pytest tests/e2e/test_compare_faults.py -m compare_matrix $(PYTEST_ARGS)

# devshim's conformance kit (devshim_core.testing) on each of devshim's plugins, as a vendor runs it on its own;
# two devices each, so that its 2-rank DeepSpeed and Megatron jobs run; --noconftest: tests/conftest.py (loaded for
# testpaths before the kit replaces them) would clear the DEVSHIM_* switches set here
KIT := $(PY) -m pytest --noconftest $(PYTEST_ARGS) --devshim-plugin
test-conformance: $(STAMP)
	DEVSHIM_CPU_DEVICE_COUNT=2 $(KIT)=cpu_reference
	DEVSHIM_EMULATE=ascend DEVSHIM_EMULATE_DEVICES=2 $(KIT)=ascend
	DEVSHIM_EMULATE=sophgo DEVSHIM_EMULATE_DEVICES=2 $(KIT)=sophgo

$(OLDEST_STAMP): $(BUILD_INPUTS) requirements-deepspeed-oldest.txt
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(OLDEST_VENV)/bin/python -m pip install --quiet -r requirements-deepspeed-oldest.txt
	DS_BUILD_OPS=0 $(OLDEST_VENV)/bin/python -m pip install --quiet --no-deps --no-build-isolation \
		deepspeed==$(OLDEST_DEEPSPEED)
	$(OLDEST_VENV)/bin/python -m pip install --quiet --no-deps $(DISTRIBUTIONS)
	touch $(OLDEST_STAMP)

# the DeepSpeed runs again on the oldest supported DeepSpeed (cpu), the features newer releases removed, and the
# ZeRO-3 gather-order patch only older releases need
test-deepspeed-oldest: $(OLDEST_STAMP)
	$(OLDEST_VENV)/bin/python -m pytest tests/e2e/test_deepspeed_reference.py tests/e2e/test_deepspeed_legacy.py \
		tests/test_deepspeed_gather_order.py \
		-k "not npu" $(PYTEST_ARGS)

$(MEGATRON_OLDEST_STAMP): $(BUILD_INPUTS) requirements-megatron-oldest.txt
	$(PYTHON) -m venv $(MEGATRON_OLDEST_VENV)
	$(MEGATRON_OLDEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(MEGATRON_OLDEST_VENV)/bin/python -m pip install --quiet -r requirements-megatron-oldest.txt
	$(MEGATRON_OLDEST_VENV)/bin/python -m pip install --quiet --no-deps megatron-core==$(OLDEST_MEGATRON)
	$(MEGATRON_OLDEST_VENV)/bin/python -m pip install --quiet --no-deps $(DISTRIBUTIONS)
	touch $(MEGATRON_OLDEST_STAMP)

# megatron-core's end-to-end suite (every 2-rank parallel layout, context parallelism, resume) and the fused paths
# again on the oldest supported megatron-core, on the host CPU and the emulated npu (MindSpeed's device); the 4-rank
# layouts run on the newest only (CI's time)
test-megatron-oldest: $(MEGATRON_OLDEST_STAMP)
	$(MEGATRON_OLDEST_VENV)/bin/python -m pytest tests/e2e/test_megatron_training.py tests/test_megatron_fused_paths.py \
		tests/test_megatron_moe_fused.py -k "not tpu and not 4_ranks" $(PYTEST_ARGS)

# every distribution built as a release (python -m build: sdist, then the wheel from it) and installed, not
# editable, into a fresh venv: metadata, devshim info, the DEVSHIM_AUTO .pth, the 2-rank demo, uninstall (~1 min)
test-wheels: $(STAMP)
	$(PY) release/check_wheels.py

# ratios against the peers measured in the same run; writes bench/results.json (about 20 minutes)
# the README's summary and docs/performance.md's tables are then rewritten from bench/results.json
bench: $(STAMP)
	$(PY) -m bench $(BENCH_ARGS)
	$(PY) -m bench.report --write

# the exit stress loop, kept out of CI: short 2-rank jobs, counting ranks that abort after succeeding (the full
# record in docs/running-at-scale.md is `python -m stress --jobs 200 --control 100`)
stress: $(STAMP)
	$(PY) -m stress --jobs $${STRESS_JOBS:-40} --control $${STRESS_CONTROL:-0}

# the chaos loop, kept out of CI: 2-rank DeepSpeed and megatron-core jobs under seeded random faults (a killed rank,
# a full /dev/shm, a full checkpoint disk, a corrupted checkpoint; root for the mounts), then its record in
# docs/running-at-scale.md, written even when the loop found a failure (the exit status is the loop's)
chaos: $(STAMP)
	$(PY) -m stress.chaos --jobs $${CHAOS_JOBS:-50} --seed $${CHAOS_SEED:-0}; status=$$?; \
	$(PY) -m stress.chaos --markdown stress/chaos-results.json --write-doc && exit $$status

DOCS_VENV ?= .venv-docs
DOCS_STAMP := $(DOCS_VENV)/.devshim-docs-installed

$(DOCS_STAMP): requirements-docs.txt
	$(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(DOCS_VENV)/bin/python -m pip install --quiet -r requirements-docs.txt
	touch $(DOCS_STAMP)

# the docs site, built strictly (a broken link, anchor or docstring reference fails) into build/site; the patch
# table is first rewritten from the registry: docs/patches.md's header is kept, the rows below it regenerated; and the
# user guide's table of DEVSHIM_* switches from their declarations (devshim_core/switches.py), and the CUDA guide's
# table of what the redirect serves from its coverage (devshim_core/integrations/cuda_redirect/coverage.py)
docs: $(STAMP) $(DOCS_STAMP)
	mkdir -p build
	{ sed '/^| set |/,$$d' docs/patches.md && \
		PYTHONWARNINGS=ignore DEVSHIM_PLUGIN=cpu_reference $(VENV)/bin/devshim patches --markdown; } > build/patches.md
	mv build/patches.md docs/patches.md
	$(PY) docs_support/settings_table.py docs/user-guide.md
	$(PY) docs_support/cuda_table.py docs/cuda-scripts.md
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict --site-dir build/site

# ruff, then mypy over devshim_core, the kernels, the plugins and the emulator ([tool.mypy] in pyproject.toml; its
# cache is .mypy_cache: ~10 s cold on 2 cores, under a second warm)
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) $(OLDEST_VENV) $(MEGATRON_OLDEST_VENV) $(DOCS_VENV) build/site .pytest_cache
