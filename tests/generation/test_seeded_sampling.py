"""Seeded sampling as vLLM does it, on our real server over the tiny model, and the seeds of Gym rows.

A seeded request draws from its own generator: the same seeded rows sent in another order, in other
batch company or one at a time give the same tokens; ``n`` choices of one seeded request differ and
repeat (choice ``i`` is seeded ``seed + i``, vLLM's parallel sampling). Gym rows get their seeds from
the run seed, the prompt's identity and the sample index, and gym-bridge's Gym model server hands a
row's seed to the endpoint's ``/v1/completions``.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gym_bridge.failures import InvalidGymRow
from gym_bridge.generation.hf import HFGeneration
from gym_bridge.generation.hf_config import HFGenerationConfig
from gym_bridge.gym.protocol.numbering import prompt_identity, rollout_seed
from gym_bridge.gym.protocol.rows import SEED_KEY, build_rows, row_seed, stamped_row
from gym_bridge.serving import OpenAIServer
from gym_bridge.testing.gym_rows import equivalence_row
from gym_bridge.types import GenerationSamplingParams

MAX_TOKENS = 16
PROMPTS = [
    "Reply with exactly: 1",
    "What is 2+2?",
    "Name a colour.",
    "Count to three.",
    "Say hello.",
    "Pick a number between 1 and 9.",
]
SAMPLING = GenerationSamplingParams(temperature=1.0, top_p=1.0, top_k=None)


@pytest.fixture(scope="module")
def tiny_server(tiny_lm) -> Iterator[OpenAIServer]:
    """Our server over HFGeneration on the tiny model, sampling at temperature 1."""
    tokenizer, model = tiny_lm
    generation = HFGeneration(
        HFGenerationConfig(max_new_tokens=MAX_TOKENS, temperature=1.0, max_batch_size=32, seed=0),
        model=model,
        tokenizer=tokenizer,
    )
    server = OpenAIServer(generation, tokenizer, served_model_name="tiny")
    server.start_in_thread()
    yield server
    server.stop_thread()
    generation.shutdown()


def _engine(server: OpenAIServer) -> HFGeneration:
    generation = server.state.generation
    assert isinstance(generation, HFGeneration)
    return generation


async def _post(client: httpx.AsyncClient, route: str, body: dict[str, Any]) -> list[list[int]]:
    response = await client.post(route, json={"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 1.0, **body})
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    if route == "/completions":
        return [c["token_ids"] for c in choices]
    return [[int(t["token"].removeprefix("token_id:")) for t in c["logprobs"]["content"]] for c in choices]


def _body(route: str, k: int, seed: int | None) -> dict[str, Any]:
    fields: dict[str, Any] = {} if seed is None else {"seed": seed}
    if route == "/completions":
        return {"prompt": PROMPTS[k], "return_token_ids": True, **fields}
    return {
        "messages": [{"role": "user", "content": PROMPTS[k]}],
        "logprobs": True,
        "return_tokens_as_token_ids": True,
        **fields,
    }


@pytest.mark.parametrize("route", ["/completions", "/chat/completions"])
async def test_seeded_rows_repeat_in_any_order_and_batch_company(tiny_server, route):
    """Seeded rows sent (1) together, (2) shuffled among as many unseeded rows, (3) one at a time:
    the same tokens per seeded row, though they shared decode batches differently each time."""
    engine = _engine(tiny_server)
    seeds = {k: 1000 + 17 * k for k in range(len(PROMPTS))}
    async with httpx.AsyncClient(base_url=tiny_server.base_url, timeout=120) as client:
        engine.clear_logger_metrics()
        together = await asyncio.gather(*(_post(client, route, _body(route, k, seeds[k])) for k in seeds))
        assert engine.stats.max_rows_in_batch >= 2, "the concurrent requests never shared a decode batch"
        batch_together = engine.stats.max_rows_in_batch

        order = [(k, seeds[k]) for k in seeds] + [(k, None) for k in seeds]
        random.Random(7).shuffle(order)
        engine.clear_logger_metrics()
        mixed = await asyncio.gather(*(_post(client, route, _body(route, k, seed)) for k, seed in order))
        assert engine.stats.max_rows_in_batch > batch_together or engine.stats.rows_joined_running_batch > 0
        shuffled = {k: out for (k, seed), out in zip(order, mixed, strict=True) if seed is not None}

        engine.clear_logger_metrics()
        alone = [await _post(client, route, _body(route, k, seeds[k])) for k in seeds]
        assert engine.stats.max_rows_in_batch == 1

        unseeded = [await _post(client, route, _body(route, 0, None)) for _ in range(2)]

    for k in seeds:
        assert together[k] == shuffled[k] == alone[k], f"prompt {k} (seed {seeds[k]}) drew other tokens"
        assert len(together[k][0]) > 0
    assert len({tuple(out[0]) for out in together}) == len(PROMPTS)
    assert unseeded[0] != unseeded[1], "unseeded rows draw from the shared generator, which moves on"


async def test_n_choices_of_a_seeded_request_differ_and_repeat_as_in_vllm(tiny_server):
    """n=4 with a seed: four different samples; the same request again gives the same four; choice i is the
    single choice of the request seeded seed + i (vLLM gives child request i the seed seed + i)."""
    async with httpx.AsyncClient(base_url=tiny_server.base_url, timeout=120) as client:
        body = {**_body("/completions", 1, 42), "n": 4}
        first, second = await asyncio.gather(_post(client, "/completions", body), _post(client, "/completions", body))
        singles = [await _post(client, "/completions", _body("/completions", 1, 42 + i)) for i in range(4)]
        other_seed = await _post(client, "/completions", {**_body("/completions", 1, 4242), "n": 4})
    assert len({tuple(t) for t in first}) == 4, "the n choices of a seeded request must differ"
    assert first == second
    assert [s[0] for s in singles] == first
    assert other_seed != first


async def test_the_proxy_hands_each_choice_its_seed_upstream(tiny_server, tiny_lm):
    """Through ``build_proxy`` (OpenAIHTTPGeneration, one upstream /v1/completions per row): the same n seeded
    choices as from the upstream itself."""
    from gym_bridge.serving.upstream import build_proxy

    proxy = build_proxy([tiny_server.base_url], tiny_lm[0], upstream_model="tiny", max_model_len=2048)
    proxy.start_in_thread()
    try:
        body = {**_body("/completions", 4, 77), "n": 3}
        async with httpx.AsyncClient(base_url=proxy.base_url, timeout=120) as client:
            proxied = await _post(client, "/completions", body)
        async with httpx.AsyncClient(base_url=tiny_server.base_url, timeout=120) as client:
            direct = await _post(client, "/completions", body)
    finally:
        proxy.stop_thread()
        proxy.state.generation.shutdown()
    assert proxied == direct and len({tuple(t) for t in direct}) == 3


async def test_a_seed_outside_64_bits_is_a_400_naming_it(tiny_server):
    async with httpx.AsyncClient(base_url=tiny_server.base_url, timeout=30) as client:
        response = await client.post("/completions", json={"model": "tiny", "prompt": "hi", "seed": 2**63})
    assert response.status_code == 400 and "seed" in response.text


def test_engine_rejects_a_seed_that_is_not_an_int(tiny_lm):
    import torch

    from gym_bridge.batched import BatchedDataDict

    tokenizer, model = tiny_lm
    engine = HFGeneration(HFGenerationConfig(max_new_tokens=2), model=model, tokenizer=tokenizer)
    data = BatchedDataDict({"input_ids": torch.tensor([[5, 6]]), "input_lengths": torch.tensor([2]), "seed": ["7"]})
    with pytest.raises(ValueError, match=r"row 0: seed must be an int or None, got '7'"):
        engine.generate(data)


async def test_gym_model_server_hands_the_row_seed_to_the_completions_call(tiny_server, tiny_lm):
    """A Responses request whose metadata.extra_body carries a seed (as a stamped Gym row's does) is generated
    with that seed: the same tokens as a direct seeded /v1/completions call on the same prompt ids."""
    from gym_bridge.gym_model.app import GymModelServer
    from gym_bridge.gym_model.config import GymModelConfig

    tokenizer, _ = tiny_lm
    row = stamped_row(equivalence_row(PROMPTS[2], "x"), 0, SAMPLING, MAX_TOKENS, seed=987654321)
    body = row["responses_create_params"]
    server = GymModelServer(GymModelConfig(port=0, base_url=[tiny_server.base_url], model="tiny"), tokenizer)
    await server.start()
    try:
        answers = [await server.responses(json.loads(json.dumps(body)), f"s{i}") for i in range(2)]
        other = dict(body, metadata={"extra_body": json.dumps({SEED_KEY: 5})})
        different = await server.responses(other, "s3")
    finally:
        await server.client.close()
    tokens = [a["output"][-1]["generation_token_ids"] for a in answers]
    prompt_ids = answers[0]["output"][-1]["prompt_token_ids"]
    async with httpx.AsyncClient(base_url=tiny_server.base_url, timeout=60) as client:
        direct = await _post(
            client, "/completions", {"prompt": prompt_ids, "seed": 987654321, "return_token_ids": True}
        )
    assert tokens[0] == tokens[1] == direct[0]
    assert different["output"][-1]["generation_token_ids"] != tokens[0]


# ---------------------------------------------------------------- the seeds of Gym rows


def test_rollout_seeds_derive_from_run_seed_prompt_and_sample_index():
    row = equivalence_row("Reply with exactly: 3", "3")
    seeds = [rollout_seed(11, row, i) for i in range(8)]
    assert len(set(seeds)) == 8 and all(0 <= s < 2**63 for s in seeds)
    assert seeds == [rollout_seed(11, json.loads(json.dumps(row)), i) for i in range(8)], "key order must not matter"
    assert rollout_seed(12, row, 0) != seeds[0]
    assert rollout_seed(11, equivalence_row("Reply with exactly: 4", "4"), 0) != seeds[0]
    # The keys the bridge stamps (Gym's task numbering, the row index) are no part of the prompt's identity: a row's
    # seeds do not depend on its place in the file.
    indexed = {**row, "_ng_task_index": 5, "_ng_rollout_index": 2, "_rowidx": 3}
    assert prompt_identity(indexed) == prompt_identity(row)
    assert rollout_seed(11, indexed, 0) == seeds[0]


def test_build_rows_stamps_each_row_once_with_its_seed_and_keeps_the_template():
    template = equivalence_row("Reply with exactly: 3", "3")
    template["responses_create_params"]["metadata"] = {"extra_body": '{"top_k": 5}', "note": "kept"}
    before = json.dumps(template, sort_keys=True)
    rows = build_rows(template, 4, SAMPLING, 32, run_seed=11)
    assert json.dumps(template, sort_keys=True) == before, "the template must not change"
    assert [row_seed(r) for r in rows] == [rollout_seed(11, template, i) for i in range(4)]
    metadata = rows[2]["responses_create_params"]["metadata"]
    assert metadata["note"] == "kept" and json.loads(metadata["extra_body"])["top_k"] == 5
    assert all(isinstance(v, str) for v in metadata.values()), "Gym's metadata values are strings"
    assert [row_seed(r) for r in build_rows(template, 4, SAMPLING, 32)] == [None] * 4
    assert rows == build_rows(template, 4, SAMPLING, 32, run_seed=11), "stamping is a pure function of the row"


def test_a_row_whose_extra_body_is_not_a_json_object_is_named():
    row = equivalence_row("q", "a")
    row["responses_create_params"]["metadata"] = {"extra_body": "[1, 2]"}
    with pytest.raises(InvalidGymRow, match=r"metadata.extra_body must be a JSON object"):
        build_rows(row, 2, SAMPLING, 32, run_seed=1)


# ---------------------------------------------------------------- who sets the run seed


def test_grpo_seed_reaches_the_nemo_gym_backend_and_a_bad_one_is_named():
    from gym_bridge.config.keys import TrainingConfigError
    from gym_bridge.config.training import nemo_gym_rollout_settings

    config = yaml.safe_load((Path(__file__).parents[2] / "examples" / "nemo_gym_grpo.yaml").read_text())
    config.setdefault("grpo", {})["seed"] = 1234
    urls = ["http://127.0.0.1:9/v1"]
    assert nemo_gym_rollout_settings(config, base_urls=urls).launch.manager_options.seed == 1234
    config["grpo"]["seed"] = "abc"
    with pytest.raises(TrainingConfigError, match=r"grpo.seed must be an int, got 'abc'"):
        nemo_gym_rollout_settings(config, base_urls=urls)


@pytest.mark.parametrize("seed", [None, 0, 7])
def test_one_run_seed_reaches_torch_the_engine_the_loop_and_the_rows(tmp_path, seed):
    """grpo.seed has one reader: with the key left out, torch (GRPORunSettings.seed, which start_grpo_run seeds
    torch with), the engine, the loop and every row's sampling seed all take the same default, as they take a set
    value; before, the rows went unseeded while torch and the engine took 0."""
    from gym_bridge.config.run_settings import grpo_run_settings

    config = yaml.safe_load((Path(__file__).parents[2] / "examples" / "nemo_gym_grpo.yaml").read_text())
    grpo = config.setdefault("grpo", {})
    grpo["num_prompts_per_step"] = 2
    grpo.pop("seed", None)
    if seed is not None:
        grpo["seed"] = seed
    config["data"] = {"path": str(Path(__file__).parents[2] / "examples" / "data" / "gym_rows.jsonl")}
    settings = grpo_run_settings(config)
    expected = 0 if seed is None else seed
    assert settings.seed == expected
    assert settings.engine.seed == expected and settings.loop.seed == expected
    assert settings.rollout.launch.manager_options.seed == expected
    from gym_bridge.config.training import DEFAULT_SEED
    from gym_bridge.training.loop_config import GRPOLoopConfig

    assert GRPOLoopConfig().seed == DEFAULT_SEED  # a hand-built loop config seeds as a config without the key
    resumed = settings.resumed_from(str(tmp_path), step=3)
    assert resumed.engine.seed == expected + 3 and resumed.policy.model == str(tmp_path)


def test_eval_seed_is_the_run_seed_of_the_backend(tmp_path):
    from gym_bridge.eval.config import build_config
    from gym_bridge.eval.gym_launch import launch_spec

    base = {"dataset": str(tmp_path / "rows.jsonl"), "config_paths": ["x.yaml"], "output_dir": str(tmp_path)}
    assert build_config(base).seed == 0
    for given in (None, 77):
        config = build_config(base, [f"seed={'null' if given is None else given}"])
        assert config.seed == given and config.fingerprint("sha")["seed"] == given
        assert launch_spec(config, ["http://127.0.0.1:9/v1"], []).manager_options.seed == given


def test_the_nemo_gym_backend_refuses_a_seed_that_is_not_an_int():
    from gym_bridge.rollout.nemo_gym import AsyncNemoGymRolloutImpl

    with pytest.raises(TypeError, match=r"seed must be an int or None, got '1'"):
        AsyncNemoGymRolloutImpl(
            None,
            {"nemo_gym": object()},
            2,
            1024,
            generation_config={"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8},
            seed="1",  # type: ignore[arg-type]
        )
