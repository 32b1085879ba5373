"""Property tests over whole run folders: generated ``run.json``, ``results.jsonl``, ``failures.jsonl``,
``metrics.jsonl`` and ``val_results.jsonl`` (random bytes, JSON of any depth, numbers past every limit, NaN-like
tokens, control characters, valid lines with one field replaced) and FIFOs, links and folders in place of files
(outputs' names included), through the real reader and the functions behind ``gym-bridge report`` and
``compare`` in process (a few cases through the real commands at the end). Each ends in success or in one
:class:`~gym_bridge.boundary.UntrustedInputError` line (a ``RunReadError`` for an eval folder) naming the file
(``compare`` may also refuse two runs with one :class:`~gym_bridge.eval.compare.CompareError` line); never
another exception, never a wait on a FIFO, never a write outside the folder."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.eval.records import row_id
from gym_bridge.testing.cli import run_cli

PROPERTY = settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
BLOCKED_S = 60.0
"""A call that has not returned by then is waiting on a FIFO (or looping): the test fails."""
TEXT = st.text(alphabet=st.sampled_from(list('ab"\\{}[]\n\x1b\x00\u202e\u2028é ')), max_size=12)
NUMBERS = (
    st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([1.7e308, -1.7e308, 5e-324, 0.0, -0.0])
)
JSON_ANY = st.recursive(
    st.none() | st.booleans() | NUMBERS | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=25,
)
TOKENS = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"9" * 300, b"nan", b"undefined", b"\x00", b"\xff\xfe"]
KINDS = ["regular"] * 12 + ["missing", "fifo", "link_out", "link_dev_zero", "folder"]
"""How a file of the folder is planted: mostly written, sometimes something else at its name."""


def _dumps(value: object) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


@st.composite
def nested(draw: st.DrawFn) -> bytes:
    n = draw(st.integers(1, 120))
    return b'{"a":' + b"[" * n + b"1" + b"]" * n + b"}"


def mutate(draw: st.DrawFn, value: dict[str, Any]) -> dict[str, Any]:
    """``value`` with one key, somewhere in it, given a random JSON value (or removed)."""
    node: Any = value
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node))) if isinstance(node, list) else []
        if not keys:
            return value
        key = draw(st.sampled_from(keys))
        if not isinstance(node[key], dict | list) or draw(st.booleans()):
            if isinstance(node, dict) and draw(st.booleans()):
                del node[key]
            else:
                node[key] = draw(JSON_ANY)
            return value


def good_result(i: int, rewards: list[float], agent: str = "agent") -> dict[str, Any]:
    row = {"responses_create_params": {"input": [{"role": "user", "content": f"q{i}"}]}}  # one id whatever the agent
    trace = [{"role": "assistant", "tokens": ["x"], "logprobs": [-0.1]}]
    completions = [{"reward": r, "truncated": False, "termination": "stop", "turns": 1, "generated_tokens": 2,
                    "total_tokens": 5, "text": "x", "trace": trace, "gym_result": {**row, "reward": r}}
                   for r in rewards]  # fmt: skip
    return {"prompt_idx": i, "row_id": row_id(row), "line": i + 1, "agent": agent, "completions": completions,
            "elapsed_s": 1.0, "finished_at": 10.0 + i}  # fmt: skip


def good_run_json() -> dict[str, Any]:
    return {"fingerprint": {"dataset_sha256": "d", "num_generations_per_prompt": 2, "config_paths": ["a.yaml"],
                            "gym_overrides": {}},
            "config": {"pass_threshold": 1.0, "config_paths": ["a.yaml"], "gym_overrides": {}}, "model": "m",
            "sessions": [{"started": 0.0, "rollouts_started": 1.0, "ended": 2.0}]}  # fmt: skip


@st.composite
def line(draw: st.DrawFn, good: dict[str, Any], clean: bool = False) -> bytes:
    """One JSONL line: ``good``, ``good`` with a field replaced, any JSON, a deep nest, a bad token, raw bytes
    (``clean``: ``good``)."""
    kinds = ["good"] * 12 + ["mutated", "mutated", "any", "nested", "token", "bytes", "blank"]
    kind = "good" if clean else draw(st.sampled_from(kinds))
    if kind == "good":
        return _dumps(good)
    if kind == "mutated":
        return _dumps(mutate(draw, json.loads(json.dumps(good))))
    if kind == "any":
        return _dumps(draw(JSON_ANY))
    if kind == "nested":
        return draw(nested())
    if kind == "token":
        raw = _dumps(good)
        at = draw(st.integers(0, len(raw)))
        return raw[:at] + draw(st.sampled_from(TOKENS)) + raw[at:]
    if kind == "bytes":
        return draw(st.binary(max_size=60))
    return b""


@st.composite
def jsonl(draw: st.DrawFn, goods: list[dict[str, Any]], clean: bool = False) -> bytes:
    lines = [draw(line(good, clean)) for good in goods]
    end = b"\n" if clean else draw(st.sampled_from([b"\n"] * 6 + [b"", b"\x00" * 8, b'{"torn": ']))
    return b"\n".join(lines) + end


@st.composite
def eval_folder(draw: st.DrawFn) -> dict[str, tuple[str, bytes]]:
    """file name -> (kind, bytes) of a hostile eval run folder: broken anywhere, or (``clean``, half the time)
    well formed with hostile text and numbers at every limit."""
    clean = draw(st.booleans())
    kinds = st.just("regular") if clean else st.sampled_from(KINDS)
    rewards = st.floats(allow_nan=False, allow_infinity=False) if clean else NUMBERS
    n = draw(st.integers(1, 4))
    agents = draw(st.lists(TEXT, min_size=2, max_size=2))
    goods = [good_result(i, [draw(rewards) if draw(st.booleans()) else 1.0, 0.0], agents[i % 2]) for i in range(n)]
    failure = {"prompt_idx": n + 1, "agent": agents[0], "error": "E\x1b", "message": "m\u202e", "class": "data"}
    files = {
        "run.json": (draw(kinds), draw(line(good_run_json(), clean))),
        "results.jsonl": (draw(kinds), draw(jsonl(goods, clean))),
        "failures.jsonl": (draw(kinds), draw(jsonl([failure], clean))),
    }
    for name in draw(st.lists(st.sampled_from(["metrics.json", "report.md", "report.png", "report.html"]), max_size=2)):
        files[name] = (draw(st.sampled_from(["fifo", "link_out", "link_dev_zero", "folder"])), b"")
    return files


@st.composite
def training_folder(draw: st.DrawFn) -> dict[str, tuple[str, bytes]]:
    steps = [{"kind": "train", "step": s, "train/mean_reward": 0.5, "train/loss": 1.0} for s in range(3)]
    steps.append({"kind": "val", "step": 3, "val/accuracy": 0.5})
    verdicts = [
        {"set": "s", "step": s, "problem": p, "sample": 0, "correct": p % 2 == 0} for s in (0, 3) for p in range(3)
    ]
    clean = draw(st.booleans())
    kinds = st.just("regular") if clean else st.sampled_from(KINDS)
    files = {
        "metrics.jsonl": (draw(st.sampled_from([*KINDS[:12], "fifo", "link_out"])), draw(jsonl(steps, clean))),
        "val_results.jsonl": (draw(kinds), draw(jsonl(verdicts, clean))),
    }
    for name in draw(st.lists(st.sampled_from(["training.png", "training.html"]), max_size=2)):
        files[name] = (draw(st.sampled_from(["fifo", "link_out", "link_dev_zero"])), b"")
    return files


def plant(folder: Path, files: dict[str, tuple[str, bytes]], outside: Path) -> None:
    folder.mkdir(parents=True)
    for name, (kind, data) in files.items():
        path = folder / name
        if kind == "regular":
            path.write_bytes(data)
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "link_out":
            target = outside / f"target-{name}"
            target.write_bytes(data or b"precious\n")
            path.symlink_to(target)
        elif kind == "link_dev_zero":
            path.symlink_to("/dev/zero")
        elif kind == "folder":
            path.mkdir()


def snapshot(root: Path, inside: Path) -> dict[str, bytes | str]:
    """Every entry under ``root`` but those in ``inside``: a regular file by its bytes, anything else by kind."""
    seen: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        if path == inside or inside in path.parents:
            continue
        seen[str(path)] = path.read_bytes() if path.is_file() and not path.is_symlink() else "other"
    return seen


def within(fn, *args):
    """``fn(*args)`` on a thread that must return within :data:`BLOCKED_S` (a FIFO read fails the test here)."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as exc:
            box["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(BLOCKED_S)
    assert not worker.is_alive(), f"{fn.__name__} blocked (a FIFO?)"
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box.get("value")


def one_line_naming(exc: BaseException, folder: Path) -> None:
    text = str(exc)
    assert "\n" not in text and text, repr(text)
    assert str(folder) in text, f"the error names no file of {folder}: {text}"


def refusal_or_success(fn, *args, folder: Path, allowed: tuple[type[BaseException], ...] = ()) -> object:
    try:
        value = within(fn, *args)
    except UntrustedInputError as exc:
        one_line_naming(exc, folder)
        event(f"refused: {type(exc).__name__}")
    except allowed as exc:
        assert "\n" not in str(exc) and str(exc), repr(exc)
        event(f"refused: {type(exc).__name__}")
    else:
        event("done")
        return value
    return None


@PROPERTY
@given(files=eval_folder())
def test_report_of_any_eval_folder_is_a_report_or_one_line(tmp_path_factory, files) -> None:
    from gym_bridge.eval.report import build_report

    root = tmp_path_factory.mktemp("report")
    outside, folder = root / "outside", root / "run"
    outside.mkdir()
    plant(folder, files, outside)
    before = snapshot(root, folder)
    metrics = refusal_or_success(build_report, folder, folder=folder)
    if metrics is not None:
        written = json.loads((folder / "metrics.json").read_text(), parse_constant=lambda name: pytest.fail(name))
        assert written["prompts_done"] == metrics["prompts_done"]
        for name in ("report.md", "metrics.json"):
            text = (folder / name).read_text()
            assert "\x1b" not in text and "\x00" not in text and "\u202e" not in text
    assert snapshot(root, folder) == before, "something outside the run folder changed"


@PROPERTY
@given(files=eval_folder())
def test_compare_with_any_eval_folder_is_a_comparison_or_one_line(tmp_path_factory, files) -> None:
    from gym_bridge.eval.compare import CompareError, compare_runs

    root = tmp_path_factory.mktemp("compare")
    outside, folder, good = root / "outside", root / "run", root / "good"
    outside.mkdir()
    plant(folder, files, outside)
    good.mkdir()
    (good / "run.json").write_text(json.dumps(good_run_json()))
    (good / "results.jsonl").write_text("".join(json.dumps(good_result(i, [1.0, 0.0], f"agent{i % 2}")) + "\n"
                                                for i in range(4)))  # fmt: skip
    before = snapshot(root, root / "out")
    refusal_or_success(compare_runs, [good, folder], root / "out", folder=folder, allowed=(CompareError,))
    assert snapshot(root, root / "out") == before, "something outside the output folder changed"


@PROPERTY
@given(files=eval_folder())
def test_the_viewer_of_any_eval_folder_is_a_page_or_one_line(tmp_path_factory, files) -> None:
    from gym_bridge.eval.viewer import build_viewer

    root = tmp_path_factory.mktemp("viewer")
    outside, folder = root / "outside", root / "run"
    outside.mkdir()
    plant(folder, files, outside)
    before = snapshot(root, folder)
    page = refusal_or_success(build_viewer, folder, folder=folder)
    if page is not None:
        assert b"</script><" not in (folder / "report.html").read_bytes().split(b'id="run-data">', 1)[1][:-30]
    assert snapshot(root, folder) == before


@PROPERTY
@given(files=training_folder())
def test_the_plots_of_any_training_folder_are_plots_or_one_line(tmp_path_factory, files) -> None:
    from gym_bridge.training.plots import write_training_plots

    root = tmp_path_factory.mktemp("training")
    outside, folder = root / "outside", root / "train"
    outside.mkdir()
    plant(folder, files, outside)
    before = snapshot(root, folder)
    plots = refusal_or_success(write_training_plots, folder, folder=folder)
    if plots is not None:
        assert (folder / "training.png").read_bytes()[:4] == b"\x89PNG"
        assert "\x1b" not in (folder / "training.html").read_text()
    assert snapshot(root, folder) == before


# ---- a few through the real commands -------------------------------------------------------------------


REAL_CASES = {
    "deep": ("results.jsonl", b'{"prompt_idx": 0, "agent": "a", "completions": [' + b"[" * 200 + b"]" * 200 + b"]}\n"),
    "huge-int": ("results.jsonl", b'{"prompt_idx": 1' + b"0" * 30 + b', "agent": "a", "completions": []}\n'),
    "nan": ("run.json", b'{"config": {"pass_threshold": NaN}}'),
    "fifo": ("results.jsonl", None),
    "link-out": ("results.jsonl", b"link"),
}


@pytest.mark.parametrize("case", sorted(REAL_CASES))
def test_the_real_commands_end_in_one_line_on_hostile_folders(tmp_path: Path, case: str) -> None:
    name, data = REAL_CASES[case]
    good = tmp_path / "good"
    good.mkdir()
    (good / "run.json").write_text(json.dumps(good_run_json()))
    (good / "results.jsonl").write_text("".join(json.dumps(good_result(i, [1.0, 0.0])) + "\n" for i in range(4)))
    folder = tmp_path / "run"
    folder.mkdir()
    for other in ("run.json", "results.jsonl"):
        (folder / other).write_bytes((good / other).read_bytes())
    (folder / name).unlink()
    outside = tmp_path / "outside.jsonl"
    outside.write_bytes(b"precious\n")
    if data is None:
        os.mkfifo(folder / name)
    elif data == b"link":
        (folder / name).symlink_to(outside)
    else:
        (folder / name).write_bytes(data)
    for args in (["report", str(folder)], ["compare", str(good), str(folder), "--out", str(tmp_path / "out")]):
        proc = run_cli(*args, timeout=BLOCKED_S * 2)
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and str(folder) in lines[0] and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert outside.read_bytes() == b"precious\n"


@pytest.mark.parametrize(
    ("lines", "says"),
    [
        ([{"kind": "val", "step": 1.5e308, "val/accuracy": 0.5}], "field 'step'"),
        ([{"step": 0, "train/mean_reward": -1.7e308}, {"step": 1, "train/mean_reward": 1.7e308}], "span more"),
    ],
)
def test_steps_and_values_no_plot_can_draw_are_one_line(tmp_path: Path, lines: list[dict], says: str) -> None:
    """Found by the property above: a step of 1.5e308, or values whose span overflows a float, crashed matplotlib's
    ticks. A step is a count (at most 2**53); a span the axes cannot draw is refused, naming the file."""
    from gym_bridge.training.plots import write_training_plots

    body = [{"kind": "train", "step": 0, "train/mean_reward": 0.5}, *lines]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in body))
    with pytest.raises(UntrustedInputError, match=says) as caught:
        write_training_plots(tmp_path)
    one_line_naming(caught.value, tmp_path)
    assert not (tmp_path / "training.png").exists()
