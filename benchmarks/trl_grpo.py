"""TRL's ``GRPOTrainer`` on the train-demo's task, for the side-by-side in RESULTS.md.

    make bench-trl                     # 3 seeds, in its own environment .venv-trl (trl 1.16.0)
    uv run --group bench-trl python benchmarks/trl_grpo.py [--seeds 0 1 2] [--steps N]

Everything the comparison holds equal is read from ``examples/grpo_nemo_gym.yaml``: the rows
(the same 2-shot chat prompts), prompts per step and group size, learning rate, AdamW betas and
weight decay, gradient-norm clip, temperature, top-p, completion length, the frozen (tied)
embedding, the validation steps. The reward is Gym's own ``math_with_judge`` grader (its
last-``\\boxed{}`` rule and math-verify call, imported from the installed server), and
held-out accuracy is greedy, like our validation. ``beta=0``, ``num_iterations=1``,
``loss_type="dapo"`` (token-level, as NeMo-RL's ``token_level_loss``), a constant learning rate, fp32
without gradient checkpointing (TRL defaults to bf16 and checkpointing; both would change the comparison).
What differs: TRL's advantage is ``(r - group mean) / group std`` where ours uses NeMo-RL's
leave-one-out baseline; TRL generates with ``model.generate`` in the trainer's process, ours goes
through the Gym servers and our OpenAI server.

Writes one JSON per seed (``--out``, default ``runs/bench-trl``) with the held-out curves,
the reward and the wall time of every step; ``benchmarks/train_demo_report.py`` compares them
with a train-demo run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from datasets import Dataset
from math_verify.metric import math_metric
from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig
from resources_servers.math_with_judge.app import _extract_last_boxed_answer, _run_math_verify
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from gym_bridge.models.registry import resolve_model_path
from gym_bridge.training.validation import lenient_correct

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "grpo_nemo_gym.yaml"
EVAL_BATCH = 32

_VERIFIER = math_metric(
    gold_extraction_target=(LatexExtractionConfig(),),
    pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()),
)


def gym_math_reward(reply: str, expected: str) -> float:
    """Gym's ``math_with_judge`` without a judge: 0 unless the last ``\\boxed{}`` is non-empty, else math-verify."""
    boxed = _extract_last_boxed_answer(reply)
    if boxed is None or not boxed.strip():
        return 0.0
    return _run_math_verify(_VERIFIER, expected, reply)[0]


def reward_fn(completions: list[Any], expected_answer: list[str], **_: Any) -> list[float]:
    """TRL's reward-function contract over conversational completions."""
    return [gym_math_reward(c[-1]["content"], e) for c, e in zip(completions, expected_answer, strict=True)]


def load_rows(path: Path) -> list[dict[str, Any]]:
    """Gym rows as TRL's conversational dataset: the same input messages and the expected answer."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"prompt": r["responses_create_params"]["input"], "expected_answer": r["expected_answer"]} for r in rows]


class HeldOutEval(TrainerCallback):
    """Greedy held-out accuracy at step 0, every ``period`` steps and at the end; the wall time of every step."""

    def __init__(self, sets: dict[str, list[dict[str, Any]]], tokenizer: Any, period: int, max_new_tokens: int):
        self.sets, self.tokenizer, self.period, self.max_new_tokens = sets, tokenizer, period, max_new_tokens
        self.validations: list[dict[str, Any]] = []
        self.step_s: list[float] = []
        self._started = 0.0

    @torch.no_grad()
    def evaluate(self, model: Any, step: int) -> None:
        started = time.perf_counter()
        was_training = model.training
        model.eval()
        line: dict[str, Any] = {"step": step}
        for name, rows in self.sets.items():
            correct = lenient = boxed = tokens = 0
            for start in range(0, len(rows), EVAL_BATCH):
                batch = rows[start : start + EVAL_BATCH]
                texts = [
                    self.tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
                    for r in batch
                ]
                enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
                out = model.generate(**enc, do_sample=False, max_new_tokens=self.max_new_tokens,
                                     pad_token_id=self.tokenizer.pad_token_id)
                for row, ids in zip(batch, out[:, enc["input_ids"].shape[1]:], strict=True):
                    reply = self.tokenizer.decode(ids, skip_special_tokens=True)
                    correct += gym_math_reward(reply, row["expected_answer"]) >= 1.0
                    lenient += bool(lenient_correct(reply, row["expected_answer"]))
                    boxed += bool((_extract_last_boxed_answer(reply) or "").strip())
                    tokens += int((ids != self.tokenizer.pad_token_id).sum())
            prefix = "val" if name == "validation" else f"val/{name}"
            line.update({f"{prefix}/accuracy": correct / len(rows), f"{prefix}/lenient_accuracy": lenient / len(rows),
                         f"{prefix}/format_rate": boxed / len(rows), f"{prefix}/mean_tokens": tokens / len(rows)})
        line["time/val_s"] = time.perf_counter() - started
        self.validations.append(line)
        print(json.dumps(line), flush=True)
        model.train(was_training)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
        self.evaluate(model, 0)

    def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self._started = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
        self.step_s.append(time.perf_counter() - self._started)
        if state.global_step % self.period == 0 or state.global_step == state.max_steps:
            self.evaluate(model, state.global_step)


def run_seed(seed: int, cfg: dict[str, Any], steps: int, out: Path) -> dict[str, Any]:
    grpo, policy = cfg["grpo"], cfg["policy"]
    gen, opt = policy["generation"], policy["optimizer"]["kwargs"]
    root = CONFIG.parents[1]
    train = load_rows(root / cfg["data"]["train"]["data_path"])
    sets = {"validation": load_rows(root / cfg["data"]["validation"]["data_path"])}
    sets |= {name: load_rows(root / path) for name, path in cfg["data"]["validation"].get("extra_sets", {}).items()}

    model_dir = resolve_model_path(policy["model_name"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if policy.get("freeze_embeddings"):
        model.get_input_embeddings().weight.requires_grad_(False)
    group = grpo["num_generations_per_prompt"]
    per_step = grpo["num_prompts_per_step"] * group
    micro = policy["train_micro_batch_size"]
    args = GRPOConfig(
        output_dir=str(out / f"seed{seed}"),
        seed=seed,
        data_seed=seed,
        use_cpu=True,
        bf16=False,  # TRL's default is bf16 autocast; ours trains and samples in fp32
        gradient_checkpointing=False,  # TRL's default recomputes activations; ours does not
        max_steps=steps,
        learning_rate=opt["lr"],
        adam_beta1=opt["betas"][0],
        adam_beta2=opt["betas"][1],
        weight_decay=opt["weight_decay"],
        max_grad_norm=policy["max_grad_norm"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=per_step // micro,
        num_generations=group,
        max_completion_length=gen["max_new_tokens"],
        temperature=gen["temperature"],
        top_p=gen["top_p"],
        beta=0.0,
        num_iterations=1,
        epsilon=cfg["loss_fn"]["ratio_clip_min"],
        epsilon_high=cfg["loss_fn"]["ratio_clip_max"],
        loss_type="dapo",
        scale_rewards="group",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    evaluator = HeldOutEval(sets, tokenizer, grpo["val_period"], gen["max_new_tokens"])
    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=args, train_dataset=Dataset.from_list(train),
                          processing_class=tokenizer, callbacks=[evaluator])
    started = time.perf_counter()
    trainer.train()
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    return {"seed": seed, "steps": steps, "wall_s": time.perf_counter() - started, "step_s": evaluator.step_s,
            "train_reward": rewards, "validations": evaluator.validations,
            "threads": torch.get_num_threads(), "trl": __import__("trl").__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, help="default: grpo.max_num_steps of the demo config")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-trl"))
    args = parser.parse_args()
    cfg = yaml.safe_load(CONFIG.read_text())
    steps = args.steps or cfg["grpo"]["max_num_steps"]
    args.out.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        result = run_seed(seed, cfg, steps, args.out)
        path = args.out / f"trl_seed{seed}.json"
        path.write_text(json.dumps(result, indent=1))
        first, last = result["validations"][0], result["validations"][-1]
        print(f"seed {seed}: held-out {first['val/accuracy']:.3f} -> {last['val/accuracy']:.3f}, "
              f"median step {sorted(result['step_s'])[len(result['step_s']) // 2]:.1f}s; {path}", flush=True)


if __name__ == "__main__":
    main()
