"""The decode loop's KV cache: the growing cache (gym_bridge/generation/kv_cache.py) against transformers' DynamicCache.

Three measurements, each printed as a table (``--only`` picks some):

- ``sdpa``: one decode step's attention (SmolLM2's shapes: 3 KV heads, 3 query heads per KV head, head size 64, a
  padding mask) over a contiguous cache and over a view of a cache with spare columns, and what ``torch.cat`` of one
  column costs (what DynamicCache pays per layer per step); the outputs' largest difference.
- ``decode``: R seeded sampled rows of a short (~100-token) and a long (~4,500-token) prompt decode G tokens with
  each cache, through ``RunningBatch`` as the engine runs it. Each prompt is prefilled once into a prefix cache
  first, so every timed run starts from the same cached keys and values and prefills only the last few tokens;
  the decode steps' wall time, its median per step, the old/new ratio, and whether the tokens and logprobs match.
- ``wait``: R rows that share an S-token prefix and each go on for T tokens join at once (prefill only: 1 new
  token), on an empty prefix cache, with the rows waiting for the first row's blocks (a second prefill pass) or not
  (``PrefixCache.wait_min_tokens``); where waiting starts to pay is where the threshold goes.

Timings alternate the settings and report medians; on a shared machine compare ratios within a run.
Run: ``uv run python benchmarks/kv_cache.py`` (``--help``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gym_bridge.generation.hf_config import HFGenerationStats, RowSampling
from gym_bridge.generation.hf_decode import DecodeContext, Row, RunningBatch, decode_to_end
from gym_bridge.generation.prefix_cache import PrefixCache
from gym_bridge.models.loading import load_causal_lm
from gym_bridge.models.registry import resolve_model_path


def ids(n: int, seed: int, vocab: int) -> list[int]:
    """``n`` token ids drawn with ``seed`` (ordinary tokens of the vocabulary, no special ones)."""
    return torch.randint(100, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def context(model: torch.nn.Module, tok: object, growing: bool, prefix_cache: PrefixCache | None) -> DecodeContext:
    """What HFGeneration gives its decode loop, with no stop ids, so every row generates its cap."""
    return DecodeContext(
        model=model,
        tokenizer=tok,  # type: ignore[arg-type]
        device=torch.device("cpu"),
        pad_token_id=0,
        stop_token_ids=frozenset(),
        max_model_len=model.config.max_position_embeddings,
        generator=torch.Generator().manual_seed(0),
        stats=HFGenerationStats(),
        logits_to_keep=True,
        is_closed=lambda: False,
        prefix_cache=prefix_cache,
        growing_kv_cache=growing,
    )


def rows(prompts: list[list[int]], cap: int) -> list[Row]:
    """Seeded sampled rows (temperature 1), one seed per prompt."""
    return [
        Row(
            prompt=p,
            stop_strings=(),
            greedy=False,
            sampling=RowSampling(temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=cap, seed=i),
            generator=torch.Generator().manual_seed(i),
        )
        for i, p in enumerate(prompts)
    ]


@dataclass
class Timed:
    """Wall and CPU seconds of this process (CPU time is less disturbed by other work on a shared machine)."""

    wall: float = 0.0
    cpu: float = 0.0

    @classmethod
    def of(cls, fn: Callable[[], object]) -> Timed:
        """How long ``fn()`` took."""
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        return cls(time.perf_counter() - wall, time.process_time() - cpu)


def best_times(fns: list[Callable[[], object]], reps: int) -> list[float]:
    """The least CPU time of each of ``fns`` over ``reps`` interleaved rounds, after one untimed round."""
    best = [float("inf")] * len(fns)
    for rep in range(reps + 1):
        for i, fn in enumerate(fns):
            took = Timed.of(fn).cpu
            if rep:
                best[i] = min(best[i], took)
    return best


def sdpa(lengths: list[int], rows_n: int, reps: int) -> None:
    """Attention over a contiguous cache and over a view with spare columns; one column appended by torch.cat."""
    sdpa_fn = torch.nn.functional.scaled_dot_product_attention
    print(f"\nsdpa: {rows_n} rows, one decode step's attention in 30 layers, least CPU time of {reps} rounds")
    print("(SmolLM2's shapes: 3 KV heads x 3 query heads, head size 64, a padding mask)")
    print(f"{'columns':>8}{'contiguous ms':>15}{'view ms':>10}{'view/contig':>13}{'cat ms':>9}{'max diff':>10}")
    for length in lengths:
        g = torch.Generator().manual_seed(length)
        query = torch.randn(rows_n, 3, 3, 64, generator=g)
        buffer_k = torch.randn(rows_n, 3, int(length * 1.5), 64, generator=g)
        buffer_v = torch.randn(rows_n, 3, int(length * 1.5), 64, generator=g)
        view_k, view_v = buffer_k[:, :, :length], buffer_v[:, :, :length]
        keys, values = view_k.contiguous(), view_v.contiguous()
        mask = torch.zeros(rows_n, 1, 1, length)
        mask[0, :, :, : length // 4] = torch.finfo(torch.float32).min  # row 0 left-padded
        new = torch.randn(rows_n, 3, 1, 64, generator=g)
        contiguous, viewed, cat = best_times(
            [
                lambda: [sdpa_fn(query, keys, values, attn_mask=mask) for _ in range(30)],
                lambda: [sdpa_fn(query, view_k, view_v, attn_mask=mask) for _ in range(30)],
                lambda: [(torch.cat([keys, new], 2), torch.cat([values, new], 2)) for _ in range(30)],
            ],
            reps,
        )
        diff = (sdpa_fn(query, keys, values, attn_mask=mask) - sdpa_fn(query, view_k, view_v, attn_mask=mask)).abs()
        print(f"{length:>8}{contiguous * 1e3:>15.2f}{viewed * 1e3:>10.2f}{viewed / contiguous:>12.2f}x", end="")
        print(f"{cat * 1e3:>9.2f}{float(diff.max()):>10.1e}")


def decode_once(
    model: torch.nn.Module, tok: object, prompts: list[list[int]], new: int, growing: bool, cache: PrefixCache
) -> tuple[Timed, list[Row]]:
    """Admit ``prompts`` (their prefixes cached), then time the decode steps."""
    batch = RunningBatch(context(model, tok, growing, cache), 0)
    joining = rows(prompts, new)

    def steps() -> None:
        while len(batch):
            batch.step()

    with torch.inference_mode():
        batch.admit(joining)
        took = Timed.of(steps)
    return took, joining


def decode(model: torch.nn.Module, tok: object, cases: list[tuple[str, int, int, int]], reps: int) -> None:
    """Each case's rows decoded with DynamicCache (old) and the growing cache (new), alternating; medians."""
    vocab = int(model.config.vocab_size)
    print(
        f"\ndecode: seeded sampled rows, decode steps only (prompts prefilled from the prefix cache), median of {reps}"
    )
    print(f"{'case':<30}{'wall old/new s':>16}{'old/new':>9}{'CPU old/new s':>16}{'old/new':>9}", end="")
    print(f"{'ms/step old/new':>17}{'tokens':>8}{'max |dlogprob|':>16}")
    for name, n_rows, length, new in cases:
        prompts = [ids(length, 1000 + r, vocab) for r in range(n_rows)]
        cache = PrefixCache(16, 8 << 30)
        decode_once(model, tok, prompts, 1, True, cache)  # fills the prefix cache
        runs: dict[bool, list[tuple[Timed, list[Row]]]] = {False: [], True: []}
        for _ in range(reps):
            for growing in (False, True):
                runs[growing].append(decode_once(model, tok, prompts, new, growing, cache))
        old_s, new_s = (statistics.median(r[0].wall for r in runs[g]) for g in (False, True))
        old_cpu, new_cpu = (statistics.median(r[0].cpu for r in runs[g]) for g in (False, True))
        pairs = [
            (a.result, b.result)
            for ra, rb in zip(runs[False], runs[True], strict=True)
            for a, b in zip(ra[1], rb[1], strict=True)
        ]
        same = all(a is not None and b is not None and a.tokens == b.tokens for a, b in pairs)
        worst = max(
            float((torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max())
            for a, b in pairs
            if a is not None and b is not None
        )
        per_step = f"{old_s / (new - 1) * 1e3:.0f}/{new_s / (new - 1) * 1e3:.0f}"
        print(f"{name:<30}{f'{old_s:.2f}/{new_s:.2f}':>16}{old_s / new_s:>8.2f}x", end="")
        print(f"{f'{old_cpu:.2f}/{new_cpu:.2f}':>16}{old_cpu / new_cpu:>8.2f}x{per_step:>17}", end="")
        print(f"{'equal' if same else 'DIFFER':>8}{worst:>16.1e}")


def wait(model: torch.nn.Module, tok: object, shared: list[int], n_rows: int, suffix: int, reps: int) -> None:
    """Prefill-only rows sharing a prefix, waiting for the first row's blocks (a second pass) or not."""
    vocab = int(model.config.vocab_size)
    print(f"\nwait: {n_rows} rows of S shared + {suffix} own tokens join at once, prefill only (1 new token), empty")
    print(f"prefix cache; waiting = one prefill for the first row, one for the rest; median of {reps}")
    print(f"{'S':>6}{'wall wait/no s':>16}{'no/wait':>9}{'CPU wait/no s':>16}{'no/wait':>9}{'passes':>8}")
    never = 1 << 30
    for s in shared:
        prefix = ids(s, 7, vocab)
        prompts = [prefix + ids(suffix, 100 + r, vocab) for r in range(n_rows)]
        times: dict[int, list[Timed]] = {0: [], never: []}
        passes: dict[int, int] = {}
        for rep in range(reps + 1):
            for threshold in times:
                ctx = context(model, tok, True, PrefixCache(16, 1 << 30, wait_min_tokens=threshold))
                with torch.inference_mode():
                    took = Timed.of(lambda: decode_to_end(ctx, rows(prompts, 1), 0))  # noqa: B023
                if rep:  # the first round warms up
                    times[threshold].append(took)
                passes[threshold] = ctx.stats.forward_passes
        on, off = (statistics.median(t.wall for t in times[k]) for k in (0, never))
        on_cpu, off_cpu = (statistics.median(t.cpu for t in times[k]) for k in (0, never))
        print(f"{s:>6}{f'{on:.3f}/{off:.3f}':>16}{off / on:>8.2f}x{f'{on_cpu:.3f}/{off_cpu:.3f}':>16}", end="")
        print(f"{off_cpu / on_cpu:>8.2f}x{f'{passes[0]}/{passes[never]}':>8}")


def main() -> None:
    """Run the chosen measurements and print their tables."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="a built-in model name or a folder (default smollm2)")
    parser.add_argument("--only", nargs="*", default=["sdpa", "decode", "wait"], choices=["sdpa", "decode", "wait"])
    parser.add_argument("--short", type=int, nargs=3, default=[4, 100, 64], metavar=("ROWS", "TOKENS", "NEW"))
    parser.add_argument("--long", type=int, nargs=3, default=[2, 4500, 24], metavar=("ROWS", "TOKENS", "NEW"))
    parser.add_argument("--shared", type=int, nargs="*", default=[16, 32, 64, 128, 256], help="wait: S values")
    parser.add_argument("--wait-rows", type=int, default=4)
    parser.add_argument("--suffix", type=int, default=48, help="wait: each row's own tokens")
    parser.add_argument("--reps", type=int, default=2, help="timed runs per setting (default 2)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.reps} reps per setting")
    if "sdpa" in args.only:
        sdpa([args.short[1], args.long[1]], args.short[0], max(args.reps, 10))
    if {"decode", "wait"} & set(args.only):
        path = resolve_model_path(args.model)
        tok, model = load_causal_lm(str(path), "float32")
        model.eval()
        print(f"model {args.model} ({path}), attention {model.config._attn_implementation}")
        if "decode" in args.only:
            cases = [
                (f"{args.short[0]} x {args.short[1]} tokens", *args.short),
                (f"{args.long[0]} x {args.long[1]} tokens", *args.long),
            ]
            decode(model, tok, [(n, r, t, g) for n, r, t, g in cases], args.reps)
        if "wait" in args.only:
            wait(model, tok, args.shared, args.wait_rows, args.suffix, args.reps)


if __name__ == "__main__":
    main()
