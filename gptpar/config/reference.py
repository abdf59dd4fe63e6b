"""docs/config_reference.md's table, generated from the schema so that it cannot go stale
(`make config-reference` writes it; a test checks it)."""

from __future__ import annotations

import dataclasses

from gptpar.config.schema import Config, section_class
from gptpar.markdown import between_markers


def reference_markdown() -> str:
    """The config reference table, generated so that it cannot go stale."""
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section_class(section.name)):
            meta = f.metadata
            extra = f" One of: {', '.join(meta['choices'])}." if meta.get("choices") else ""
            default = f.default if f.default != "" else '""'
            lines.append(f"| `{section.name}.{f.name}` | `{default}` | {meta['help']}{extra} |")
    return "\n".join(lines)


def with_reference(text: str) -> str:
    """`text` (docs/config_reference.md) with the generated reference between its two markers."""
    return between_markers(text, "config-reference", reference_markdown())
