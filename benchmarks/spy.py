"""py-spy on every process of a run: where each role's CPU goes, by package and by function.

``Spy`` starts one ``py-spy record`` (raw format, non-blocking, idle threads left out) per
process of each role for the duration of a ``with`` block, stops them with SIGINT (py-spy
then writes its file) within a bounded wait, and sums the samples per role by the leaf
frame: its package (``uvicorn``, ``starlette``, ``nemo_gym``, ``gym_bridge``, ...) and its
function. A sample is one stack seen running, so shares are shares of busy time.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

PY_SPY = Path(sys.executable).with_name("py-spy")
_FRAME = re.compile(r"^(?P<function>.*?) \((?P<file>[^()]*)\)$")


@dataclass
class RoleProfile:
    """The samples of one role's processes, by the leaf frame's package and function."""

    role: str
    samples: int = 0
    packages: Counter[str] = field(default_factory=Counter)
    functions: Counter[str] = field(default_factory=Counter)

    def top(self, counter: Counter[str], n: int) -> str:
        """``name share%`` of the ``n`` biggest entries, for a table cell."""
        if not self.samples:
            return "-"
        return ", ".join(f"{name} {100 * count / self.samples:.0f}%" for name, count in counter.most_common(n))


class Spy:
    """``py-spy record`` on every pid of every role while the block runs."""

    def __init__(self, roles: dict[str, list[int]], out_dir: Path, rate_hz: int = 50) -> None:
        self.roles = roles
        self.out_dir = out_dir
        self.rate_hz = rate_hz
        self._procs: list[tuple[str, Path, subprocess.Popen[bytes]]] = []

    def __enter__(self) -> Spy:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for role, pids in self.roles.items():
            for pid in pids:
                out = self.out_dir / f"{role}-{pid}.txt"
                command = [str(PY_SPY), "record", "--pid", str(pid), "--rate", str(self.rate_hz), "--format", "raw",
                           "--output", str(out), "--nonblocking", "--nolineno"]  # fmt: skip
                proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                self._procs.append((role, out, proc))
        return self

    def __exit__(self, *exc: object) -> None:
        for _, _, proc in self._procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGINT)
        for _, _, proc in self._procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)

    def profiles(self) -> list[RoleProfile]:
        """One profile per role, from the files py-spy wrote (a process that ended early has none)."""
        by_role = {role: RoleProfile(role) for role in self.roles}
        for role, out, _ in self._procs:
            if out.exists():
                _add_samples(by_role[role], out.read_text(errors="replace"))
        return list(by_role.values())


def _add_samples(profile: RoleProfile, raw: str) -> None:
    """Add py-spy's raw lines (``frame;frame;...;leaf count``) to ``profile``."""
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        leaf = stack.rsplit(";", 1)[-1]
        match = _FRAME.match(leaf)
        function, file = (match["function"], match["file"]) if match else (leaf, "")
        package = _package(file)
        profile.samples += count
        profile.packages[package] += count
        profile.functions[f"{package}:{function}"] += count


def _package(file: str) -> str:
    """The top-level package of a frame's file as py-spy shortens it (``uvicorn/protocols/...`` -> uvicorn)."""
    if not file:
        return "?"
    first = file.replace("\\", "/").split("/", 1)[0]
    return first.removesuffix(".py") or "?"


def markdown_table(title: str, profiles: list[RoleProfile], top: int = 5) -> list[str]:
    """A table of each role's samples, top packages and top functions (by own samples)."""
    return [
        title,
        "",
        "| process | samples | top packages (own samples) | top functions (own samples) |",
        "|---|---|---|---|",
        *(
            f"| {p.role} | {p.samples} | {p.top(p.packages, top)} | {p.top(p.functions, top)} |"
            for p in profiles
            if p.samples
        ),
    ]
