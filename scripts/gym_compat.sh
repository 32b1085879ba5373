#!/usr/bin/env bash
# One lane of `make test-gym-compat`: the Gym tests on an older nemo-gym, in its own environment .venv-gym-VERSION.
#   0.5.1: NeMo-RL HEAD's Gym, on the default Python (>= 3.13.14). The locked environment (nemo-gym 0.7.0) is
#          synced; gym-bridge is installed again over it, then nemo-gym 0.5.1 is installed (as NeMo-RL's environment
#          has it) and gym-bridge again: the lane fails unless each install keeps that Gym (no downgrade) and
#          `uv pip check` finds no conflict.
#   0.4.0: on Python 3.12, where the lock itself resolves nemo-gym 0.4.0.
# Then it runs the Gym-marked tests and the Gym unit tests (marker gym_layer, tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?usage: scripts/gym_compat.sh 0.5.1|0.4.0}
UV=${UV:-uv}
VENV=.venv-gym-$VERSION
say() { echo "[gym-compat $VERSION] $*" >&2; }

python312() {  # a Python 3.12: $GYM_BRIDGE_PYTHON312, one uv finds, a pyenv version, else `uv python install`
    local found
    if [ -n "${GYM_BRIDGE_PYTHON312:-}" ]; then echo "$GYM_BRIDGE_PYTHON312"; return; fi
    if found=$($UV python find --no-project '>=3.12,<3.13' 2>/dev/null); then echo "$found"; return; fi
    if command -v pyenv >/dev/null; then
        found=$(ls -d "$(pyenv root)"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V | tail -n1)
        if [ -n "$found" ]; then echo "$found"; return; fi
    fi
    $UV python install --no-progress 3.12 >&2 && $UV python find --no-project '>=3.12,<3.13'
}

case "$VERSION" in
    0.5.1) python=$(bash scripts/python313.sh) ;;
    0.4.0) python=$(python312) ;;
    *) say "unsupported lane (0.5.1 or 0.4.0)"; exit 2 ;;
esac

say "environment $VENV on $("$python" --version)"
UV_PROJECT_ENVIRONMENT=$VENV $UV sync --locked --quiet --python "$python"
gym_version() { "$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("nemo-gym"))'; }
if [ "$VERSION" = 0.5.1 ]; then
    for gym in 0.7.0 "$VERSION"; do  # the lock's 0.7.0 first, then NeMo-RL's 0.5.1: installing gym-bridge keeps each
        $UV pip install --quiet --python "$VENV/bin/python" "nemo-gym==$gym"
        $UV pip install --quiet --python "$VENV/bin/python" -e .
        [ "$(gym_version)" = "$gym" ] || { say "installing gym-bridge replaced nemo-gym $gym by $(gym_version)"; exit 1; }
    done
    # uv pip check, less what pyproject's override-dependencies leave out on purpose (triton, llm, llama-cpp-python)
    problems=$($UV pip check --python "$VENV/bin/python" 2>&1 | grep "^The package" | grep -vE "requires \`(triton|llm|llama-cpp-python)" || true)
    [ -z "$problems" ] || { say "conflicts after installing gym-bridge over nemo-gym $VERSION:"; echo "$problems" >&2; exit 1; }
fi
installed=$(gym_version)
[ "$installed" = "$VERSION" ] || { say "expected nemo-gym $VERSION in $VENV, found $installed"; exit 1; }
say "nemo-gym $installed kept; running the Gym tests"

"$VENV/bin/python" -m pytest -n 2 --dist loadgroup -m gym_layer -q
