"""Where the CPU engine's time goes: a prefill and a decode step at 1, 8 and 32 rows (SmolLM2 by default).

The workload is the arith eval's (``examples/eval_arith_heldout.yaml``): the held-out chats (~100 tokens rendered),
N=4 samples of each prompt (rows of one prompt share its prefill), temperature 1, 24 new tokens, no stop ids, so
every row runs its 24 steps. Three views, each printed as a table:

- ``engine``: the decode loop with timers around its parts (``RunningBatch``'s prefill, the model's forward pass,
  the token choice, the stop check, the prefix-cache insert; the rest of a step is the loop's own Python); the median
  of ``--reps`` runs, unseeded and seeded rows.
- ``model``: the forward pass split by module (forward hooks and wrappers around transformers' mask builder, the
  SDPA call and the KV-cache append): embedding, mask, rotary, norms, q/k/v/o projections, attention, MLP, the LM
  head; what is left is the model's Python between them. The hooks cost a little themselves, so this view's totals
  sit a few percent above ``engine``'s.
- ``ops``: ``torch.profiler``'s top operators (self CPU time) over the decode steps of one run.

Run: ``uv run python benchmarks/engine_profile.py`` (``--help``); ``--threads`` sets ``torch.set_num_threads``.
The HTTP layer's share is measured by ``benchmarks/engine_compare.py`` (server against the bare engine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from gym_bridge.generation import hf_decode
from gym_bridge.generation.hf import HFGeneration
from gym_bridge.generation.hf_config import HFGenerationConfig, RowSampling
from gym_bridge.generation.hf_decode import Row, RunningBatch

DATA = Path(__file__).resolve().parent.parent / "examples" / "data" / "arith_heldout.jsonl"
SAMPLES = 4


def arith_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """The first ``count`` held-out arith chats as token ids, rendered as the server renders a chat."""
    out = []
    with DATA.open() as f:
        for line in f:
            if len(out) == count:
                break
            chat = json.loads(line)["responses_create_params"]["input"]
            ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
            out.append(list(ids))
    return out


def shared_preamble(tokenizer: Any, length: int) -> list[int]:
    """``length`` token ids of a fixed English preamble (a stand-in for a long shared tool list)."""
    sentence = "The assistant may call any of the listed tools, each with the arguments its schema names. "
    ids: list[int] = []
    while len(ids) < length:
        ids += tokenizer.encode(sentence, add_special_tokens=False)
    return ids[:length]


def make_rows(prompts: list[list[int]], rows: int, new: int, seeded: bool) -> list[Row]:
    """``rows`` rows, ``SAMPLES`` per prompt (fewer when ``rows`` is smaller), sampled at temperature 1."""
    out = []
    for i in range(rows):
        prompt = prompts[i // SAMPLES]
        sampling = RowSampling(temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=new, seed=i if seeded else None)
        generator = torch.Generator().manual_seed(i) if seeded else None
        out.append(Row(prompt=list(prompt), stop_strings=(), greedy=False, sampling=sampling, generator=generator))
    return out


class Timers:
    """Seconds spent in named parts, summed (the parts may nest; each is reported on its own)."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: defaultdict[str, int] = defaultdict(int)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1

        return timed


@contextmanager
def patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    """``obj.name = value`` for the block."""
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def engine_run(engine: HFGeneration, rows: list[Row]) -> dict[str, float]:
    """One batch decoded to its end with timers on the loop's parts; seconds per part."""
    timers = Timers()
    cls = RunningBatch
    parts = {
        "prefill": cls.admit,
        "forward": cls._forward,
        "choose": cls._choose,
        "stop check": cls._hit_stop_string,
        "prefix insert": cls._remember,
        "step": cls.step,
    }
    with contextlib.ExitStack() as stack:
        for name, fn in parts.items():
            stack.enter_context(patched(cls, fn.__name__, timers.wrap(name, fn)))
        batch = RunningBatch(engine._ctx, 0)
        if engine._prefix_cache is not None:
            engine._prefix_cache.clear()
        with torch.inference_mode():
            start = time.perf_counter()
            batch.admit(rows)
            prefill_forward = timers.seconds["forward"]
            while len(batch):
                batch.step()
            total = time.perf_counter() - start
    steps = timers.calls["step"]
    decode_forward = timers.seconds["forward"] - prefill_forward
    step = timers.seconds["step"]
    inner = decode_forward + timers.seconds["choose"] + timers.seconds["stop check"] + timers.seconds["prefix insert"]
    return {
        "total": total,
        "prefill": timers.seconds["prefill"],
        "prefill forward": prefill_forward,
        "steps": steps,
        "step": step / steps,
        "step forward": decode_forward / steps,
        "step choose": timers.seconds["choose"] / steps,
        "step stop+insert": (timers.seconds["stop check"] + timers.seconds["prefix insert"]) / steps,
        "step loop python": (step - inner) / steps,
    }


def engine_view(engine: HFGeneration, prompts: list[list[int]], sizes: list[int], new: int, reps: int) -> None:
    """The ``engine`` table: medians of ``reps`` runs per size, unseeded then seeded."""
    print(f"\nengine: a batch decoded to its end, {new} new tokens, median of {reps} runs (ms)")
    cols = ["prefill", "prefill forward", "step", "step forward", "step choose", "step stop+insert", "step loop python"]
    print(f"{'rows':>5} {'seeded':>7} " + " ".join(f"{c:>17}" for c in cols) + f" {'tokens/s':>9}")
    for size in sizes:
        for seeded in (False, True):
            runs = [engine_run(engine, make_rows(prompts, size, new, seeded)) for _ in range(reps)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            cells = " ".join(f"{med[c] * 1e3:>17.2f}" for c in cols)
            print(f"{size:>5} {str(seeded):>7} {cells} {size * new / med['total']:>9.0f}")


def model_view(engine: HFGeneration, prompts: list[list[int]], sizes: list[int], new: int) -> None:
    """The ``model`` table: one seeded run per size with hooks on every module; ms per decode step and per prefill."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama import modeling_llama

    from gym_bridge.generation import kv_cache

    model = engine.model
    implementation = model.config._attn_implementation  # sdpa, or cascade_attention.ATTENTION (SDPA around it)
    attention = ALL_ATTENTION_FUNCTIONS[implementation]
    print("\nmodel: the forward pass by part, one seeded run (ms per decode step | ms per prefill)")
    for size in sizes:
        timers = Timers()
        handles = []
        groups = {
            "embed": [model.model.embed_tokens],
            "rotary": [model.model.rotary_emb],
            "norms": [
                m for layer in model.model.layers for m in (layer.input_layernorm, layer.post_attention_layernorm)
            ]
            + [model.model.norm],
            "qkvo proj": [
                getattr(layer.self_attn, p)
                for layer in model.model.layers
                for p in ("q_proj", "k_proj", "v_proj", "o_proj")
            ],
            "mlp": [layer.mlp for layer in model.model.layers],
            "lm head": [model.lm_head],
        }
        for name, modules in groups.items():
            for module in modules:
                handles.append(module.register_forward_pre_hook(_start_hook))
                handles.append(module.register_forward_hook(_stop_hook(timers, name)))
        phase = {"name": "prefill"}

        def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            return timers.wrap(name, fn)

        per_phase: dict[str, dict[str, float]] = {}
        try:
            with (
                patched(modeling_llama, "create_causal_mask", counted("mask", modeling_llama.create_causal_mask)),
                patched(kv_cache.GrowingLayer, "update", counted("kv append", kv_cache.GrowingLayer.update)),
                patched(RunningBatch, "_forward", counted("forward", RunningBatch._forward)),
            ):
                ALL_ATTENTION_FUNCTIONS[implementation] = counted("sdpa", attention)
                batch = RunningBatch(engine._ctx, 0)
                if engine._prefix_cache is not None:
                    engine._prefix_cache.clear()
                with torch.inference_mode():
                    batch.admit(make_rows(prompts, size, new, True))
                    per_phase[phase["name"]] = dict(timers.seconds)
                    timers.seconds.clear()
                    steps = 0
                    while len(batch):
                        batch.step()
                        steps += 1
                    per_phase["decode"] = {k: v / max(steps - 1, 1) for k, v in timers.seconds.items()}
        finally:
            ALL_ATTENTION_FUNCTIONS[implementation] = attention
            for handle in handles:
                handle.remove()
        names = ["forward", "embed", "mask", "rotary", "norms", "qkvo proj", "kv append", "sdpa", "mlp", "lm head"]
        print(f"{'rows':>5} {'phase':>8} " + " ".join(f"{n:>10}" for n in names) + f" {'python':>10}")
        for label, sec in per_phase.items():
            known = sum(sec.get(n, 0.0) for n in names[1:])
            cells = " ".join(f"{sec.get(n, 0.0) * 1e3:>10.2f}" for n in names)
            print(f"{size:>5} {label:>8} {cells} {(sec.get('forward', 0.0) - known) * 1e3:>10.2f}")


_STARTS: list[float] = []


def _start_hook(module: torch.nn.Module, args: Any) -> None:
    _STARTS.append(time.perf_counter())


def _stop_hook(timers: Timers, name: str) -> Callable[..., None]:
    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        timers.seconds[name] += time.perf_counter() - _STARTS.pop()

    return hook


def ops_view(engine: HFGeneration, prompts: list[list[int]], size: int, new: int, top: int) -> None:
    """The ``ops`` table: torch.profiler's operators by self CPU time over one seeded run's decode steps."""
    from torch.profiler import ProfilerActivity, profile

    batch = RunningBatch(engine._ctx, 0)
    if engine._prefix_cache is not None:
        engine._prefix_cache.clear()
    with torch.inference_mode():
        batch.admit(make_rows(prompts, size, new, True))
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            while len(batch):
                batch.step()
    print(f"\nops: {size} rows, {new} decode steps, top {top} by self CPU time (shapes grouped)")
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=top))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new", type=int, default=24)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--only", nargs="+", choices=["engine", "model", "ops"], default=["engine", "model", "ops"])
    parser.add_argument("--ops-rows", type=int, default=32)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--shared-prefix", type=int, default=0, help="tokens of one shared preamble before every prompt (long contexts)"
    )
    parser.add_argument(
        "--per-row-attention", action="store_true", help="no shared-prefix attention (every row reads its own copy)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = HFGenerationConfig(
        model=args.model, stop_token_ids=[], seed=0, shared_prefix_attention=not args.per_row_attention
    )
    engine = HFGeneration(config)
    prompts = arith_prompts(engine.tokenizer, (max(args.rows) + SAMPLES - 1) // SAMPLES)
    if args.shared_prefix:
        prompts = [shared_preamble(engine.tokenizer, args.shared_prefix) + p for p in prompts]
    print(f"{args.model}, torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()}")
    print(f"prompts: {len(prompts)} held-out arith chats, {min(map(len, prompts))}-{max(map(len, prompts))} tokens")
    engine_run(engine, make_rows(prompts, 2, 4, True))  # warm-up
    if "engine" in args.only:
        engine_view(engine, prompts, args.rows, args.new, args.reps)
    if "model" in args.only:
        model_view(engine, prompts, args.rows, args.new)
    if "ops" in args.only:
        ops_view(engine, prompts, args.ops_rows, args.new, args.top)
    print(f"load after {os.getloadavg()}")
    engine.shutdown()


if __name__ == "__main__":
    hf_decode.logger.setLevel("WARNING")
    main()
