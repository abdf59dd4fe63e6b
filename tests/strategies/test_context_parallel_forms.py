"""Context parallelism's closed forms solved for the sequence (`make bench-cp`'s budget table): the longest sequence
a per-rank attention budget holds is the largest multiple of what the implementation splits it into that fits, and
it grows with cp."""

from __future__ import annotations

import pytest

from gptpar.strategies.context_parallel import AttentionShape, attention_bytes, longest_sequence

GPT2_TINY = AttentionShape(layers=4, heads=4, kv_heads=4, head_dim=32, rows=4, seq=0)
MB = 2**20


def _at(seq: int) -> AttentionShape:
    return AttentionShape(GPT2_TINY.layers, GPT2_TINY.heads, GPT2_TINY.kv_heads, GPT2_TINY.head_dim, GPT2_TINY.rows,
                          seq)


@pytest.mark.parametrize(("impl", "split"), [("ring", 2), ("all_to_all", 1)])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_the_longest_sequence_is_the_last_split_multiple_that_fits(impl: str, split: int, cp: int) -> None:
    budget = 64 * MB
    seq = longest_sequence(budget, impl, cp, GPT2_TINY)
    assert seq % (split * cp) == 0
    assert attention_bytes(impl, cp, _at(seq)) <= budget < attention_bytes(impl, cp, _at(seq + split * cp))


def test_the_ring_holds_cp_times_the_sequence_of_one_rank() -> None:
    one = longest_sequence(64 * MB, "ring", 1, GPT2_TINY)
    assert [longest_sequence(64 * MB, "ring", cp, GPT2_TINY) for cp in (2, 4)] == [2 * one, 4 * one]
