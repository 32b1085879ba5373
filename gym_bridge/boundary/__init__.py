"""The trust boundary: the one way in for every file, config, checkpoint, request body and endpoint answer that
gym-bridge did not write itself in this process, and the one way out into a run folder.

Its rules (``docs/reliability.md`` lists them with what stays trusted):

- :mod:`~gym_bridge.boundary.files`: regular files only, read under a size cap without blocking; writes into a
  folder go to a temporary file there and ``os.replace`` over the name; appends and repairs refuse a planted link.
- :mod:`~gym_bridge.boundary.json_io`: untrusted JSON decoded with a depth limit and finite numbers only; JSON out
  is strict (non-finite numbers become null).
- :mod:`~gym_bridge.boundary.jsonl`: JSONL files streamed line by line under a file cap and a line cap, a NUL byte
  refused at its line, each line decoded as ``json_io`` decodes (its depth counted on the bytes).
- :mod:`~gym_bridge.boundary.yaml_io`: YAML whose aliases would expand past a node budget is refused before
  anything is built from it.
- :mod:`~gym_bridge.boundary.text`: control, bidi and other unprintable characters escaped before text from a run
  folder reaches a terminal or a markdown file.

Every refusal is an :class:`UntrustedInputError`: one line naming the file (and line and field where there is one).
"""

from gym_bridge.boundary.errors import UntrustedInputError

__all__ = ["UntrustedInputError"]
