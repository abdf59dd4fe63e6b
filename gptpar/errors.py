"""The one exception type the CLI turns into a one-line message and exit code 2, and the one way an
optional package that is missing becomes such a message."""

from __future__ import annotations

import importlib
from types import ModuleType


class GptparError(Exception):
    """A problem with the user's input or environment, explained in one line."""


class ConfigError(GptparError):
    """A bad config value; the message is one line naming the key and what is allowed."""


def require_extra(module: str, setting: str, extra: str) -> ModuleType:
    """Import a package of an optional extra, or fail in one line that says how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise GptparError(f"{setting} needs the {extra} extra: pip install 'gptpar[{extra}]' "
                          "(or make install)") from None


def first_sentence(exc: BaseException) -> str:
    """`Type: the first sentence` of an error from a library: torch.load(weights_only=True) and safetensors go on
    for lines, and torch's later sentences wrongly suggest retrying with weights_only=False."""
    return f"{type(exc).__name__}: {exc}".splitlines()[0].split(". ")[0]
