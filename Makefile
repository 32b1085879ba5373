# The two commands a new user runs: `make demo` and `make test`. Both set everything up first.
SHELL := /bin/bash
PYTHON ?= python3
export RAY_ENABLE_UV_RUN_RUNTIME_ENV := 0
export RAY_USAGE_STATS_ENABLED := 0
export TOKENIZERS_PARALLELISM := false

# uv from PATH when it runs, else the one `make setup` installs for this Python.
UV := $(shell uv --version >/dev/null 2>&1 && echo uv || echo "$(PYTHON) -m uv")

.PHONY: setup demo test clean bench-serve bench-bridge example-gym

setup:
	@$(UV) --version >/dev/null 2>&1 || $(PYTHON) -m pip install --quiet --disable-pip-version-check uv
	@$(UV) --version
	$(UV) sync --locked

demo: setup
	$(UV) run gym-bridge eval examples/eval_smollm2.yaml output_dir=runs/demo-$$(date +%Y%m%d-%H%M%S)

test: setup
	$(UV) run pytest

clean:
	rm -rf .venv .pytest_cache

bench-serve: setup
	$(UV) run python benchmarks/serve_throughput.py

bench-bridge: setup
	$(UV) run python benchmarks/bridge_throughput.py

example-gym: setup
	$(UV) run python examples/nemo_gym_rollout.py examples/nemo_gym_grpo.yaml
