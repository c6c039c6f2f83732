# elastictrain: `make install` once, then `make run` or `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The venv's bin first, as in an activated shell: pip's ninja there, not the system's, builds DeepSpeed's
# ops; two ninja versions each rebuild every op the other built (minutes each).
IN_VENV = PATH="$(abspath $(BIN)):$$PATH"
# The CPU build of torch lies on these machines' disk; an unpinned torch would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: install system-deps run test test-unit test-bench test-compat lint bench clean image image-test gpu-kit \
	gpu-check docs docs-reference suite-timing

install: system-deps $(BIN)/elastictrain
	$(IN_VENV) $(BIN)/elastictrain build-ops

# constraints.txt: the exact releases of DeepSpeed and the core packages the suite was run with
# (pyproject.toml allows ranges; docs/reference/deepspeed-compatibility.md). TORCH overrides its line.
# A reinstalled DeepSpeed's ops are stale (its sources are newer than their build): built with the venv,
# not by the first test or run that loads one (minutes, while others wait on the build or fail to load).
$(BIN)/elastictrain: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	grep -v '^torch==' constraints.txt > $(VENV)/constraints.txt
	$(BIN)/pip install -q -c $(VENV)/constraints.txt -e ".[dev]" "$(TORCH)"
	$(IN_VENV) $(BIN)/elastictrain build-ops
	touch $@

# Installed with apt-get only when we are root; otherwise a warning says what is missing.
# libaio headers let DeepSpeed build its async_io op (NVMe offload). kubectl renders k8s/ with its
# built-in kustomize (tests/unit/test_k8s_manifests.py), which must be v5: Debian bookworm's own
# kubernetes-client is kubectl 1.20 with kustomize v2, so the `kubectl` package is taken where an
# apt source offers it, Debian's kubernetes-client otherwise (newer Debian releases carry 1.32).
system-deps:
	@if [ -e /usr/include/libaio.h ]; then echo "libaio-dev present"; \
	elif [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq libaio-dev; \
	else echo "warning: libaio-dev missing and not root: NVMe offload will not work (apt-get install libaio-dev)"; fi
	@if kubectl version --client 2>/dev/null | grep -q 'Kustomize Version: v[5-9]'; then echo "kubectl with kustomize v5+ present"; \
	elif [ "$$(id -u)" = 0 ]; then apt-get update -qq; \
	  if apt-cache policy kubectl | grep -q 'Candidate: [0-9]'; then apt-get install -y -qq kubectl; \
	  else apt-get install -y -qq kubernetes-client; fi; \
	  kubectl version --client | grep Kustomize; \
	else echo "warning: no kubectl with kustomize v5 and not root: the k8s manifest tests will skip"; fi

run: $(BIN)/elastictrain
	$(IN_VENV) $(BIN)/elastictrain train -c conf/tiny-cpu.yaml $(ARGS)

# The benchmark harnesses' own tests are `make test-bench`: every benchmark at its smallest size against
# the real peers, and the GPU check (its kit built and installed offline, every part run dry on CPU),
# about 7 minutes on 2 cores. They test benchmarks/, not the product; CI runs both targets. `make test`
# prints its 15 slowest tests (docs/contributing.md says why each stays).
BENCH_TESTS := tests/integration/test_benchmarks_smoke.py tests/integration/test_gpu_check_dry.py \
	tests/integration/test_gpu_kit.py

# Two pytest-xdist workers, a file on one worker (its module fixtures: one Ray cluster, one server): run in
# one process on 2 cores, 30-50% of the CPU stays idle (processes starting, servers, waits), which the other
# worker fills. TEST_WORKERS=0 runs it in one process. --no-loadscope-reorder: the files in the order
# tests/conftest.py gives them (the longest first); xdist's default runs the files with the most tests
# first, which left the longest single-test files for the end.
TEST_WORKERS ?= 2

test: $(BIN)/elastictrain
	$(IN_VENV) $(BIN)/pytest -q -ra --durations=15 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
	  $(addprefix --ignore=,$(BENCH_TESTS)) $(PYTEST_ARGS)

test-bench: $(BIN)/elastictrain
	$(IN_VENV) $(BIN)/pytest -q -ra $(BENCH_TESTS) $(PYTEST_ARGS)

# The tests that exercise elastictrain's patches (compat/) against another release of DeepSpeed or
# transformers, or both: `make test-compat DEEPSPEED=0.19.7` installs that DeepSpeed (no dependencies) into
# .compat/deepspeed-X, `TRANSFORMERS=5.25.0` that transformers into .compat/transformers-X with what of its
# dependencies this venv does not satisfy (compat/side_install.py). Each goes first on PYTHONPATH for pytest
# and the Ray workers it starts; DeepSpeed's JIT ops get their own cache (compat/deepspeed/ops.py keys it on
# the install's folder). Without either, the same tests against the installed ones. Releases that passed:
# docs/reference/deepspeed-compatibility.md.
DEEPSPEED ?=
TRANSFORMERS ?=
COMPAT_DIR = .compat/deepspeed-$(DEEPSPEED)
TF_COMPAT_DIR = .compat/transformers-$(TRANSFORMERS)
COMPAT_PATH = $(patsubst %:,%,$(if $(DEEPSPEED),$(abspath $(COMPAT_DIR)):)$(if $(TRANSFORMERS),$(abspath $(TF_COMPAT_DIR))))
COMPAT_ENV = $(if $(COMPAT_PATH),PYTHONPATH="$(COMPAT_PATH)$${PYTHONPATH:+:$$PYTHONPATH}") \
	$(if $(DEEPSPEED),ELASTICTRAIN_EXPECT_DEEPSPEED=$(DEEPSPEED)) \
	$(if $(TRANSFORMERS),ELASTICTRAIN_EXPECT_TRANSFORMERS=$(TRANSFORMERS))
COMPAT_TESTS := tests/unit/test_compat_registry.py tests/unit/test_compat_private_names.py \
	tests/unit/test_zero3_memory.py tests/unit/test_gloo_gather.py tests/unit/test_restore_build.py \
	tests/integration/test_zero3_build_patches.py tests/integration/test_zero_stages.py \
	tests/integration/test_offloaded_gradients.py tests/integration/test_engine_release.py \
	tests/integration/test_collective_release.py tests/integration/test_reshard.py \
	tests/integration/test_gloo_gather_pieces.py tests/integration/test_compat_workers.py

test-compat: $(BIN)/elastictrain
	@if [ -n "$(DEEPSPEED)" ] && [ ! -e $(COMPAT_DIR)/deepspeed/__init__.py ]; then \
	  $(IN_VENV) $(BIN)/pip install -q --no-deps --no-build-isolation --target $(COMPAT_DIR) "deepspeed==$(DEEPSPEED)"; fi
	@if [ -n "$(TRANSFORMERS)" ] && [ ! -e $(TF_COMPAT_DIR)/transformers/__init__.py ]; then \
	  $(BIN)/python -m elastictrain.compat.side_install "transformers==$(TRANSFORMERS)" $(TF_COMPAT_DIR); fi
	$(IN_VENV) $(COMPAT_ENV) $(BIN)/python -m elastictrain.compat.report
	$(IN_VENV) $(COMPAT_ENV) $(BIN)/elastictrain build-ops  # its ops before the tests (minutes, once a release)
	$(IN_VENV) $(COMPAT_ENV) $(BIN)/pytest -q -ra $(COMPAT_TESTS) $(PYTEST_ARGS)

test-unit: $(BIN)/elastictrain
	$(IN_VENV) $(BIN)/pytest -q -m "not integration" $(PYTEST_ARGS)

# Type-checked: the driver's decisions and the worker interface, so a renamed WorkerApi method or a
# wrong field fails here, where the call is written.
TYPED := src/elastictrain/core src/elastictrain/control src/elastictrain/cluster/worker_api.py \
	src/elastictrain/cluster/calls.py

lint: $(BIN)/elastictrain
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy --follow-imports=silent --ignore-missing-imports $(TYPED)

bench: $(BIN)/elastictrain
	$(IN_VENV) $(BIN)/python -m benchmarks.run $(ARGS)

# How long a test target takes (SUITE: test, test-unit, test-bench or test-compat): runs it and writes
# benchmarks/results/suite-timing.md and .json (wall and CPU time, per tier, the slowest tests).
SUITE ?= test-unit
suite-timing: $(BIN)/elastictrain
	$(IN_VENV) $(BIN)/python -m benchmarks.suite_timing $(SUITE)

# The manual (docs/, mkdocs.yml) as a site in site/; --strict: a broken link or a page missing from the
# nav fails. docs-reference regenerates the pages made from the config schema and the CLI.
docs: $(BIN)/elastictrain
	$(BIN)/python -m elastictrain.cli.reference_docs --check
	$(BIN)/mkdocs build --strict --site-dir site

docs-reference: $(BIN)/elastictrain
	$(BIN)/python -m elastictrain.cli.reference_docs

# The container image, built where no registry is reachable (a debootstrap base; see docker/build-image.sh),
# and run as users will: a Ray head and 2 workers in containers, elastic under docker kill / docker run.
IMAGE ?= elastictrain:0.1.0-cpu
image:
	bash docker/build-image.sh $(IMAGE)

image-test:
	bash docker/image-test.sh $(IMAGE)

# The GPU check (docs/gpu-check.md). `make gpu-kit` here gathers into .gpu-kit/ what the GPU machine lacks
# (cp312 wheels, libaio, a checkpoint saved on CPU) and fails when kit and working tree exceed 60 MiB;
# `make gpu-check` there installs it offline and runs every part; GPU_CHECK_DRY=1 runs them here on CPU.
GPU_KIT ?= .gpu-kit
GPU_CHECK_DRY ?= 0

gpu-kit: $(BIN)/elastictrain
	$(IN_VENV) $(BIN)/python -m benchmarks.gpu_check.kit build --kit $(GPU_KIT)
	mkdir -p $(GPU_KIT)/debs && cd $(GPU_KIT)/debs && { apt-get download libaio1 libaio-dev 2>/dev/null || \
	  { apt-get update -qq && apt-get download libaio1 libaio-dev; }; }
	$(IN_VENV) $(BIN)/python -m benchmarks.gpu_check.cross_device prepare --dest $(GPU_KIT)/cpu-checkpoint
	$(IN_VENV) $(BIN)/python -m benchmarks.gpu_check.kit size --kit $(GPU_KIT)

gpu-check:
	GPU_KIT=$(GPU_KIT) GPU_CHECK_DRY=$(GPU_CHECK_DRY) bash benchmarks/gpu_check/gpu-check.sh $(ARGS)

clean:
	rm -rf runs .pytest_cache .ruff_cache
