"""The policy computes the prefix neighbouring rows share once, with the logprobs and gradients of whole rows."""

from __future__ import annotations

import pytest
import torch

from gym_bridge.policy.hf import HFPolicy, HFPolicyConfig
from gym_bridge.policy.shared_prefix import PrefixRun, fed_tokens, plan_prefixes, worth_sharing


def _batch(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    return ids, torch.tensor([len(r) for r in rows])


def test_the_split_keeps_each_prompts_samples_together_and_feeds_the_fewest_tokens() -> None:
    header = list(range(10, 40))  # 30 tokens every row starts with
    a, b = header + list(range(50, 70)), header + list(range(80, 100))  # two prompts of 50 tokens
    rows = [a + [1, 2, 3], a + [1, 4], a + [5, 6, 7, 8], b + [9], b + [9, 9], [3, 3, 3]]
    ids, lens = _batch(rows)
    runs = plan_prefixes(ids, lens)
    # b + [9] keeps one token of its own out of its run's prefix; [3, 3, 3] is a run of one
    assert runs == [PrefixRun(0, 3, 50), PrefixRun(3, 5, 50), PrefixRun(5, 6, 2)]
    assert fed_tokens(runs, lens) == (50 + 3 + 2 + 4) + (50 + 1 + 2) + (2 + 1)
    assert worth_sharing(runs, lens)


def test_rows_that_share_nothing_are_not_worth_a_second_pass() -> None:
    ids, lens = _batch([[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11]])
    runs = plan_prefixes(ids, lens)
    assert [run.stop - run.start for run in runs] == [1, 1, 1]
    assert not worth_sharing(runs, lens)


def _grpo_like_batch(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Four prompts (a shared header, then their own tokens) with eight samples each; some samples share their
    first generated tokens, some are one token long."""
    g = torch.Generator().manual_seed(seed)
    header = torch.randint(5, vocab, (40,), generator=g).tolist()
    rows: list[list[int]] = []
    for prompt_no in range(4):
        prompt = header + torch.randint(5, vocab, (6 + 3 * prompt_no,), generator=g).tolist()
        for sample in range(8):
            generated = torch.randint(5, vocab, (1 + (7 * sample) % 13,), generator=g).tolist()
            if sample % 2:
                generated[:1] = [7]
            rows.append(prompt + generated)
    ids, lens = _batch(rows)
    return ids, lens, 46


@pytest.fixture(scope="module")
def policy() -> HFPolicy:
    torch.manual_seed(0)
    return HFPolicy(HFPolicyConfig(model="tiny", keep_reference_model=False))


def _logprobs_and_grads(
    policy: HFPolicy, ids: torch.Tensor, lens: torch.Tensor, first: int, shared: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    policy.cfg = policy.cfg.model_copy(update={"shared_prefix": shared})
    policy.model.train()
    policy.model.zero_grad(set_to_none=True)
    logprobs = policy._token_logprobs(policy.model, ids, lens, first=first)
    (logprobs * torch.linspace(0.5, 1.5, logprobs.shape[1])).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None])
    return logprobs.detach(), grads


@pytest.mark.parametrize("first", [1, 30, 46])
def test_shared_prefix_logprobs_and_gradients_equal_whole_rows(policy: HFPolicy, first: int) -> None:
    ids, lens, _ = _grpo_like_batch(policy.model.config.vocab_size)
    assert worth_sharing(plan_prefixes(ids, lens), lens)
    whole, whole_grads = _logprobs_and_grads(policy, ids, lens, first, shared=False)
    shared, shared_grads = _logprobs_and_grads(policy, ids, lens, first, shared=True)
    assert torch.equal(whole != 0, shared != 0)  # the same positions scored, the same zeros
    assert int((shared != 0).sum()) == int((lens - first).clamp(min=0).sum())
    assert torch.allclose(whole, shared, atol=1e-5, rtol=0)
    assert float((whole_grads - shared_grads).norm() / whole_grads.norm()) < 1e-5


def test_shared_prefix_scores_at_other_weights(policy: HFPolicy) -> None:
    ids, lens, first = _grpo_like_batch(policy.model.config.vocab_size, seed=1)
    weights = {name: p.detach() * 1.01 for name, p in policy.model.named_parameters()}
    outs = []
    for shared in (False, True):
        policy.cfg = policy.cfg.model_copy(update={"shared_prefix": shared})
        with torch.no_grad():
            outs.append(policy._token_logprobs(policy.model, ids, lens, first=first, weights=weights))
    with torch.no_grad():
        own = policy._token_logprobs(policy.model, ids, lens, first=first)
    assert torch.allclose(outs[0], outs[1], atol=1e-5, rtol=0)
    assert not torch.allclose(outs[1], own, atol=1e-3)  # the weights given were used
