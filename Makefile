# elastictrain: `make install` once, then `make run` or `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The venv's bin first, as in an activated shell: pip's ninja there, not the system's, builds DeepSpeed's
# ops; two ninja versions each rebuild every op the other built (minutes each).
IN_VENV = PATH="$(abspath $(BIN)):$$PATH"
# The CPU build of torch lies on these machines' disk; an unpinned torch would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: install system-deps run test test-unit lint bench clean

install: system-deps $(BIN)/elastictrain
	$(IN_VENV) $(BIN)/elastictrain build-ops

$(BIN)/elastictrain: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]" "$(TORCH)"
	touch $@

# libaio headers let DeepSpeed build its async_io op (NVMe offload). Installed only when we are root.
system-deps:
	@if [ -e /usr/include/libaio.h ]; then echo "libaio-dev present"; \
	elif [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq libaio-dev; \
	else echo "warning: libaio-dev missing and not root: NVMe offload will not work (apt-get install libaio-dev)"; fi

run: $(BIN)/elastictrain
	$(IN_VENV) $(BIN)/elastictrain train -c conf/tiny-cpu.yaml $(ARGS)

test: $(BIN)/elastictrain
	$(IN_VENV) $(BIN)/pytest -q -ra $(PYTEST_ARGS)

test-unit: $(BIN)/elastictrain
	$(IN_VENV) $(BIN)/pytest -q -m "not integration" $(PYTEST_ARGS)

lint: $(BIN)/elastictrain
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

bench: $(BIN)/elastictrain
	$(IN_VENV) $(BIN)/python -m benchmarks.run $(ARGS)

clean:
	rm -rf runs .pytest_cache .ruff_cache
