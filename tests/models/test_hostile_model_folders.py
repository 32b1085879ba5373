"""Model folders are passed around (issue 57): a folder's files are checked before anything loads from it.

A real folder (the tiny model, copied) is spoiled: safetensors headers that lie (a length of 2^63, offsets past the
file, a shape larger than its bytes, tensors over the same bytes, an unknown dtype), a ``config.json`` that
disagrees with the weights (its vocabulary, a size, 4 or 200,000 layers for weights of 2, a parameter the weights
lack), remote code (``auto_map``, ``trust_remote_code``), a FIFO as the tokenizer folder or as ``tokenizer.json``, a
link out of the folder, an empty folder. Each is one :class:`UntrustedInputError` naming the path through the real
loader, and a few through the real ``gym-bridge serve --model DIR`` (stdin closed, so no prompt could wait): one
line, exit 2, nothing written. A Hypothesis test mutates a header's bytes and JSON fields: the folder loads or is
refused in one :class:`UntrustedInputError`, nothing else.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.generation.factory import EngineSpec, build_engine
from gym_bridge.models.folder_check import check_model_folder, load_tokenizer
from gym_bridge.models.loading import load_causal_lm

REPO = Path(__file__).resolve().parents[2]
WEIGHTS = "model.safetensors"
BOUND_S = 30.0
"""A generous bound on a refusal that must not build what the config asks for."""

Spoil = Callable[[Path], None]


# ---- a real folder, and ways to spoil it -------------------------------------------------------------


def copy_model(tiny_model_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


def read_weights(folder: Path) -> tuple[dict[str, Any], bytes]:
    """The header (as JSON) and the data section of the folder's weights."""
    raw = (folder / WEIGHTS).read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def write_weights(folder: Path, header: dict[str, Any], data: bytes) -> None:
    encoded = json.dumps(header).encode()
    (folder / WEIGHTS).write_bytes(len(encoded).to_bytes(8, "little") + encoded + data)


def first_tensor(header: dict[str, Any]) -> str:
    return min((name for name in header if name != "__metadata__"), key=lambda n: header[n]["data_offsets"][0])


def header_edit(edit: Callable[[dict[str, Any]], None]) -> Spoil:
    def spoil(folder: Path) -> None:
        header, data = read_weights(folder)
        edit(header)
        write_weights(folder, header, data)

    return spoil


def config_edit(**changes: Any) -> Spoil:
    def spoil(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        config.update(changes)
        (folder / "config.json").write_text(json.dumps(config))

    return spoil


def length_2_63(folder: Path) -> None:
    raw = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes((2**63).to_bytes(8, "little") + raw[8:])


def offsets_past_the_file(header: dict[str, Any]) -> None:
    header[first_tensor(header)]["data_offsets"][1] += 10**9


def shape_larger_than_its_bytes(header: dict[str, Any]) -> None:
    header[first_tensor(header)]["shape"] = [10**6, 10**6]


def two_tensors_over_the_same_bytes(header: dict[str, Any]) -> None:
    name = first_tensor(header)
    header["extra.weight"] = dict(header[name])


def unknown_dtype(header: dict[str, Any]) -> None:
    header[first_tensor(header)]["dtype"] = "F128"


def drop_a_tensor(folder: Path) -> None:
    """The weights without one layer's up projection (its bytes cut out, the offsets after it moved)."""
    header, data = read_weights(folder)
    name = "model.layers.1.mlp.up_proj.weight"
    begin, end = header.pop(name)["data_offsets"]
    for entry in (v for k, v in header.items() if k != "__metadata__"):
        if entry["data_offsets"][0] >= end:
            entry["data_offsets"] = [entry["data_offsets"][0] - (end - begin), entry["data_offsets"][1] - (end - begin)]
    write_weights(folder, header, data[:begin] + data[end:])


def json_edit(name: str, **changes: Any) -> Spoil:
    def spoil(folder: Path) -> None:
        value = json.loads((folder / name).read_text())
        value.update(changes)
        (folder / name).write_text(json.dumps(value))

    return spoil


def fifo_tokenizer_json(folder: Path) -> None:
    (folder / "tokenizer.json").unlink()
    os.mkfifo(folder / "tokenizer.json")


def link_out_of_the_folder(folder: Path) -> None:
    outside = folder.parent / "elsewhere.json"
    outside.write_text((folder / "config.json").read_text())
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(outside)


def emptied(folder: Path) -> None:
    for path in folder.iterdir():
        path.unlink()


def deep_config(folder: Path) -> None:
    config = (folder / "config.json").read_text().rstrip()
    (folder / "config.json").write_text(config[:-1] + ', "rope_scaling": ' + "[" * 500 + "]" * 500 + "}")


SPOILS: dict[str, tuple[Spoil, str, str]] = {
    # name: (spoil, the file the refusal names, what it says)
    "header length 2^63": (length_2_63, WEIGHTS, "its header claims 9,223,372,036,854,775,808 bytes"),
    "offsets past the file": (header_edit(offsets_past_the_file), WEIGHTS, "fall outside the"),
    "shape larger than its bytes": (header_edit(shape_larger_than_its_bytes), WEIGHTS, "needs 4,000,000,000,000 bytes"),
    "two tensors over the same bytes": (header_edit(two_tensors_over_the_same_bytes), WEIGHTS, "overlaps the tensor"),
    "unknown dtype": (header_edit(unknown_dtype), WEIGHTS, "unknown dtype F128"),
    "vocab disagrees": (config_edit(vocab_size=2000), "config.json", "vocab_size 2000 disagrees with the weights"),
    "a size disagrees": (config_edit(intermediate_size=512), "config.json", "asks for [512, 128] where"),
    "4 layers for weights of 2": (
        config_edit(num_hidden_layers=4),
        "config.json",
        "num_hidden_layers is 4, but the weights hold 2 layers",
    ),
    "a tensor the weights lack": (drop_a_tensor, "config.json", "loading would initialise it at random"),
    "auto_map": (config_edit(auto_map={"AutoModelForCausalLM": "evil.Model"}), "config.json", "auto_map asks to run"),
    "trust_remote_code": (
        json_edit("tokenizer_config.json", trust_remote_code=True),
        "tokenizer_config.json",
        "trust_remote_code asks",
    ),
    "config nested 500 deep": (deep_config, "config.json", "nested deeper than"),
    "tokenizer.json a FIFO": (fifo_tokenizer_json, "tokenizer.json", "not a regular file (a FIFO)"),
    "a link out of the folder": (link_out_of_the_folder, "config.json", "a link out of the folder"),
    "an empty folder": (emptied, "", "holds no config.json"),
}


def refusal(call: Callable[[], object]) -> str:
    """The one-line message of the UntrustedInputError ``call`` raises."""
    with pytest.raises(UntrustedInputError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("case", list(SPOILS))
def test_a_spoiled_model_folder_is_refused_in_one_line_by_the_loader(tiny_model_dir, tmp_path, case):
    spoil, named, says = SPOILS[case]
    folder = copy_model(tiny_model_dir, tmp_path)
    spoil(folder)
    message = refusal(lambda: load_causal_lm(str(folder)))
    assert message.startswith(str(folder / named) if named else str(folder)), message
    assert says in message, message


def test_200000_layers_for_weights_of_2_are_refused_before_any_model_is_built(tiny_model_dir, tmp_path):
    folder = copy_model(tiny_model_dir, tmp_path)
    config_edit(num_hidden_layers=200_000)(folder)
    started = time.monotonic()
    message = refusal(lambda: load_causal_lm(str(folder)))
    assert time.monotonic() - started < BOUND_S
    assert message == f"{folder / 'config.json'}: num_hidden_layers is 200,000, but the weights hold 2 layers"


def test_the_unspoiled_copy_loads_with_its_tied_weights(tiny_model_dir, tmp_path):
    folder = copy_model(tiny_model_dir, tmp_path)
    checked = check_model_folder(folder)
    assert "lm_head.weight" not in checked.tensors and "model.embed_tokens.weight" in checked.tensors
    tokenizer, model = load_causal_lm(str(folder))
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tokenizer.decode(tokenizer.encode("hello world")) == "hello world"


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda path: os.mkfifo(path), "not a folder (a FIFO)"),
        (lambda path: path.mkdir(), "holds no tokenizer files"),
        (lambda path: path.write_text("{}"), "not a folder (a file)"),
    ],
    ids=["a FIFO", "an empty folder", "a file"],
)
def test_a_tokenizer_that_is_not_a_tokenizer_folder_is_refused_in_one_line(tmp_path, make, says):
    path = tmp_path / "tokenizer"
    make(path)
    message = refusal(lambda: load_tokenizer(path))
    assert message.startswith(f"{path}: ") and says in message, message
    assert refusal(lambda: build_engine(EngineSpec(policy="scripted", model=str(path)))) == message


def test_a_fifo_tokenizer_json_never_blocks_the_scripted_engine(tiny_model_dir, tmp_path):
    folder = copy_model(tiny_model_dir, tmp_path)
    fifo_tokenizer_json(folder)
    message = refusal(lambda: build_engine(EngineSpec(policy="instant", model=str(folder))))
    assert message == f"{folder / 'tokenizer.json'}: not a regular file (a FIFO); only regular files are read"


# ---- through the real command ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listing(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


SERVED = ["header length 2^63", "vocab disagrees", "auto_map", "tokenizer.json a FIFO", "an empty folder"]


@pytest.mark.parametrize("case", [*SERVED, "200000 layers"])
def test_gym_bridge_serve_refuses_a_spoiled_folder_in_one_line_with_exit_2(tiny_model_dir, tmp_path, case):
    spoil, named, says = (
        SPOILS[case]
        if case in SPOILS
        else (config_edit(num_hidden_layers=200_000), "config.json", "num_hidden_layers is 200,000")
    )
    folder = copy_model(tiny_model_dir, tmp_path)
    spoil(folder)
    before = listing(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "gym_bridge.cli", "serve", "--model", str(folder), "--port", str(free_port())],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        check=False,
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in done.stderr, lines
    assert lines[0].startswith(f"gym-bridge serve: {folder / named if named else folder}"), lines
    assert says in lines[0], lines
    assert listing(tmp_path) == before


# ---- generated headers -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def generated_folder(tiny_model_dir, tmp_path_factory) -> tuple[Path, dict[str, Any], bytes]:
    folder = copy_model(tiny_model_dir, tmp_path_factory.mktemp("generated"))
    header, data = read_weights(folder)
    return folder, header, data


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
FIELDS = st.sampled_from(["dtype", "shape", "data_offsets", "extra"])
FIELD_VALUES = (
    JSON_VALUES
    | st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F64"])
    | st.lists(st.integers(-2, 2**20), max_size=3)
)


@st.composite
def header_mutations(draw: st.DrawFn, header: dict[str, Any], data: bytes) -> bytes:
    """The folder's weights with its header changed: fields set to generated values, tensors dropped or renamed,
    or bytes of the encoded file overwritten."""
    header = json.loads(json.dumps(header))
    names = sorted(name for name in header if name != "__metadata__")
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(names))
        action = draw(st.sampled_from(["set", "delete_field", "drop", "rename"]))
        if name not in header:
            continue
        if action == "set":
            header[name][draw(FIELDS)] = draw(FIELD_VALUES)
        elif action == "delete_field":
            header[name].pop(draw(FIELDS), None)
        elif action == "drop":
            header.pop(name)
        else:
            header[draw(st.text(min_size=1, max_size=12))] = header.pop(name)
    encoded = json.dumps(header).encode()
    raw = bytearray(len(encoded).to_bytes(8, "little") + encoded)
    for _ in range(draw(st.integers(0, 3))):
        raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
    return bytes(raw) + data


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_a_generated_header_loads_or_is_refused_in_one_line(generated_folder, data):
    folder, header, weights = generated_folder
    (folder / WEIGHTS).write_bytes(data.draw(header_mutations(header, weights)))
    try:
        load_causal_lm(str(folder))
        event("loaded")
    except UntrustedInputError as exc:
        event("refused")
        assert "\n" not in str(exc) and str(folder) in str(exc), str(exc)
