"""Seeded rollouts through real NeMo-Gym: a row lost to the endpoint and re-dispatched comes back with its
original seed and the same sample.

Our server over the tiny model (sampling at temperature 1) sits behind the fault gate, which Gym's
``vllm_model`` calls; a real NemoGym actor on real Ray runs the equivalence agent. The seed of each row
travels in ``responses_create_params.metadata.extra_body``, which ``vllm_model`` merges into its
chat-completions body, and our server samples that row from its own generator.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray

from gym_bridge.data import datum_from_gym_row
from gym_bridge.gym.protocol.numbering import mark_repeats, rollout_seed
from gym_bridge.gym.protocol.rows import row_seed
from gym_bridge.gym.servers.config_files import wheel_config_path
from gym_bridge.gym.servers.reaper import free_port
from gym_bridge.gym.transport.spinup import start_nemo_gym_actor
from gym_bridge.gym_versions import installed_gym
from gym_bridge.rollout.manager import RolloutManager
from gym_bridge.testing.fault_gate import FaultGate
from gym_bridge.testing.gym_rows import EQUIVALENCE_GYM_CONFIGS, N, gym_actor_config, make_manager, prompt
from gym_bridge.types import PromptGroupRecord

pytestmark = [pytest.mark.timeout(600), pytest.mark.gym, pytest.mark.slow]

RUN_SEED = 20261125


@pytest.fixture(scope="module")
def gate(tiny_sampling_policy, tmp_path_factory) -> Iterator[FaultGate]:
    gate = FaultGate(tiny_sampling_policy.root_url, free_port("127.0.0.1"), tmp_path_factory.mktemp("gate") / "gate.log")
    gate.start()
    gate.set("pass")
    yield gate
    gate.kill()


@pytest.fixture(scope="module")
def seeded_gym(ray_session, gate, tiny_tokenizer, tmp_path_factory) -> Iterator[Any]:
    config = gym_actor_config([gate.base_url], tmp_path_factory.mktemp("seeded-gym-logs")).model_copy(
        update={"config_paths": [str(wheel_config_path(p)) for p in EQUIVALENCE_GYM_CONFIGS], "request_timeout_s": 60}
    )
    actor = start_nemo_gym_actor(config, tiny_tokenizer)
    yield actor
    try:
        ray.get(actor.shutdown.remote(), timeout=120)
    finally:
        ray.kill(actor)


def manager(actor: Any, tokenizer: Any, seed: int | None) -> RolloutManager:
    """Rows re-sent up to 8 times with short backoffs; the first failed prompt stops the test."""
    return make_manager(actor, tokenizer, rollout_s=180, max_new_tokens=24, seed=seed, max_gym_row_attempts=8,
                        backoff_base_s=0.1, max_backoff_s=0.5, max_skipped_prompts=0,
                        max_consecutive_dropped_prompts=0)  # fmt: skip


def generated(record: PromptGroupRecord) -> list[list[int]]:
    """Each completion's generated token ids, in row order."""
    return [
        [t for m in c.message_log if m["role"] == "assistant" for t in m["token_ids"].tolist()]
        for c in record.completions
    ]


async def test_a_redispatched_row_keeps_its_seed_and_regenerates_the_same_sample(seeded_gym, gate, tiny_tokenizer):
    """Run 1: the group goes through cleanly. Run 2: the gate answers the first 3N chat calls with 500 (Gym's
    model client tries each call 3 times), so rows fail, are re-dispatched and meet other decode batches.
    Expected: every row has its derived seed, the same in both runs, and the same tokens; the group's N samples
    differ. Control: without a seed, the same group twice draws other tokens."""
    seeded = manager(seeded_gym, tiny_tokenizer, RUN_SEED)
    datum = prompt(3)
    clean = await seeded.run_rollout(datum)
    expected_seeds = [rollout_seed(RUN_SEED, datum["extra_env_info"], i) for i in range(N)]
    assert [c.seed for c in clean.completions] == expected_seeds
    assert [row_seed(c.env_extras or {}) for c in clean.completions] == expected_seeds, "Gym echoes the row's seed"
    assert len({tuple(t) for t in generated(clean)}) == N, "the N samples of a group must differ"

    before = gate.stats()["faulted"]
    gate.set("status", status=500, times=3 * N)
    try:
        again = await seeded.run_rollout(datum)
    finally:
        gate.set("pass")
    assert gate.stats()["faulted"] - before == 3 * N
    redispatched = seeded.stats.as_metrics().get("rollout/gym_row_redispatch_total", 0)
    assert redispatched >= 1, seeded.stats.as_metrics()
    assert [c.seed for c in again.completions] == expected_seeds
    assert generated(again) == generated(clean), "a re-dispatched seeded row must regenerate its sample"

    unseeded = manager(seeded_gym, tiny_tokenizer, None)
    first, second = [await unseeded.run_rollout(datum) for _ in range(2)]
    assert all(c.seed is None for c in first.completions)
    assert generated(first) != generated(second), "unseeded rows draw from the shared generator, which moves on"


async def test_identical_rows_are_one_task_rolled_out_twice_and_a_resend_counts_its_attempt(
    seeded_gym, gate, tiny_tokenizer
):
    """A dataset holding one row twice (:func:`mark_repeats`, as every row file is read): one ``_ng_task_index``,
    rollout indices 0..N-1 and N..2N-1, distinct seeds and distinct samples from the seeded server. Re-sent after
    the endpoint failed, a row keeps its rollout index and seed and carries ``_ng_attempt_index`` >= 1 (Gym's
    agents echo the row's ``_ng_*`` keys into their result)."""
    seeded = manager(seeded_gym, tiny_tokenizer, RUN_SEED)
    row = prompt(4)["extra_env_info"]
    first, second = mark_repeats([dict(row), dict(row)], [7, 8])
    a = await seeded.run_rollout(datum_from_gym_row(first, idx=7))
    b = await seeded.run_rollout(datum_from_gym_row(second, idx=8))
    echoed = [[c.env_extras or {} for c in record.completions] for record in (a, b)]
    assert [[e.get("_ng_task_index") for e in group] for group in echoed] == [[7] * N, [7] * N]
    assert [[e.get("_ng_rollout_index") for e in group] for group in echoed] == [list(range(N)), list(range(N, 2 * N))]
    assert not {c.seed for c in a.completions} & {c.seed for c in b.completions}
    assert generated(a) != generated(b), "the two repeats of one task draw different samples"
    assert not [k for r in (a, b) for k in r.rollout_metrics if "/_ng_" in k], "identity is not a verifier field"

    gate.set("status", status=500, times=3 * N)
    try:
        again = await seeded.run_rollout(datum_from_gym_row(second, idx=8))
    finally:
        gate.set("pass")
    resent = [c.env_extras or {} for c in again.completions]
    assert [e.get("_ng_rollout_index") for e in resent] == list(range(N, 2 * N))
    assert [c.seed for c in again.completions] == [c.seed for c in b.completions]
    assert generated(again) == generated(b)
    attempts = max(e.get("_ng_attempt_index", 0) for e in resent)
    if "_ng_attempt_index" in installed_gym().rollout_identity_keys:
        assert attempts >= 1, "a re-sent row counts its attempt"
    else:
        assert attempts == 0, f"{installed_gym().label} does not read _ng_attempt_index: none is stamped"
