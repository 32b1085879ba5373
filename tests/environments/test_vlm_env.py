"""The VLM environment: every reward function on crafted and adversarial text, bounds, worker spread."""

from __future__ import annotations

import re
import time

import pytest
import ray
import torch

from gym_bridge.batched import BatchedDataDict
from gym_bridge.environments.rewards import (
    REWARD_FUNCTIONS,
    bbox_giou_reward,
    bounded_call,
    exact_alnum_reward,
    extract_tag,
    format_reward,
    geo3k_reward,
    last_boxed,
    math_expr_reward,
    multiple_choice_reward,
    numeric_reward,
)
from gym_bridge.environments.vlm import (
    VLMEnvConfig,
    VLMEnvironment,
    VLMEnvSettings,
    VLMVerifyWorkerImpl,
    chunk_to_workers,
    message_text,
)


def ans(text, think="ok"):
    return f"<think>{think}</think><answer>{text}</answer>"


def test_extract_tag_first_open_to_last_close():
    assert extract_tag("a<answer>x</answer>b<answer>y</answer>") == "x</answer>b<answer>y"
    assert extract_tag("<answer>unclosed") is None and extract_tag("</answer><answer>") is None


def test_format():
    assert format_reward("", ans("1")) == (1.0, None)
    assert format_reward("", "<answer>1</answer>") == (0.75, None)
    assert format_reward("", "<think>\nmulti\nline</think>") == (0.25, None)
    assert format_reward("", "plain") == (0.0, None)


def test_exact_alnum():
    assert exact_alnum_reward("Blue Cube", ans(" blue-cube! ")) == (1.0, True)
    assert exact_alnum_reward("3", ans("4")) == (0.0, False)
    assert exact_alnum_reward("3", "3") == (0.0, False)  # no answer tag


def test_multiple_choice():
    assert multiple_choice_reward("B", ans("(B)")) == (1.0, True)
    assert multiple_choice_reward("(c)", ans("C. a red ball")) == (1.0, True)  # lower-case words are not letters
    assert multiple_choice_reward("C", ans("I")) == (0.0, False)
    assert multiple_choice_reward("B", ans("A or B")) == (0.0, False)  # hedging is wrong
    assert multiple_choice_reward("B", ans("Banana")) == (0.0, False)


def test_numeric():
    assert numeric_reward("42", ans("The answer is 42.0")) == (1.0, True)
    assert numeric_reward("1,000", ans("1000.00001"), rel_tol=1e-6) == (1.0, True)
    assert numeric_reward("0.5", ans("0.51")) == (0.0, False)
    assert numeric_reward("0.5", ans("0.51"), abs_tol=0.02) == (1.0, True)
    assert numeric_reward("7", ans("seven")) == (0.0, False)


@pytest.mark.parametrize(
    ("truth", "answer"),
    [("\\frac{1}{2}", "0.5"), ("2\\sqrt{3}", "\\sqrt{12}"), ("x^2+2x+1", "(x+1)^2"), ("45", "\\boxed{45}"),
     ("3", "3.0")],
)
def test_math_expr_equivalent_answers(truth, answer):
    assert math_expr_reward(truth, ans(answer)) == (1.0, True)


@pytest.mark.parametrize(("truth", "answer"), [("\\frac{1}{2}", "0.25"), ("2\\sqrt{3}", "\\sqrt{13}"), ("45", "54")])
def test_math_expr_non_equivalent_answers(truth, answer):
    assert math_expr_reward(truth, ans(answer)) == (0.0, False)


def test_math_expr_needs_the_answer_tag():
    assert math_expr_reward("4", "the answer is 4") == (0.0, False)
    assert math_expr_reward("4", "<result>4</result>", tag="result") == (1.0, True)
    assert math_expr_reward("2", ans("1+" * 1500 + "1")) == (0.0, False)  # too long to grade: 0, at once


def test_geo3k():
    good = "<think>angles sum to 180</think> so x = \\boxed{\\frac{3}{4}}"
    assert geo3k_reward("0.75", good) == pytest.approx((1.0, True))
    assert geo3k_reward("0.75", "x = \\boxed{0.75}") == pytest.approx((0.9, True))  # no </think>: format 0
    assert geo3k_reward("0.75", "<think>hm</think> \\boxed{0.7}") == pytest.approx((0.1, False))
    assert geo3k_reward("0.75", "<think>hm</think> 0.75") == pytest.approx((0.0, False))
    assert geo3k_reward("5", "\\boxed{2} then \\boxed{5}", format_score=0.5) == pytest.approx((0.5, True))
    assert last_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}" and last_boxed("\\boxed{unclosed") is None


def test_math_rewards_in_a_nemo_rl_geometry3k_config():
    worker = VLMVerifyWorkerImpl(
        {"reward_functions": [{"name": "format", "weight": 0.1}, {"name": "math_expr", "weight": 0.9}]}
    )
    right, wrong = worker.score([ans("\\frac{1}{2}"), ans("1/3")], ["0.5", "0.5"])
    assert right["reward"] == pytest.approx(1.0) and right["correct"]
    assert wrong["reward"] == pytest.approx(0.1) and not wrong["correct"]


def test_bbox_giou():
    assert bbox_giou_reward("[0, 0, 10, 10]", ans("[0,0,10,10]")) == (1.0, True)
    score, correct = bbox_giou_reward("0,0,10,10", ans("[0, 0, 10, 5]"))
    assert score == pytest.approx(0.5) and correct is False
    # Disjoint boxes with a gap: IoU 0, GIoU = -(hull - union) / hull.
    score, _ = bbox_giou_reward("0,0,10,10", ans("20,0,30,10"))
    assert score == pytest.approx(0 - (300 - 200) / 300)
    score, _ = bbox_giou_reward("0,0,10,10", ans("20,0,30,10"), giou_penalty_thres=-1.0)  # plain IoU
    assert score == 0.0
    assert bbox_giou_reward("0,0,10,10", ans("1,2,3")) == (0.0, False)
    assert bbox_giou_reward("0,0,10,10", ans("nan,0,1,1")) == (0.0, False)


ADVERSARIAL = [
    "<answer>" * 50_000,
    "<think>" + "(" * 100_000 + "</answer>",
    "<answer>" + "9" * 200_000 + "</answer>",
    "<answer>" + "1e999999," * 20_000 + "</answer>",
    "<answer>" + "[" * 100_000 + "</answer>",
    "\x00\ud800" * 10_000,
]


@pytest.mark.parametrize("text", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_adversarial_text_is_scored_quickly_and_never_raises(text):
    for name, fn in REWARD_FUNCTIONS.items():
        t0 = time.perf_counter()
        score, _ = bounded_call(name, fn, "B", text, {}, max_chars=20_000, time_limit_s=2.0)
        assert time.perf_counter() - t0 < 1.0 and isinstance(score, float)


def test_bounded_call_turns_hangs_and_crashes_into_zero(caplog):
    def catastrophic(gt, response):
        return (1.0 if re.match(r"(a+)+$", response) else 0.5), None

    def crash(gt, response):
        raise RuntimeError("boom")

    t0 = time.perf_counter()
    assert bounded_call("slow", catastrophic, "", "a" * 40 + "b", {}, max_chars=1000, time_limit_s=0.2) == (0.0, False)
    assert time.perf_counter() - t0 < 2.0
    assert bounded_call("crash", crash, "", "x", {}, max_chars=10, time_limit_s=None) == (0.0, False)
    assert "crash" in caplog.text and "boom" in caplog.text
    # The length cap keeps the end of the response (where the answer is).
    assert bounded_call("exact", exact_alnum_reward, "7", "x" * 100 + ans("7"), {}, max_chars=40,
                        time_limit_s=None) == (1.0, True)


def test_config_validation():
    with pytest.raises(ValueError, match="unknown reward function 'nope'"):
        VLMEnvSettings.model_validate(VLMEnvConfig(num_workers=1, reward_functions=[{"name": "nope"}]))
    with pytest.raises(ValueError, match="at least one"):
        VLMEnvSettings.model_validate({"num_workers": 1, "reward_functions": []})
    with pytest.raises(ValueError, match="reward_function\\b"):
        VLMEnvSettings.model_validate({"num_workers": 1, "reward_function": [{"name": "format"}]})


def test_worker_combines_weighted_scores():
    worker = VLMVerifyWorkerImpl(
        {"reward_functions": [{"name": "format", "weight": 1}, {"name": "exact_alnum", "weight": 3}]}
    )
    assert worker.verify([ans("cube"), "<answer>cube</answer>", ans("ball")], ["cube"] * 3) == pytest.approx(
        [1.0, 0.25 * 0.75 + 0.75, 0.25]
    )


def test_chunking_and_content_parts():
    assert chunk_to_workers(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert chunk_to_workers([0, 1], 3) == [[0], [1], []]
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, {"type": "text", "text": "hi"}]
    assert message_text(parts) == "hi" and message_text(None) == ""


@pytest.mark.slow  # three Ray worker processes that import torch: ~70 s on a loaded 2-core machine
@pytest.mark.usefixtures("ray_session")
def test_environment_step_spread_and_metrics():
    cfg = VLMEnvConfig(num_workers=2, stop_strings=["</answer>"], reward_functions=[
        {"name": "format", "weight": 0.2}, {"name": "exact_alnum", "weight": 0.8}])
    env = VLMEnvironment.remote(cfg)  # as the documented interface and NeMo-RL HEAD both create it
    try:
        truths = ["cube", "ball", "cone", "cube", "ball", "cone", "cube"]
        replies = [ans("cube"), ans("cube"), "no tags", ans("cube"), "<answer>ball</answer>", ans("x" * 10), ans("cube")]
        logs = [
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}},
                                          {"type": "text", "text": "What shape?"}], "token_ids": torch.arange(5)},
             {"role": "assistant", "content": [{"type": "text", "text": r}], "token_ids": torch.arange(i + 1)}]
            for i, r in enumerate(replies)
        ]
        ret = ray.get(env.step.remote(logs, [{"ground_truth": t} for t in truths]))
        expected = [1.0, 0.2, 0.0, 1.0, 0.2 * 0.75 + 0.8, 0.2, 1.0]
        assert ret.rewards.dtype == torch.float32 and ret.rewards.tolist() == pytest.approx(expected)
        assert ret.terminateds.tolist() == [True] * 7 and ret.next_stop_strings == [["</answer>"]] * 7
        verdicts = [o["content"] for o in ret.observations]
        assert verdicts[0] == "Environment: correct" and verdicts[1] == "Environment: incorrect"
        assert ret.answers[2] is None and ret.answers[0] == "cube"
        stats = ray.get(env.worker_stats.remote())
        assert sorted(s["items_scored"] for s in stats) == [3, 4]  # 7 items over 2 workers
        assert all(s["main_thread"] for s in stats)  # so the per-call time limit is enforced

        batch = BatchedDataDict({
            "message_log": logs, "extra_env_info": [{"ground_truth": t} for t in truths],
            "total_reward": ret.rewards, "truncated": torch.tensor([False] * 6 + [True]),
        })
        batch, metrics = ray.get(env.global_post_process_and_metrics.remote(batch))
        assert batch["total_reward"][-1] == 0.0  # not properly ended
        assert metrics["accuracy"] == pytest.approx(3 / 7)  # samples 0, 3, 4 (6 was truncated)
        assert metrics["reward/exact_alnum/mean"] == pytest.approx(4 / 7)
        assert metrics["reward/format/mean"] == pytest.approx((5 + 0.75) / 7)
        assert metrics["fraction_of_samples_properly_ended"] == pytest.approx(6 / 7)
        assert metrics["histogram/reward"] == pytest.approx(expected[:6] + [0.0])
        # NeMo-RL's documented metrics: prompts are (question, ground truth): cube and ball solved, cone not.
        assert metrics["pass@samples_per_prompt"] == pytest.approx(2 / 3) and metrics["num_problems_in_batch"] == 7
        assert (metrics["prompt_lengths"], metrics["generation_lengths"]) == (5.0, 4.0)
        assert metrics["correct_solution_generation_lengths"] == pytest.approx((1 + 4 + 5) / 3)
        stats = ray.get(env.worker_stats.remote())
        assert sum(s["items_scored"] for s in stats) == 14
    finally:
        ray.get(env.shutdown.remote())
        ray.kill(env)
