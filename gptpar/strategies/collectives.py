"""The ring terms of each collective, torch-free: what one rank puts on the wire and how many latency steps it
waits. The syncs count their `comm_bytes` with `ring_share` (gptpar.parallel.comm) and the planner prices
collectives with the same terms (gptpar.plan.network), so a predicted byte is a counted byte."""

from __future__ import annotations


def ring_share(op: str, amount: int, size: int) -> int:
    """What one rank sends in a ring `op` over `size` ranks of a tensor of `amount` bytes or elements, the whole tensor
    (an all-reduce's payload, an all-gather's output, a reduce-scatter's or an even all-to-all's input): an all-reduce
    2(g-1)/g of it, the others (g-1)/g."""
    return round(amount * (2 if op == "all_reduce" else 1) * (size - 1) / size)


def ring_steps(op: str, size: int) -> int:
    """Latency terms of a ring `op` over `size` ranks: 2(g-1) for an all-reduce, g-1 for the others (0 alone)."""
    return (2 if op == "all_reduce" else 1) * (size - 1)
