"""Our CPU engine against vLLM's CPU build: the same raw ``/v1/chat/completions`` load on both servers.

Each workload sends the held-out arith chats (``examples/data/arith_heldout.jsonl``, ~116 tokens rendered) as
single-choice requests, temperature 1, ``max_tokens`` 24 (the arith eval's), from C concurrent clients (C = 1, 8, 32),
with per-request seeds or without. Per engine and workload:

- **tokens/s**: completion tokens of all requests / wall time (each client sends ``--rounds`` requests in turn,
  twice that at C=1);
- **TTFT**: neither server is asked to stream (ours does not), so time to first token is the latency of a
  ``max_tokens=1`` request, C sent at once (median): prefill, one token and the HTTP round trip;
- the ratio ours / vLLM of both.

The engines run interleaved: every repetition measures each workload on ours, then on each vLLM server, so a change
in the machine's load falls on all; the tables hold medians of ``--reps``. A workload that fails on an engine (vLLM's
CPU build crashes with per-request seeds at concurrency 32: "CPU Generator does not use offset") is reported as
failed with its error, and an engine that stops answering is left out from there on; those seeded workloads run
last, so everything else is measured first.

The servers: ``--ours URL`` / ``--vllm URL``, or started here (``--start``): ``gym-bridge serve --model smollm2``
and, when ``scripts/vllm_cpu.sh`` finds its venv, ``scripts/vllm_cpu.sh serve`` once per ``--vllm-dtype``
(``float32``, as ours, by default; ``auto`` is what ``vllm serve`` picks: bfloat16 for this float32 model).
Run: ``make bench-engine`` (or ``uv run python benchmarks/engine_compare.py --start``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "examples" / "data" / "arith_heldout.jsonl"
VLLM_SCRIPT = ROOT / "scripts" / "vllm_cpu.sh"


def chats() -> list[list[dict[str, str]]]:
    """The held-out arith chats, in file order."""
    with DATA.open() as f:
        return [json.loads(line)["responses_create_params"]["input"] for line in f]


@dataclass
class Cell:
    """One workload's measurements on one engine, over the repetitions."""

    tokens_per_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    tokens_per_request: list[float] = field(default_factory=list)
    error: str | None = None

    def median(self, values: list[float]) -> float | None:
        return statistics.median(values) if values else None


async def post(
    client: httpx.AsyncClient, model: str, chat: list[dict[str, str]], max_tokens: int, seed: int | None
) -> int:
    """One chat completion; its completion tokens."""
    body: dict[str, object] = {"model": model, "messages": chat, "max_tokens": max_tokens, "temperature": 1.0,
                               "top_p": 1.0}  # fmt: skip
    if seed is not None:
        body["seed"] = seed
    response = await client.post("/chat/completions", json=body)
    response.raise_for_status()
    return int(response.json()["usage"]["completion_tokens"])


async def throughput(url: str, model: str, concurrency: int, requests: int, seeded: bool, max_tokens: int,
                     prompts: list[list[dict[str, str]]]) -> tuple[float, float]:  # fmt: skip
    """C clients, each sending ``requests`` requests in turn: (completion tokens/s, tokens per request)."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    counts: list[int] = []
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def worker(c: int) -> None:
            for r in range(requests):
                k = c * requests + r
                counts.append(await post(client, model, prompts[k % len(prompts)], max_tokens, k if seeded else None))

        start = time.perf_counter()
        await asyncio.gather(*(worker(c) for c in range(concurrency)))
        wall = time.perf_counter() - start
    return sum(counts) / wall, sum(counts) / len(counts)


async def first_token(
    url: str, model: str, concurrency: int, seeded: bool, prompts: list[list[dict[str, str]]]
) -> float:
    """The median latency of C ``max_tokens=1`` requests sent at once."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def one(k: int) -> float:
            start = time.perf_counter()
            await post(client, model, prompts[k % len(prompts)], 1, k if seeded else None)
            return time.perf_counter() - start

        return statistics.median(await asyncio.gather(*(one(k) for k in range(concurrency))))


def wait_ready(url: str, timeout_s: float) -> None:
    """Until ``url``/models answers (a server starting), at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")


def start_servers(
    stack: ExitStack, args: argparse.Namespace, vllm_flags: tuple[str, ...] = (), only: str | None = None
) -> dict[str, str]:
    """Start ours and, if its venv is there, one vLLM server per ``--vllm-dtype`` on loopback (``vllm_flags`` added to
    its command); URLs by engine name. ``only``: that engine's server alone."""
    urls: dict[str, str] = {}
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    ours = Path(sys.executable).with_name("gym-bridge")
    commands = {"ours": [str(ours), "serve", "--model", "smollm2", "--port", str(args.ours_port),
                         "--served-model-name", "smollm2"]}  # fmt: skip
    ports = {"ours": args.ours_port}
    envs: dict[str, dict[str, str]] = {}
    for k, threads in enumerate(args.ours_threads):  # our server again, its worker at another thread count
        name = f"ours {threads}t"
        ports[name] = args.ours_port + 100 + k
        commands[name] = [*commands["ours"][:-3], str(ports[name]), "--served-model-name", "smollm2"]
        envs[name] = {"OMP_NUM_THREADS": str(threads)}
    status = subprocess.run(["bash", str(VLLM_SCRIPT), "check"], capture_output=True, text=True)
    if status.returncode == 0:
        for k, dtype in enumerate(args.vllm_dtype):
            name = vllm_name(dtype)
            ports[name] = args.vllm_port + k
            commands[name] = ["bash", str(VLLM_SCRIPT), "serve", "--port", str(ports[name]), "--dtype", dtype,
                              *vllm_flags]
    else:
        print(f"vLLM's CPU build is not installed ({status.stdout.strip() or status.stderr.strip()}): ours alone")
    if only is not None:
        commands = {name: command for name, command in commands.items() if name == only}
    for name, command in commands.items():
        log = stack.enter_context((log_dir / f"{name}.log").open("w"))
        env = {**os.environ, **envs.get(name, {})}
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
        )
        stack.callback(_stop, proc)
        urls[name] = f"http://127.0.0.1:{ports[name]}/v1"
    for name, url in urls.items():
        wait_ready(url, 900)
        print(f"{name} ready at {url}", flush=True)
    return urls


def vllm_name(dtype: str) -> str:
    """The engine name of vLLM's server at ``dtype`` in the tables."""
    return f"vLLM {dtype}"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group; SIGKILL after 30 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def workloads(args: argparse.Namespace) -> list[tuple[int, bool]]:
    """Every (concurrency, seeded) pair; seeded ones at the highest concurrency last, since they crash vLLM's CPU
    build (its engine stops, so nothing after them could be measured on it)."""
    pairs = [(c, s) for c in args.concurrency for s in (False, True)]
    risky = [(c, s) for c, s in pairs if s and c == max(args.concurrency)]
    return [p for p in pairs if p not in risky] + risky


def run(urls: dict[str, str], args: argparse.Namespace) -> dict[tuple[str, int, bool], Cell]:
    """Every workload on every engine, the engines interleaved, ``args.reps`` times (see :func:`workloads`)."""
    prompts = chats()
    cells: dict[tuple[str, int, bool], Cell] = {}
    dead: set[str] = set()
    for url in urls.values():  # warm-up: the first requests pay for lazy start-up
        asyncio.run(throughput(url, args.model, 2, 1, False, 4, prompts))
    order = workloads(args)
    safe = [w for w in order if not (w[1] and w[0] == max(args.concurrency))]
    schedule = [w for _ in range(args.reps) for w in safe] + [
        w for w in order if w not in safe for _ in range(args.reps)
    ]
    for rep, (concurrency, seeded) in enumerate(schedule):
        for name, url in urls.items():
            cell = cells.setdefault((name, concurrency, seeded), Cell())
            if name in dead or cell.error:
                continue
            requests = args.rounds * (2 if concurrency == 1 else 1)
            try:
                tps, per = asyncio.run(throughput(url, args.model, concurrency, requests, seeded, args.max_tokens,
                                                  prompts))  # fmt: skip
                ttft = asyncio.run(first_token(url, args.model, concurrency, seeded, prompts))
            except (httpx.HTTPError, OSError) as exc:
                cell.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
                print(f"{name} C={concurrency} seeded={seeded}: FAILED {cell.error}", flush=True)
                if not _alive(url):
                    dead.add(name)
                    print(f"{name} stopped answering: left out from here on", flush=True)
                continue
            cell.tokens_per_s.append(tps)
            cell.ttft_s.append(ttft)
            cell.tokens_per_request.append(per)
            print(f"{rep:>3} {name} C={concurrency} seeded={seeded}: {tps:.1f} tok/s, TTFT {ttft * 1e3:.0f} ms, "
                  f"{per:.1f} tok/req, load {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    return cells


def _alive(url: str) -> bool:
    try:
        return httpx.get(f"{url}/models", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def table(cells: dict[tuple[str, int, bool], Cell], engines: list[str], args: argparse.Namespace) -> str:
    """Two markdown tables, tokens/s and TTFT: every engine's medians, then each ratio that is > 1 when ours leads
    (ours/other tokens/s, other/ours TTFT)."""
    others = [e for e in engines if e != "ours"]
    out = []
    for title, key, scale, ours_on_top in (
        ("completion tokens/s", "tokens_per_s", 1.0, True),
        ("TTFT ms (a max_tokens=1 request, C sent at once)", "ttft_s", 1e3, False),
    ):
        heads = [f"ours/{e}" if ours_on_top else f"{e}/ours" for e in others]
        out += [title, "", "| C | seeds | " + " | ".join(engines + heads) + " |",
                "|---|---|" + "---|" * (len(engines) + len(heads))]  # fmt: skip
        for concurrency, seeded in workloads(args):
            got = {e: cells.get((e, concurrency, seeded)) for e in engines}
            values = {e: _med(got[e], key) for e in engines}
            shown = [_fmt(values[e], got[e], scale) for e in engines]
            ratios = [
                _ratio(values["ours"], values[e]) if ours_on_top else _ratio(values[e], values["ours"]) for e in others
            ]
            out.append(f"| {concurrency} | {'yes' if seeded else 'no'} | " + " | ".join(shown + ratios) + " |")
        out.append("")
    return "\n".join(out)


def _med(cell: Cell | None, name: str) -> float | None:
    return None if cell is None else cell.median(getattr(cell, name))


def _fmt(value: float | None, cell: Cell | None, scale: float = 1.0) -> str:
    if cell is None:
        return "-"
    if cell.error and value is None:
        return "failed"
    return "-" if value is None else f"{value * scale:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ours", default=None, help="URL of a running gym-bridge serve (…/v1)")
    parser.add_argument("--vllm", default=None, help="URL of a running vLLM server (…/v1)")
    parser.add_argument("--start", action="store_true", help="start both servers here (vLLM's if installed)")
    parser.add_argument("--ours-port", type=int, default=18010)
    parser.add_argument("--vllm-port", type=int, default=18011)
    parser.add_argument("--vllm-dtype", nargs="+", default=["float32"],
                        help="one vLLM server per --dtype (auto: bfloat16 for this float32 model)")  # fmt: skip
    parser.add_argument("--ours-threads", type=int, nargs="*", default=[],
                        help="with --start: also ours with OMP_NUM_THREADS=N (its worker at N threads)")  # fmt: skip
    parser.add_argument("--model", default="smollm2", help="the served model name on both")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=2, help="requests each client sends in turn (C=1: twice this)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--log-dir", default="runs/bench-engine")
    args = parser.parse_args()
    with ExitStack() as stack:
        urls = {k: v for k, v in (("ours", args.ours), (vllm_name(args.vllm_dtype[0]), args.vllm)) if v}
        if args.start:
            urls = start_servers(stack, args)
        if not urls:
            parser.error("give --ours / --vllm URLs, or --start")
        load_before = os.getloadavg()
        cells = run(urls, args)
        load_after = os.getloadavg()
    print(f"\nload average before {load_before[0]:.2f} / {load_before[1]:.2f}, after {load_after[0]:.2f} / "
          f"{load_after[1]:.2f}; medians of {args.reps}")  # fmt: skip
    print(table(cells, list(urls), args))
    for (name, concurrency, seeded), cell in sorted(cells.items()):
        if cell.error:
            print(f"{name} C={concurrency} seeded={seeded}: {cell.error}")


if __name__ == "__main__":
    main()
