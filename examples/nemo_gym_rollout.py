"""Roll out a Gym dataset through NeMo-Gym from a NeMo-RL-style config.

    uv run python examples/nemo_gym_rollout.py examples/nemo_gym_grpo.yaml
    uv run python examples/nemo_gym_rollout.py examples/nemo_gym_grpo.yaml --base-url http://gpu-0:8000/v1

Without ``--base-url`` (and with no ``env.nemo_gym.base_urls``) it serves the
embedded tiny tokenizer with the scripted policy on 127.0.0.1, so everything runs
offline on a CPU: real Ray, real Gym servers, real HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from contextlib import ExitStack
from pathlib import Path

import yaml

from gym_bridge import (
    EngineSpec,
    ServeOptions,
    datum_from_gym_row,
    init_ray,
    nemo_gym_launch_spec,
    resolve_model_path,
    rows_use_tools,
    serve_engine,
    start_nemo_gym,
)


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(name))


async def run(config: dict, base_urls: list[str]) -> None:
    name = config["policy"]["model_name"]
    rows = [json.loads(line) for line in Path(config["data"]["path"]).read_text().splitlines() if line.strip()]
    with ExitStack() as stack:
        if not base_urls and not config["env"]["nemo_gym"].get("base_urls"):
            # The scripted policy on the model's tokenizer behind our OpenAI server, stopped when the block ends.
            served = stack.enter_context(
                serve_engine(EngineSpec(policy="scripted", model=name), ServeOptions(served_model_name=name))
            )
            tokenizer, base_urls = served.tokenizer, [served.base_url]
            print(f"serving the scripted policy at {base_urls[0]}")
        else:
            tokenizer = load_tokenizer(name)
        await roll_out(config, rows, tokenizer, base_urls)


async def roll_out(config: dict, rows: list[dict], tokenizer, base_urls: list[str]) -> None:
    # Checks every endpoint first (tools too when the rows offer them), then starts Gym and the manager.
    spec = nemo_gym_launch_spec(config, base_urls=base_urls or None, uses_tools=rows_use_tools(rows))
    rollouts = start_nemo_gym(spec, tokenizer)
    try:
        data = [datum_from_gym_row(row, idx=i) for i, row in enumerate(rows)]
        records = await asyncio.gather(*(rollouts.manager.run_rollout(datum) for datum in data))
        for record in records:
            agent = record.extra_env_info["agent_ref"]["name"]
            rewards = [c.reward for c in record.completions]
            turns = [sum(m["role"] == "assistant" for m in c.message_log) for c in record.completions]
            print(f"prompt {record.prompt_idx} ({agent}): rewards={rewards} model calls={turns}")
        summary = {
            key: value
            for key, value in records[0].rollout_metrics.items()
            if isinstance(value, float) and not key.endswith(("/max", "/min", "/median", "/stddev"))
        }
        print("metrics of prompt 0:", json.dumps(summary, indent=1))
    finally:
        rollouts.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--base-url", action="append", default=[], help="an OpenAI-compatible endpoint (repeatable)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    init_ray(num_cpus=2)
    asyncio.run(run(yaml.safe_load(Path(args.config).read_text()), args.base_url))


if __name__ == "__main__":
    main()
