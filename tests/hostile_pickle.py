"""A pickle that runs code, for the tests that gptpar never unpickles one from a folder it did not write: loading it
calls open(marker, "w"), which leaves the marker file behind (no process is started, so it runs in the fast tier)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The global the pickle names, as this Python spells it (io.open on 3.11; another version may name its module
# otherwise): a refusal names it so.
CALLED = f"{open.__module__}.{open.__qualname__}"


class RunsCode:
    """Pickled as a call of io.open on the marker: unpickling it without restriction creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return open, (str(self.marker), "w")
