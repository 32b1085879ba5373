"""``gym-bridge train`` writes into its run folder only through the boundary (issue 57): a link planted in ``--out``
never leads a write outside it, and an ``--out`` that is not a folder is one line, exit 2, with nothing made.

``config.yaml`` is written before Ray starts, so the command is run on the demo config (``gym_bridge.cli.main``,
every check before the start real) with Ray's start replaced by a stop that records what the folder held then: no
Gym and no training are needed to see the write. A planted ``config.yaml`` link is replaced by a regular file holding
the config, its target unchanged. The checkpoint is written by a real trainer (the GRPO loop over the tiny model, as
``tests/training/test_hostile_checkpoints.py`` builds it); links swapped in while it saves are refused in one line and write
nothing through them. A file in the way of ``--out`` is refused before any check of the config runs, once more by
the real command in a subprocess.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from test_hostile_checkpoints import tiny_policy, trainer

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.cli import main
from gym_bridge.failures import GymBridgeError
from gym_bridge.policy.optimizer_file import OPTIMIZER_FILE
from gym_bridge.testing.cli import run_cli
from gym_bridge.training.trainer_state import STATE_FILE

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "grpo_nemo_gym.yaml"
SECRET = "the user's own file\n"


class RayWouldStart(GymBridgeError):
    """Raised where ``train`` starts Ray: everything before it ran for real."""


@pytest.fixture
def train_until_ray(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """``gym-bridge train DEMO --out DIR`` through ``cli.main`` up to Ray's start: (exit code, stderr lines, whether
    Ray would have started)."""
    import gym_bridge.ray_utils

    started: list[bool] = []

    def stop(*args: object, **kwargs: object) -> None:
        started.append(True)
        raise RayWouldStart("Ray would start here")

    monkeypatch.setattr(gym_bridge.ray_utils, "init_ray", stop)
    monkeypatch.chdir(REPO)

    def run(out: Path) -> tuple[int, list[str], bool]:
        code = main(["train", str(DEMO), "--out", str(out), "--no-progress"])
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        return code, lines, bool(started)

    return run


def outside(tmp_path: Path) -> Path:
    """A file outside the run folder that a planted link points at."""
    target = tmp_path / "outside" / "mine.txt"
    target.parent.mkdir()
    target.write_text(SECRET)
    return target


def test_a_planted_config_yaml_link_is_replaced_by_a_regular_file_and_its_target_is_unchanged(
    train_until_ray, tmp_path
):
    target = outside(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").symlink_to(target)
    code, lines, started = train_until_ray(run)
    assert (code, lines[-1:], started) == (2, ["gym-bridge train: Ray would start here"], True), lines
    assert target.read_text() == SECRET, "nothing was written through the link"
    written = run / "config.yaml"
    assert not written.is_symlink() and written.is_file()
    assert yaml.safe_load(written.read_text())["grpo"]["max_num_steps"] == 12, "the config as trained"
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "logs"], "no temporary file left beside it"


def test_a_planted_logs_link_is_refused_in_one_line_before_ray_starts(train_until_ray, tmp_path):
    """The demo logs to TensorBoard under ``logs/``: a link planted there is refused, nothing written through it."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "logs").symlink_to(elsewhere, target_is_directory=True)
    code, lines, started = train_until_ray(run)
    assert (code, started) == (2, False), lines
    assert lines == [
        f"gym-bridge train: {run / 'logs'}: a link inside the run folder; gym-bridge follows no link there"
    ]
    assert list(elsewhere.iterdir()) == [] and not (run / "config.yaml").exists()


def test_an_out_that_cannot_be_made_is_one_line_and_exit_2_before_ray_starts(train_until_ray):
    """A folder the system refuses to make (``/proc`` takes no new folder, even as root)."""
    out = Path("/proc/gym-bridge-no-such-run")
    code, lines, started = train_until_ray(out)
    assert (code, started) == (2, False), lines
    assert lines == [f"gym-bridge train: {out}: cannot be made (No such file or directory)"]


def in_the_way(tmp_path: Path, how: str) -> tuple[Path, str]:
    """An ``--out`` blocked by a file, and the end of the line that names it."""
    file = tmp_path / "a-file"
    file.write_text(SECRET)
    if how == "is a file":
        return file, f"{file}: exists and is a file, not a folder"
    if how == "under a file":
        return file / "run" / "deeper", f"{file / 'run' / 'deeper'}: cannot be made, {file} is a file"
    fifo = tmp_path / "a-fifo"
    os.mkfifo(fifo)
    return fifo / "run", f"{fifo / 'run'}: cannot be made, {fifo} is a FIFO"


@pytest.mark.parametrize("how", ["is a file", "under a file", "under a FIFO"])
def test_an_out_in_the_way_of_a_file_is_one_line_and_exit_2_and_makes_nothing(train_until_ray, tmp_path, how):
    out, says = in_the_way(tmp_path, how)
    before = sorted(p.name for p in tmp_path.iterdir())
    code, lines, started = train_until_ray(out)
    assert (code, lines, started) == (2, [f"gym-bridge train: {says}"], False)
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "nothing was made"
    assert (tmp_path / "a-file").read_text() == SECRET


@pytest.mark.e2e
@pytest.mark.slow  # the command imports the training loop (torch): 10-40 s on two busy cores
def test_the_gym_bridge_process_refuses_an_out_under_a_file_in_one_line(tmp_path):
    out, says = in_the_way(tmp_path, "under a file")
    done = run_cli("train", str(DEMO), "--out", str(out), cwd=REPO, timeout=300)
    assert (done.returncode, done.stderr.splitlines()) == (2, [f"gym-bridge train: {says}"]), done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"], "nothing was made"


# ---- the checkpoint ---------------------------------------------------------------------------------------


def swapped_while_saving(t, swap: Callable[[Path], None], *, after: bool) -> None:
    """``t``'s policy runs ``swap(staging)`` before (or, ``after``, once) it saves into the staging folder."""
    save = t.policy.save_checkpoint

    def saving(path: Path) -> None:
        if not after:
            swap(path)
        save(path)
        if after:
            swap(path)

    t.policy.save_checkpoint = saving


def link_to(elsewhere: Path) -> Callable[[Path], None]:
    """Replace the staging folder by a link to ``elsewhere`` (what a second writer of the folder could do)."""

    def swap(staging: Path) -> None:
        staging.rename(staging.with_name("moved-aside"))
        staging.symlink_to(elsewhere, target_is_directory=True)

    return swap


@pytest.mark.parametrize("after", [False, True], ids=["before-the-weights", "before-the-trainer-state"])
def test_a_link_swapped_in_for_the_checkpoint_staging_folder_is_refused_and_written_through_never(
    tiny_model_dir, tmp_path, after
):
    """``checkpoint.partial`` replaced by a link after the trainer made it: before the policy saves its weights,
    or before the trainer writes its state. Either write is refused in one line naming the folder, nothing lands in
    the link's target, and the previous checkpoint is still there, whole."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = tmp_path / "run"
    t = trainer(run, tiny_policy(tiny_model_dir), max_num_steps=2)
    first = t.save_checkpoint()
    kept = sorted(p.name for p in first.iterdir())
    swapped_while_saving(t, link_to(elsewhere), after=after)
    with pytest.raises(UntrustedInputError) as refused:
        t.save_checkpoint()
    assert str(refused.value) == (
        f"{run / 'checkpoint.partial'}: a link inside the run folder; gym-bridge follows no link there"
    )
    assert list(elsewhere.iterdir()) == [], "nothing was written through the link"
    assert sorted(p.name for p in first.iterdir()) == kept and {STATE_FILE, OPTIMIZER_FILE} <= set(kept)


def test_hf_policy_never_saves_a_checkpoint_through_a_link(tiny_model_dir, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "ckpt").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(UntrustedInputError) as refused:
        tiny_policy(tiny_model_dir).save_checkpoint(tmp_path / "ckpt")
    assert str(refused.value) == f"{tmp_path / 'ckpt'}: a link inside the run folder; gym-bridge follows no link there"
    assert list(elsewhere.iterdir()) == []
