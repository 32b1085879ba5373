"""Helpers shared by the viewer's browser test and the compare / viewer benchmarks (not a test module):

- :func:`synthetic_run`: a finished run folder shaped like ``gym-bridge eval``'s (row ids, traces with tokens
  and logprobs, tool calls, drift, truncation, masked samples), of any size, without Gym;
- :class:`Chromium`: Debian's headless chromium driven through ``chromedriver`` (W3C WebDriver over httpx).
"""

from __future__ import annotations

import base64
import json
import random
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import httpx

from gym_bridge.eval.records import row_id
from gym_bridge.testing import wait_until

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
MISSING = (
    "the browser test needs Debian's chromium and chromium-driver (/usr/bin/chromium, /usr/bin/chromedriver): "
    "apt-get update && apt-get install -y chromium chromium-driver"
)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1400,900"]  # fmt: skip
AGENTS = ["example_single_tool_call_simple_agent", "lc_equivalence_rule_simple_agent", "math_with_judge_simple_agent"]
WORDS = "the of and to in is that for it as with was on be at by this had not are but from or have an they".split()


def gym_row(i: int, agent: str) -> dict[str, Any]:
    return {"responses_create_params": {"input": [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}]},
            "agent_ref": {"name": agent}, "expected_answer": str(2 * i)}  # fmt: skip


def _completion(rng: random.Random, i: int, k: int, skill: float, row: dict[str, Any]) -> dict[str, Any]:
    tool = rng.random() < 0.3
    length = rng.randint(8, 48)
    tokens = [(" " if j else "") + rng.choice(WORDS) for j in range(length)]
    right = rng.random() < skill
    answer = str(2 * i) if right else str(2 * i + 1)
    tokens += [" ", answer]
    logprobs = [round(-rng.expovariate(3.0), 3) for _ in tokens]
    trace: list[dict[str, Any]] = [{"role": "user", "text": f"<|im_start|>user\nQuestion {i}<|im_end|>\n"}]
    items: list[dict[str, Any]] = []
    if tool:
        trace.append({"role": "assistant", "tokens": ['<tool_call>', '{"name": "get_weather"}', "</tool_call>"],
                      "logprobs": [-0.01, -0.2, -0.05]})  # fmt: skip
        trace.append({"role": "user", "text": '<|im_start|>tool\n{"city": "Paris", "weather": "sunny"}<|im_end|>\n'})
        items += [{"type": "function_call", "name": "get_weather", "arguments": '{"city": "Paris"}', "call_id": "c1"},
                  {"type": "function_call_output", "call_id": "c1", "output": '{"weather": "sunny"}'}]  # fmt: skip
    trace.append({"role": "assistant", "tokens": tokens, "logprobs": logprobs})
    text = "".join(tokens)
    items.append({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]})
    truncated = rng.random() < 0.03
    drift = rng.random() < 0.02
    masked = rng.random() < 0.02
    reward = 1.0 if right else 0.0
    gym_result: dict[str, Any] = {"responses_create_params": row["responses_create_params"],
                                  "response": {"output": items}, "reward": reward,
                                  "expected_answer": row["expected_answer"], "extracted_answer": answer}  # fmt: skip
    if drift:
        gym_result["token_drift"] = {"turn": 1 if tool else 0, "position": 12, "expected": [1, 2], "got": [1, 3]}
    return {"reward": reward, "truncated": truncated,
            "termination": "max_seq_len" if truncated else "token_drift" if drift else "stop",
            "text": text, "turn_texts": [text], "turns": 2 if tool else 1, "prompt_tokens": 20,
            "generated_tokens": len(tokens), "total_tokens": 20 + len(tokens), "masked": masked,
            "failure_kind": "judge_failed" if masked else None, "token_drift": drift, "trace": trace,
            "gym_result": gym_result}  # fmt: skip


def synthetic_run(
    folder: Path,
    prompts: int,
    n: int,
    *,
    skill: float = 0.5,
    seed: int = 0,
    sha: str = "synthetic",
    prompts_total: int | None = None,
) -> Path:
    """A finished run folder of ``prompts`` groups of ``n`` completions; each passes with probability ``skill``.

    ``prompts_total`` (default ``prompts``) is the dataset size ``run.json`` records: larger when the caller adds
    failed groups past the completed ones.

    The same ``seed`` with another ``skill`` gives the same rows (so two such runs compare prompt by prompt).
    """
    folder.mkdir(parents=True)
    rng = random.Random(seed)
    config = {"pass_threshold": 1.0, "config_paths": ["a.yaml"], "gym_overrides": {}}
    run = {"fingerprint": {"dataset_sha256": sha, "config_paths": ["a.yaml"], "gym_overrides": {}},
           "config": config, "model": f"synthetic policy (skill {skill})", "prompts_total": prompts if prompts_total is None else prompts_total,
           "sessions": [{"started": 0.0, "rollouts_started": 1.0, "ended": 2.0, "outcome": "finished"}]}  # fmt: skip
    (folder / "run.json").write_text(json.dumps(run))
    with (folder / "results.jsonl").open("w") as f:
        for i in range(prompts):
            row = gym_row(i, AGENTS[i % len(AGENTS)])
            record = {"prompt_idx": i, "row_id": row_id(row), "line": i + 1, "agent": row["agent_ref"]["name"],
                      "completions": [_completion(rng, i, k, skill, row) for k in range(n)],
                      "elapsed_s": 0.5, "finished_at": 1.0 + i}  # fmt: skip
            f.write(json.dumps(record) + "\n")
    return folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Chromium:
    """One headless chromium session with a fresh profile, driven through chromedriver's W3C WebDriver API."""

    def __init__(self) -> None:
        if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
            raise RuntimeError(MISSING)
        self.profile = Path(tempfile.mkdtemp(prefix="gym-bridge-chromium-"))
        port = _free_port()
        self.driver = subprocess.Popen([str(CHROMEDRIVER), f"--port={port}"], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)  # fmt: skip
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        try:
            wait_until(self._driver_ready, 30, "chromedriver answering /status", poll_s=0.05)
            options = {"binary": str(CHROMIUM), "args": [*FLAGS, f"--user-data-dir={self.profile}"]}
            caps = {"browserName": "chrome", "goog:chromeOptions": options, "goog:loggingPrefs": {"browser": "ALL"}}
            self.session = self._call("POST", "/session", {"capabilities": {"alwaysMatch": caps}})["sessionId"]
        except BaseException:
            self.close()
            raise

    def _driver_ready(self) -> bool:
        try:
            return bool(self.http.get("/status").json()["value"]["ready"])
        except (httpx.HTTPError, ValueError, KeyError):
            return False

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        response = self.http.request(method, path, json=body)
        value = response.json()["value"]
        if response.status_code != 200:
            raise RuntimeError(f"WebDriver {method} {path}: {value.get('error')}: {value.get('message')}")
        return value

    def _s(self, path: str) -> str:
        return f"/session/{self.session}{path}"

    def open(self, url: str) -> None:
        """Navigate and wait for the page's load event (WebDriver's default page-load strategy)."""
        self._call("POST", self._s("/url"), {"url": url})

    def run(self, script: str, *args: Any) -> Any:
        return self._call("POST", self._s("/execute/sync"), {"script": script, "args": list(args)})

    def find(self, css: str) -> str:
        element = self._call("POST", self._s("/element"), {"using": "css selector", "value": css})
        return str(next(iter(element.values())))

    def click(self, css: str) -> None:
        self._call("POST", self._s(f"/element/{self.find(css)}/click"), {})

    def type(self, css: str, text: str) -> None:
        self._call("POST", self._s(f"/element/{self.find(css)}/value"), {"text": text})

    def console(self) -> list[dict[str, Any]]:
        """The browser's console and page errors since the last call (chromedriver's log endpoint)."""
        entries: list[dict[str, Any]] = self._call("POST", self._s("/se/log"), {"type": "browser"})
        return entries

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self._call("GET", self._s("/screenshot"))))

    def close(self) -> None:
        session = getattr(self, "session", None)
        if session is not None:
            try:
                self._call("DELETE", self._s(""))
            except (httpx.HTTPError, RuntimeError):
                pass
        self.driver.terminate()
        try:
            self.driver.wait(10)
        except subprocess.TimeoutExpired:
            self.driver.kill()
        self.http.close()
        shutil.rmtree(self.profile, ignore_errors=True)
