"""oneDNN-packed linear weights in the engine (generation/packed_linear.py): the same products up to float rounding,
never a stale weight, and nothing changed for any other caller of the model.

The packed product is held to a float64 reference within the textbook bound of a float32 dot product on generated
shapes (Hypothesis); every way a weight changes (``load_state_dict``, an optimizer step, a new tensor, a refit
through the engine) reaches the next engine forward; outside the engine's forward (another thread, autograd on, a
deep or pickled copy) ``nn.Linear`` runs unchanged, bit for bit."""

from __future__ import annotations

import copy
import io
import threading

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from gym_bridge.batched import BatchedDataDict
from gym_bridge.generation.hf import HFGeneration
from gym_bridge.generation.hf_config import HFGenerationConfig
from gym_bridge.generation.packed_linear import PackedLinears
from gym_bridge.testing.generation import reference_logprobs

LOGPROB_TOL = 1e-5

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN (packed_linear stays off)"
)


def _within_float32_rounding(got: torch.Tensor, x: torch.Tensor, layer: torch.nn.Linear) -> None:
    """``got`` is ``layer(x)`` within the float32 error bound of a dot product with ``k`` terms and the bias
    (``(k + 1) * eps * (sum|x w| + |b|)``)."""
    weight = layer.weight.detach().double()
    bias = torch.zeros(()) if layer.bias is None else layer.bias.detach().double()
    want = x.double() @ weight.T + bias
    bound = (x.shape[-1] + 1) * 2.0**-23 * (x.double().abs() @ weight.abs().T + bias.abs()) + 1e-30
    assert ((got.double() - want).abs() <= bound).all()


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 40),
    k=st.integers(1, 300),
    n=st.integers(1, 300),
    bias=st.booleans(),
    lead=st.sampled_from([(), (1,), (3,)]),
    seed=st.integers(0, 2**16),
)
def test_the_packed_product_is_the_linear_layers_up_to_rounding(rows, k, n, bias, lead, seed) -> None:
    torch.manual_seed(seed)
    layer = torch.nn.Linear(k, n, bias=bias)
    packs = PackedLinears.for_model(layer)
    assert packs is not None
    x = torch.randn((*lead, rows, k))
    with torch.no_grad(), packs.using():
        got = layer(x)
    assert got.shape == (*lead, rows, n)
    _within_float32_rounding(got, x, layer)


def _change(layer: torch.nn.Linear, how: str) -> None:
    new = torch.randn_like(layer.weight)
    if how == "load_state_dict":
        layer.load_state_dict({"weight": new, "bias": layer.bias.detach()})
    elif how == "optimizer step":
        layer.weight.grad = new
        torch.optim.SGD(layer.parameters(), lr=1.0).step()
    elif how == "new tensor":
        layer.weight = torch.nn.Parameter(new)
    elif how == "in place under no_grad":
        with torch.no_grad():
            layer.weight.mul_(-1.0)


@pytest.mark.parametrize("how", ["load_state_dict", "optimizer step", "new tensor", "in place under no_grad"])
def test_a_changed_weight_is_packed_again_before_the_next_product(how: str) -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48)
    packs = PackedLinears.for_model(layer)
    assert packs is not None
    x = torch.randn(5, 64)
    with torch.no_grad(), packs.using():
        before = layer(x)
    _change(layer, how)
    with torch.no_grad(), packs.using():
        after = layer(x)
    assert (after - before).abs().max() > 1e-2  # the new weight is used, not the copy of the old one
    _within_float32_rounding(after, x, layer)
    assert packs.refresh() == 0  # nothing left stale


def test_a_weight_moved_off_float32_is_dropped_and_its_layer_runs_unchanged() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    packs = PackedLinears.for_model(layer)
    assert packs is not None
    layer.to(torch.float64)
    x = torch.randn(3, 16, dtype=torch.float64)
    with torch.no_grad(), packs.using():
        got = layer(x)
    assert packs.get(layer) is None and packs.nbytes == 0
    assert torch.equal(got, F.linear(x, layer.weight, layer.bias))


def test_outside_the_engines_forward_the_layer_runs_unchanged() -> None:
    """Autograd on, another thread, a deep copy, a pickled copy: each gets ``F.linear``'s result bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 8))
    packs = PackedLinears.for_model(model)
    assert packs is not None and packs.nbytes == sum(m.weight.numel() * 4 for m in model)
    x = torch.randn(6, 32)

    def plain(m: torch.nn.Sequential) -> torch.Tensor:
        return F.linear(F.linear(x, m[0].weight, m[0].bias), m[1].weight, m[1].bias)

    saved = io.BytesIO()
    torch.save(model, saved)
    saved.seek(0)
    copies = [copy.deepcopy(model), torch.load(saved, weights_only=False)]
    other_thread: list[torch.Tensor] = []
    with packs.using():
        trained = model(x)  # autograd on: a trainer's forward
        trained.sum().backward()
        assert model[0].weight.grad is not None
        with torch.no_grad():
            thread = threading.Thread(target=lambda: other_thread.append(model(x)))
            thread.start()
            thread.join(timeout=30)
            copied = [m(x) for m in copies]
            packed = model(x)
    assert torch.equal(trained, plain(model)) and torch.equal(other_thread[0], plain(model))
    assert all(torch.equal(out, plain(m)) for out, m in zip(copied, copies, strict=True))
    def packed_kernel(m: torch.nn.Sequential) -> torch.Tensor:
        first = torch.ops.mkldnn._linear_pointwise(x, packs.get(m[0]), m[0].bias, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise(first, packs.get(m[1]), m[1].bias, "none", [], "")

    with torch.no_grad():  # inside, on this thread, with autograd off: the packed kernel's product (on some CPUs it
        assert torch.equal(packed, packed_kernel(model))  # equals F.linear's bit for bit, so compare with the kernel)


def test_nothing_to_pack() -> None:
    assert PackedLinears.for_model(torch.nn.Linear(4, 4).to(torch.bfloat16)) is None
    assert PackedLinears.for_model(torch.nn.Sequential(torch.nn.ReLU())) is None


def _seeded_batch(prompts: list[list[int]]) -> BatchedDataDict:
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    return BatchedDataDict(
        {"input_ids": ids, "input_lengths": torch.tensor(list(map(len, prompts))), "seed": list(range(len(prompts)))}
    )


def test_the_engine_gives_the_same_tokens_and_the_trainers_logprobs(tiny_lm) -> None:
    """Seeded rows, packed weights on and off: the same tokens; logprobs within 1e-5 of each other and of the
    trainer's forward pass (``nn.Linear``) over each finished row."""
    tok, model = tiny_lm
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 1000, (k,), generator=generator).tolist() for k in (4, 30, 30, 90)]
    data = _seeded_batch(prompts)
    engines = {
        packed: HFGeneration(
            HFGenerationConfig(max_new_tokens=16, stop_token_ids=[], packed_linear=packed), model=model, tokenizer=tok
        )
        for packed in (True, False)
    }
    try:
        assert engines[True]._ctx.packed is not None and engines[False]._ctx.packed is None
        on, off = (engines[p].generate(data) for p in (True, False))
        for i, n in enumerate(on["unpadded_sequence_lengths"].tolist()):
            tokens, prompt = on["output_ids"][i, :n], len(prompts[i])
            assert torch.equal(tokens, off["output_ids"][i, :n])
            got = on["logprobs"][i, prompt:n]
            assert (got - off["logprobs"][i, prompt:n]).abs().max() <= LOGPROB_TOL
            assert (got - reference_logprobs(model, tokens, prompt, 1.0)[0]).abs().max() <= LOGPROB_TOL
    finally:
        for engine in engines.values():
            engine.shutdown()


def test_a_trainer_step_on_the_engines_own_model_reaches_its_next_rows(tiny_lm) -> None:
    """An optimizer step changes the engine's weights in place, behind its back: the engine's next rows come from the
    new weights (the trainer's forward over them), not the packed old ones. (The prefix cache, which only a refit
    through ``update_weights`` empties, is off here: this is about the packed copies.)"""
    tok, shared = tiny_lm
    model = copy.deepcopy(shared)
    config = HFGenerationConfig(max_new_tokens=8, stop_token_ids=[], enable_prefix_caching=False)
    engine = HFGeneration(config, model=model, tokenizer=tok)
    prompt = torch.randint(5, 1000, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    data = _seeded_batch([prompt])
    try:
        engine.generate(data)
        torch.manual_seed(0)
        for p in model.parameters():
            p.grad = 0.05 * torch.randn_like(p)
        torch.optim.SGD(model.parameters(), lr=1.0).step()
        out = engine.generate(data)
        n = int(out["unpadded_sequence_lengths"][0])
        tokens = out["output_ids"][0, :n]
        got = out["logprobs"][0, len(prompt) : n]
        assert (got - reference_logprobs(model, tokens, len(prompt), 1.0)[0]).abs().max() <= LOGPROB_TOL
        old = reference_logprobs(shared, tokens, len(prompt), 1.0)[0]
        assert (got - old).abs().max() > 1e-3  # the old weights would not explain them
    finally:
        engine.shutdown()
