"""The docs' generated sections: text between a pair of HTML comment markers, rewritten from code
(the config reference, the log schema) so that the prose around it is kept and the table cannot go stale."""

from __future__ import annotations


def between_markers(text: str, name: str, body: str) -> str:
    """`text` with `body` between its `<!-- {name}:start -->` and `<!-- {name}:end -->` markers."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    head, _, rest = text.partition(start)
    _, _, tail = rest.partition(end)
    return f"{head}{start}\n{body}\n{end}{tail}"
