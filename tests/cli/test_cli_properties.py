"""Every subcommand of ``gym-bridge`` driven through ``cli.main`` (in process: one import of torch and matplotlib
for all examples) with generated option values and paths of every file type, made fresh in a folder of their
own for each example: a regular file of junk, a valid run folder, one whose files are links or hard links to
files outside, a link to a file outside (or to a run folder: the folder a user names through a link is the
user's, so that one lies inside), a dangling link to a name outside, a second hard link of a file outside, a
FIFO, a folder (empty or of junk), a missing path, a path under a file and a folder without write permission.

Each run must end with exit code 0, 1 or 2 (a usage error's ``SystemExit`` too), with no traceback on stderr or
in a log record and no "internal error" line (a bug: ``cli.main`` says so in one line), within
:data:`EXAMPLE_S`, and with nothing written outside its folder: the sibling folder that holds every link's target
and every hard link's other name is compared byte by byte before and after, and the command runs with that
folder as its working directory and ``TMPDIR``. Commands that would start servers or Ray (``serve``, ``eval``,
``train``, ``rescore``) get only arguments that fail before anything starts: no valid model or source run, a dead
endpoint, a config that cannot be one."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import pytest
from hypothesis import HealthCheck, Phase, event, given, settings, strategies as st

from gym_bridge import cli
from gym_bridge.eval.records import row_id
from gym_bridge.gym.servers.reaper import free_port

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples/eval_equivalence_tools.yaml"
DATASET = REPO / "examples/data/gym_rows.jsonl"
TRAIN_EXAMPLE = REPO / "examples/grpo_nemo_gym.yaml"
EXAMPLE_S = 120.0
"""The bound on one command (a generous wait, not a timing claim): past it the command hangs (a FIFO, a loop)."""
DEAD = f"http://127.0.0.1:{free_port('127.0.0.1')}/v1"
"""An endpoint where nothing listens: refused at once."""


def _settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


KINDS = ["regular", "run", "run_links", "run_hardlinks", "link_file", "link_dir", "link_run", "dangling", "hardlink",
         "fifo", "empty_dir", "junk_dir", "missing", "under_file", "unwritable"]  # fmt: skip
"""How a path argument is made; ``run``, ``run_links``, ``run_hardlinks`` and ``link_run``: a valid finished eval run
folder (``run_links``: each file a link to one outside; ``run_hardlinks``: a second name of one outside)."""
NOT_A_RUN = [kind for kind in KINDS if "run" not in kind]
"""For commands that would start Gym on a run folder they can read (``rescore``, ``eval --resume``)."""
TEXT = st.text(st.characters(blacklist_characters="\x00"), max_size=12) | st.sampled_from(
    ["", "-", "--", "..", "~", "\x1b[31m", "\u202e", "\udcff", "a=b", "=", "++=1", "x" * 300]
)
"""Text an argument may hold: any character but NUL (argv cannot hold one), lone surrogates (undecodable bytes in
argv) included."""
NUMBER = (
    st.integers(-(2**70), 2**70).map(str)
    | st.floats().map(repr)
    | st.sampled_from(["nan", "inf", "-inf", "1e999", "10^11", "0x10", "1_000", " 7 ", "9" * 5000])
    | TEXT
)
JUNK = st.binary(max_size=64) | st.sampled_from([b"{}", b"[]", b"a: [1\n", b"\xef\xbb\xbf{}", b"\x00" * 32, b"null"])


@dataclass
class Sandbox:
    """One example's folder: ``inside`` (paths, working directory, ``TMPDIR``), ``outside`` (link targets, hard
    links' other names: must not change)."""

    inside: Path
    outside: Path
    made: list[Path] = field(default_factory=list)

    def path(self, kind: str, data: bytes) -> str:
        """A new path of ``kind`` under :attr:`inside`; what it points at (or shares an inode with) lies outside."""
        n = len(self.made)
        path = self.inside / f"p{n}-{kind}"
        target = self.outside / f"t{n}"
        if kind == "regular":
            path.write_bytes(data)
        elif kind.startswith("run"):
            write_run(path if kind == "run" else target, n)
            if kind != "run":
                path.mkdir()
                for name in [*os.listdir(target), "report.md", "metrics.json"]:
                    if not (target / name).exists():
                        (target / name).write_bytes(b"precious\n")
                    link = os.symlink if kind == "run_links" else os.link
                    link(target / name, path / name)
        elif kind in ("link_file", "hardlink"):
            target.write_bytes(data or b"precious\n")
            (os.symlink if kind == "link_file" else os.link)(target, path)
        elif kind in ("link_dir", "link_run"):  # the folder a user names through a link is the user's: inside
            linked = self.inside / f"linked{n}"
            if kind == "link_run":
                write_run(linked, n)
            else:
                linked.mkdir()
            path.symlink_to(linked)
        elif kind == "dangling":
            path.symlink_to(target)
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind in ("empty_dir", "junk_dir", "unwritable"):
            path.mkdir()
            if kind == "junk_dir":
                for name in ("run.json", "results.jsonl", "metrics.jsonl", "config.json", "tokenizer.json"):
                    (path / name).write_bytes(data)
            if kind == "unwritable":
                path.chmod(0o555)
        elif kind == "under_file":
            path.write_bytes(data)
            path = path / "child"
        self.made.append(path)
        return str(path)


def write_run(folder: Path, seed: int, prompts: int = 3) -> None:
    """A valid finished eval run folder of ``prompts`` prompts (rewards differ with ``seed``)."""
    folder.mkdir()
    run = {"fingerprint": {"dataset_sha256": "d", "num_generations_per_prompt": 2}, "config": {}, "model": "m",
           "prompts_total": prompts, "sessions": [{"started": 0.0, "rollouts_started": 1.0, "ended": 2.0}]}  # fmt: skip
    (folder / "run.json").write_text(json.dumps(run))
    lines = []
    for i in range(prompts):
        row = {"responses_create_params": {"input": [{"role": "user", "content": f"q{i}"}]}}
        rewards = [float((i + seed) % 2), 1.0]
        completions = [{"reward": r, "gym_result": {**row, "reward": r}} for r in rewards]
        lines.append({"prompt_idx": i, "row_id": row_id(row), "line": i + 1, "agent": "a", "completions": completions})
    (folder / "results.jsonl").write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))


def snapshot(root: Path) -> dict[str, object]:
    """Every entry under ``root``: a regular file by its bytes and mode, a link by its target, else its kind (not a
    file's link count: a hard link inside replaced by a file of its own lowers it, which is right)."""
    seen: dict[str, object] = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        if path.is_symlink():
            seen[str(path)] = ("link", os.readlink(path))
        elif path.is_file():
            seen[str(path)] = ("file", path.read_bytes(), info.st_mode)
        else:
            seen[str(path)] = ("other", info.st_mode)
    return seen


@contextlib.contextmanager
def inside(sandbox: Sandbox) -> Iterator[None]:
    """The sandbox as working directory and temporary folder for the duration."""
    cwd, tmp = os.getcwd(), tempfile.tempdir
    os.chdir(sandbox.inside)
    tempfile.tempdir = str(sandbox.inside)
    try:
        yield
    finally:
        os.chdir(cwd)
        tempfile.tempdir = tmp


def run_main(argv: list[str]) -> int:
    """``cli.main(argv)`` on a thread that must end within :data:`EXAMPLE_S`; a usage error's exit code too."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["code"] = cli.main(argv)
        except SystemExit as exc:
            box["code"] = exc.code if isinstance(exc.code, int) else 2
        except BaseException as exc:
            box["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(EXAMPLE_S)
    assert not worker.is_alive(), f"gym-bridge {argv}: still running after {EXAMPLE_S:.0f} s (a FIFO? a loop?)"
    if "error" in box:
        raise AssertionError(f"gym-bridge {argv}: cli.main raised") from box["error"]  # type: ignore[arg-type]
    code = box["code"]
    assert isinstance(code, int)
    return code


def drive(tmp_path: Path, capsys, caplog, argv_of, draw_paths: list[tuple[str, bytes]]) -> None:
    """Make the paths, run the command, check the four properties."""
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    sandbox = Sandbox(root / "inside", root / "outside")
    sandbox.inside.mkdir()
    sandbox.outside.mkdir()
    paths = [sandbox.path(kind, data) for kind, data in draw_paths]
    argv = argv_of(paths)
    before = snapshot(sandbox.outside)
    capsys.readouterr()
    caplog.clear()
    with inside(sandbox):
        code = run_main(argv)
    err = capsys.readouterr().err
    shown = f"gym-bridge {argv!r}: exit {code}, stderr:\n{err[-3000:]}"
    assert code in (0, 1, 2), shown
    assert "Traceback" not in err and "internal error" not in err, shown
    logged = [r for r in caplog.records if r.exc_info and r.levelno >= logging.INFO]
    assert not logged, f"{shown}\nlogged with a traceback: {logged[0].getMessage()}"
    assert snapshot(sandbox.outside) == before, f"{shown}\nsomething outside the folder changed"
    event(f"exit {code}: {err.replace(str(sandbox.inside), '~').split(chr(10))[0][:70]}")


def paths(kinds: list[str], count: int) -> st.SearchStrategy[list[tuple[str, bytes]]]:
    return st.lists(st.tuples(st.sampled_from(kinds), JUNK), min_size=count, max_size=count)


IN_RANGE = {"--level": ["0.5", "0.999"], "--resamples": ["100", "1000"], "--seed": ["0", "4294967295"],
            "--fail-if-worse": ["0", "0.25"], "--max-new-tokens": ["1", "8"], "--temperature": ["0", "1.5"],
            "--top-p": ["1", "0.1"], "--answer-tokens": ["1", "4"], "--timeout": ["0.5", "2"]}  # fmt: skip
"""Values each option takes, so that most examples get past the parser to the paths."""


def options(draw: st.DrawFn, names: list[str]) -> list[str]:
    """A few of ``names`` as ``--name=value``: mostly a value in range, else any generated one."""
    chosen = draw(st.lists(st.sampled_from(names), max_size=3, unique=True))
    return [f"{name}={value(draw, name)}" for name in chosen]


def value(draw: st.DrawFn, name: str) -> str:
    """A value of option ``name``: one in range three times in four, else any generated one."""
    if draw(st.integers(0, 3)) < 3:
        return draw(st.sampled_from(IN_RANGE[name]))
    return draw(NUMBER)


@_settings(25)
@given(data=st.data(), files=paths(KINDS, 3))
def test_report_and_compare(tmp_path, capsys, caplog, data, files) -> None:
    compare = data.draw(st.booleans())
    extra = options(data.draw, ["--level", "--resamples", "--seed", "--fail-if-worse"]) if compare else []

    def argv(p: list[str]) -> list[str]:
        return ["compare", p[0], p[1], "--out", p[2], *extra] if compare else ["report", p[0]]

    drive(tmp_path, capsys, caplog, argv, files)


@_settings(12)
@given(data=st.data(), files=paths(NOT_A_RUN, 3))
def test_rescore(tmp_path, capsys, caplog, data, files) -> None:
    overrides = data.draw(st.lists(TEXT.map(lambda t: f"gym_overrides.{t}=1"), max_size=2))
    config = data.draw(st.booleans())

    def argv(p: list[str]) -> list[str]:
        return ["rescore", p[0], "--out", p[1], *(["--config", p[2]] if config else []), *overrides]

    drive(tmp_path, capsys, caplog, argv, files)


@_settings(12)
@given(data=st.data(), files=paths(NOT_A_RUN, 3))
def test_eval(tmp_path, capsys, caplog, data, files) -> None:
    """A dead endpoint: a new run fails its preflight before its folder is made; ``--resume`` reads the folder."""
    which = data.draw(st.sampled_from(["config", "dataset", "output_dir"]))
    resume = ["--resume"] if data.draw(st.booleans()) else []

    def argv(p: list[str]) -> list[str]:
        config = p[0] if which == "config" else str(EXAMPLE)
        dataset = p[1] if which == "dataset" else str(DATASET)
        return ["eval", config, f"output_dir={p[2]}", f"dataset={dataset}", f"base_urls=[{DEAD}]", "model_name=m",
                "--no-progress", *resume]  # fmt: skip

    drive(tmp_path, capsys, caplog, argv, files)


@_settings(10)
@given(data=st.data(), files=paths(NOT_A_RUN, 2))
def test_train(tmp_path, capsys, caplog, data, files) -> None:
    """Only a config that cannot be one (a path of junk or no file): nothing may start."""
    flags = data.draw(st.lists(st.sampled_from(["--resume", "--smoke", "--no-progress"]), unique=True, max_size=2))
    overrides = data.draw(st.lists(TEXT.map(lambda t: f"grpo.{t}=1"), max_size=2))

    def argv(p: list[str]) -> list[str]:
        return ["train", p[0], "--out", p[1], *flags, *overrides]

    drive(tmp_path, capsys, caplog, argv, files)


@_settings(12)
@given(data=st.data(), files=paths(NOT_A_RUN, 1))
def test_serve(tmp_path, capsys, caplog, data, files) -> None:
    """A model or tokenizer folder that is none (or a dead upstream): one line before anything serves."""
    upstream = data.draw(st.booleans())
    extra = options(data.draw, ["--max-new-tokens", "--temperature", "--top-p", "--answer-tokens"])

    def argv(p: list[str]) -> list[str]:
        where = ["--upstream", DEAD, "--tokenizer", p[0]] if upstream else ["--model", p[0]]
        return ["serve", *where, "--port", "0", *extra]

    drive(tmp_path, capsys, caplog, argv, files)


@_settings(12)
@given(data=st.data())
def test_check_endpoint(tmp_path, capsys, caplog, data) -> None:
    urls = data.draw(st.lists(st.sampled_from([DEAD, "http://127.0.0.1:0/v1", "file:///etc/passwd", "ftp://x/v1",
                                               "http://[::1", "http://\x1b[31m/v1", "//"]) | TEXT,
                              min_size=1, max_size=2))  # fmt: skip
    model = data.draw(TEXT)
    timeout = value(data.draw, "--timeout")
    tools = ["--tools"] if data.draw(st.booleans()) else []
    drive(tmp_path, capsys, caplog, lambda _: ["check-endpoint", *urls, f"--model={model}", f"--timeout={timeout}",
                                               *tools], [])  # fmt: skip


@_settings(6)
@given(data=st.data(), files=paths(["regular", "fifo", "under_file", "hardlink", "link_file", "dangling"], 1))
def test_build_tiny_and_backends(tmp_path, capsys, caplog, data, files) -> None:
    """A cache folder that cannot be one (nothing is built), or ``backends``, or any command's ``--help``."""
    which = data.draw(st.sampled_from(["build-tiny", "backends", "help"]))
    seed = options(data.draw, ["--seed"])
    command = data.draw(st.sampled_from(["report", "compare", "eval", "train", "serve", "rescore", "check-endpoint"]))

    def argv(p: list[str]) -> list[str]:
        if which == "build-tiny":
            return ["build-tiny", "--cache-dir", p[0], *seed]
        return ["backends"] if which == "backends" else [command, "--help"]

    drive(tmp_path, capsys, caplog, argv, files)


def test_the_sandbox_sees_a_write_through_a_link(tmp_path, capsys, caplog) -> None:
    """The property's own check: a command that wrote through a planted link would be caught."""
    sandbox = Sandbox(tmp_path / "inside", tmp_path / "outside")
    sandbox.inside.mkdir()
    sandbox.outside.mkdir()
    link = Path(sandbox.path("link_file", b"precious\n"))
    before = snapshot(sandbox.outside)
    link.write_bytes(b"overwritten\n")
    assert snapshot(sandbox.outside) != before
    hard = Path(sandbox.path("hardlink", b"precious\n"))
    before = snapshot(sandbox.outside)
    with hard.open("ab") as f:
        f.write(b"appended\n")
    assert snapshot(sandbox.outside) != before


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch) -> None:
    """No key from the environment reaches a generated endpoint; a bug shows as its one line, not a traceback."""
    for name in ("OPENAI_API_KEY", "VLLM_API_KEY", cli.DEBUG_ENV):
        monkeypatch.delenv(name, raising=False)
