"""Writes into a run folder go through the boundary (issue 57): nothing an eval writes is followed through a link
or a second hard link planted in a folder someone sent you, and a bad ``output_dir`` is one line with nothing made.

The design for Gym's logs: a resume refuses, in one line with exit code 2 before anything starts, a run folder
whose ``gym-logs`` (or anything in it) is a link, a FIFO or a file with a second hard link; it never writes logs
through such an entry. Underneath, every log open (the parent's ``_launcher.log``, the launcher's per-server logs,
each forked server's output) refuses a link and a second hard link itself.

The first tests are unit checks of each log open and of the store (no Gym, fast lane). Then ``gym-bridge eval``
in a subprocess: on a bad ``output_dir`` (slow: the command imports the run loop), and on copies of one real run
folder that a real eval wrote with real Gym servers and the scripted policy (``gym``, ``e2e``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_hostile_run_folders import EXAMPLE, REPO, refused, result_line, write_lines, write_run

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.gym.servers.log_folder import check_gym_logs
from gym_bridge.eval.store import RunStore
from gym_bridge.gym.servers._launcher import open_log

SECRET = b"export PATH=/usr/bin  # the user's own file\n"
"""What a file outside the run folder holds (``~/.bashrc`` in the issue): it must hold exactly this afterwards."""


def outside_file(tmp: Path, name: str = "bashrc") -> Path:
    path = tmp / "home" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(SECRET)
    return path


def snapshot(folder: Path) -> dict[str, bytes | str]:
    """Every entry under ``folder``: a file's bytes, a link's target (nothing followed)."""
    found: dict[str, bytes | str] = {}
    for top, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(top) / name
            key = str(path.relative_to(folder))
            found[key] = f"-> {os.readlink(path)}" if path.is_symlink() else b"" if path.is_dir() else path.read_bytes()
    return found


# ---- each log open (no Gym) ---------------------------------------------------------------------


def test_the_launcher_appends_to_a_servers_log_only_when_it_is_a_file_of_its_own(tmp_path: Path) -> None:
    logs = tmp_path / "gym-logs"
    logs.mkdir()
    target = outside_file(tmp_path)
    (logs / "linked.log").symlink_to(target)
    os.link(target, logs / "hard.log")
    for name, problem in [("linked", "a link"), ("hard", "has 2 hard links")]:
        with pytest.raises(UntrustedInputError, match=re.escape(f"{logs}/{name}.log: {problem}")):
            open_log(logs, name)
    assert target.read_bytes() == SECRET
    with open_log(logs, "agents/simple") as log:  # a name with a slash stays one file inside the folder
        log.write(b"started\n")
    with open_log(logs, "agents/simple") as log:
        log.write(b"again\n")
    assert (logs / "agents_simple.log").read_bytes() == b"started\nagain\n"


_REDIRECT = """
import sys
from gym_bridge.gym.servers._forkserver import redirect_output
redirect_output(sys.argv[1], sys.argv[2])
print("server output", flush=True)
"""


def test_a_forked_servers_output_goes_only_to_a_log_of_its_own(tmp_path: Path) -> None:
    """What each forked Gym server does first (``_run_server``): its stdout and stderr to its log, opened through the
    boundary; a planted link there ends the server with the refusal on the launcher's output, the target untouched."""
    logs = tmp_path / "gym-logs"
    logs.mkdir()
    target = outside_file(tmp_path)
    (logs / "server.log").symlink_to(target)

    def run(log: Path) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-c", _REDIRECT, str(log), str(logs)]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)

    done = run(logs / "server.log")
    assert done.returncode == 1 and "server output" not in done.stdout
    assert f"UntrustedInputError: {logs}/server.log: a link" in done.stderr
    assert target.read_bytes() == SECRET
    done = run(logs / "own.log")
    assert done.returncode == 0, done.stderr
    assert (logs / "own.log").read_text() == "server output\n"


@pytest.mark.parametrize("plant", ["link", "hard link"])
def test_gym_servers_refuse_a_planted_launcher_log_before_starting_anything(tmp_path: Path, plant: str) -> None:
    """``OwnedGym.start`` opens ``_launcher.log`` for the launcher's output; a planted one is refused before the
    launcher process exists, and the set cleans up (no private folder, no port window held)."""
    from gym_bridge.gym.servers.owned import OwnedGym
    from gym_bridge.gym.servers.server_config import GymServersConfig

    logs = tmp_path / "gym-logs"
    logs.mkdir()
    target = outside_file(tmp_path)
    if plant == "link":
        (logs / "_launcher.log").symlink_to(target)
    else:
        os.link(target, logs / "_launcher.log")
    servers = OwnedGym(GymServersConfig(config_paths=["none.yaml"], log_dir=logs, use_ray=False))
    with pytest.raises(UntrustedInputError, match=re.escape(f"{logs}/_launcher.log: ")):
        servers.start()
    assert servers._launcher is None and servers._private_dir is None and servers._window is None
    assert servers.pids() == set()
    assert target.read_bytes() == SECRET


def test_a_resume_checks_every_entry_of_gym_logs_without_following_a_link(tmp_path: Path) -> None:
    """:func:`check_gym_logs`: a link anywhere in ``gym-logs`` (``gym-logs`` itself, a log, a folder in it), a second
    hard link and a FIFO are each named in one line; a folder of plain logs passes."""
    target = outside_file(tmp_path)
    run = tmp_path / "run"
    check_gym_logs(run)  # no folder yet: nothing to check
    (run / "gym-logs" / "token-captures").mkdir(parents=True)
    (run / "gym-logs" / "_launcher.log").write_text("ok\n")
    (run / "gym-logs" / "token-captures" / "a.jsonl").write_text("{}\n")
    check_gym_logs(run)
    plants = {
        "gym-logs": lambda p: (shutil.rmtree(p), p.symlink_to(target.parent)),
        "gym-logs/policy_model.log": lambda p: p.symlink_to(target),
        "gym-logs/token-captures/deep": lambda p: p.symlink_to(target.parent, target_is_directory=True),
        "gym-logs/token-captures/b.jsonl": lambda p: os.link(target, p),
        "gym-logs/fifo.log": os.mkfifo,
    }
    expected = {
        "gym-logs": "a link inside the run folder",
        "gym-logs/policy_model.log": "a link inside the run folder",
        "gym-logs/token-captures/deep": "a link inside the run folder",
        "gym-logs/token-captures/b.jsonl": "has 2 hard links",
        "gym-logs/fifo.log": "not a regular file (a FIFO)",
    }
    for entry, plant in plants.items():
        folder = tmp_path / f"case-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(run, folder, symlinks=True)
        plant(folder / entry)
        with pytest.raises(UntrustedInputError, match="^" + re.escape(f"{folder}/{entry}: {expected[entry]}")):
            check_gym_logs(folder)
    assert target.read_bytes() == SECRET


FINGERPRINT = {"dataset_sha256": "data-1", "num_generations_per_prompt": 2}
FAILURE = {"prompt_idx": 3, "line": 4, "agent": "a", "error": "RuntimeError", "message": "x", "class": "data",
           "elapsed_s": 1.0, "finished_at": 100.0}  # fmt: skip
"""A ``failures.jsonl`` line as the run writes one (``gym_bridge.eval.records.failure_record``)."""


def resumable(folder: Path, torn: str) -> Path:
    """A run folder the store resumes: three results, one failure, ``torn`` ending in a torn line (a killed write)."""
    write_run(folder, run={"fingerprint": FINGERPRINT}, lines=[result_line(i, [1.0, 0.0]) for i in range(3)])
    write_lines(folder / "failures.jsonl", [FAILURE])
    (folder / "run.lock").touch()  # as every run leaves it
    with (folder / torn).open("ab") as f:
        f.write(b'{"prompt_idx": 99, "torn')
    return folder


def test_the_folder_the_store_checks_below_resumes_when_nothing_is_linked(tmp_path: Path) -> None:
    """The folder of the next test without the second name: resumed, its torn line cut off (so a refusal there is
    for the hard link, not for what the files hold)."""
    folder = resumable(tmp_path / "run", "results.jsonl")
    store = RunStore(folder)
    assert store.open(FINGERPRINT, resume=True) == {0, 1, 2}
    store.close()
    assert (folder / "results.jsonl").read_bytes().endswith(b"\n")


@pytest.mark.parametrize("linked", ["results.jsonl", "failures.jsonl"])
def test_the_store_refuses_a_hard_linked_file_before_cutting_or_appending(tmp_path: Path, linked: str) -> None:
    """A resumed folder whose ``results.jsonl`` or ``failures.jsonl`` has a second name is refused before anything:
    the other file's torn last line is not cut off, and the other name's bytes stay as they were."""
    torn = next(name for name in ("results.jsonl", "failures.jsonl") if name != linked)
    folder = resumable(tmp_path / "run", torn)
    before = snapshot(folder)
    other_name = tmp_path / "snapshot" / linked
    other_name.parent.mkdir()
    os.link(folder / linked, other_name)
    store = RunStore(folder)
    with pytest.raises(UntrustedInputError, match=re.escape(f"{folder}/{linked}: has 2 hard links")):
        store.open(FINGERPRINT, resume=True)
    assert store._lock is None and not store._files
    assert snapshot(folder) == before
    assert other_name.read_bytes() == before[linked]


# ---- the real command: output_dir ----------------------------------------------------------------


def eval_args(output_dir: Path, *extra: str) -> list[str]:
    return [str(EXAMPLE), f"output_dir={output_dir}", "num_generations_per_prompt=1", "concurrency=1", *extra]


@pytest.mark.slow  # the command imports the run loop (torch): 10-30 s on two busy cores
@pytest.mark.parametrize("case", ["a file", "under a file", "a tokenizer that names nothing"])
def test_eval_refuses_a_bad_output_dir_in_one_line_and_makes_nothing(tmp_path: Path, case: str) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("the user's file\n")
    output_dir = {"a file": a_file, "under a file": a_file / "run" / "deeper"}.get(case, tmp_path / "run")
    extra = ["tokenizer=/no/such/tokenizer"] if case.startswith("a tokenizer") else []
    before = snapshot(tmp_path)
    line = refused("eval", *eval_args(output_dir, *extra))
    expected = {
        "a file": f"{a_file}: exists and is not a folder",
        "under a file": f"{output_dir}: cannot be made, {a_file} is a file",
        "a tokenizer that names nothing": "/no/such/tokenizer",
    }[case]
    assert expected in line
    assert snapshot(tmp_path) == before, "the refused command left something behind"


# ---- the real command on a real run folder --------------------------------------------------------


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real ``gym-bridge eval`` (its own Ray, real Gym servers, the scripted policy, one row): a run folder with
    its ``gym-logs`` as the launcher and the forked servers wrote them."""
    run = tmp_path_factory.mktemp("real") / "run"
    command = [sys.executable, "-m", "gym_bridge.cli", "eval", *eval_args(run, "limit=1"), "--no-progress"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    logs = run / "gym-logs"
    server_logs = sorted(p.name for p in logs.iterdir() if p.suffix == ".log" and p.name != "_launcher.log")
    assert (logs / "_launcher.log").is_file() and server_logs, sorted(os.listdir(logs))
    for name in server_logs:  # each opened by the launcher (its first line) and appended to by the server
        assert (logs / name).read_text().startswith("$ "), name
    return run


def received(real_run: Path, tmp: Path) -> Path:
    """A copy of the real run folder, as someone would send it (links inside kept as links)."""
    folder = tmp / "received"
    shutil.copytree(real_run, folder, symlinks=True)
    return folder


def resume_refused(folder: Path) -> str:
    """``eval --resume`` of ``folder`` with one more row pending (without the refusal it would start Gym and write):
    exit code 2 and one line, returned."""
    return refused("eval", *eval_args(folder, "limit=2", "--resume", "--no-progress"))


@pytest.mark.gym
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("plant", ["gym-logs a link to a folder outside", "a log a link to a file outside"])
def test_a_planted_gym_logs_link_is_refused_and_its_target_unchanged(real_run: Path, tmp_path: Path, plant: str) -> None:
    folder = received(real_run, tmp_path)
    target = outside_file(tmp_path, "_launcher.log")
    if plant.startswith("gym-logs"):
        shutil.rmtree(folder / "gym-logs")
        (folder / "gym-logs").symlink_to(target.parent, target_is_directory=True)
        named = folder / "gym-logs"
    else:
        named = folder / "gym-logs" / "_launcher.log"
        named.unlink()
        named.symlink_to(target)
    before = snapshot(folder)
    line = resume_refused(folder)
    assert f"{named}: a link inside the run folder" in line
    assert target.read_bytes() == SECRET and sorted(os.listdir(target.parent)) == ["_launcher.log"]
    assert snapshot(folder) == before


@pytest.mark.gym
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("linked", ["results.jsonl", "failures.jsonl"])
def test_a_hard_linked_results_or_failures_file_is_refused_and_the_other_name_unchanged(
    real_run: Path, tmp_path: Path, linked: str
) -> None:
    folder = received(real_run, tmp_path)
    if linked == "failures.jsonl" and not (folder / linked).exists():  # the real run failed nothing: one failure
        write_lines(folder / linked, [FAILURE])
    other_name = tmp_path / "cp-al" / linked
    other_name.parent.mkdir()
    os.link(folder / linked, other_name)
    before = snapshot(folder)
    line = resume_refused(folder)
    assert f"{folder}/{linked}: has 2 hard links" in line
    assert other_name.read_bytes() == before[linked]
    assert snapshot(folder) == before


@pytest.mark.gym
@pytest.mark.e2e
@pytest.mark.slow
def test_a_cp_al_snapshot_of_a_real_run_is_refused_and_both_stay_as_they_were(real_run: Path, tmp_path: Path) -> None:
    """``cp -al``: every file of the snapshot is a second name of the original's; its resume changes neither."""
    original = received(real_run, tmp_path)
    copy = tmp_path / "snapshot"
    subprocess.run(["cp", "-al", str(original), str(copy)], check=True, timeout=60)
    before = snapshot(original)
    line = resume_refused(copy)
    assert "has 2 hard links" in line and str(copy) in line
    assert snapshot(original) == before and snapshot(copy) == before
