"""Context parallelism's closed forms, torch-free: the bytes a rank of a cp group sends per step and the bytes its
attention keeps for backward. The rank side counts what it sends (`comm_bytes`) and what autograd saves (the memory
record's `attention_bytes`), tests hold both to these, and the planner prices cp with the same terms, so a predicted
byte is a counted byte (gptpar/parallel/context_parallel.py says how each implementation moves them).

`rows` are one micro-batch's sequences on the rank, `seq` their whole length (each rank holds seq / cp of it),
`element` the bytes of one activation (4 at fp32)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionShape:
    """What cp's bytes depend on: the model's attention and one micro-batch on one rank."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rows: int
    seq: int
    element: int = 4

    def shard(self, cp: int) -> int:
        """Elements of one tensor of (rows, heads, seq / cp, head_dim): a rank's q, or its output."""
        return self.rows * self.heads * self.seq // cp * self.head_dim


@dataclass(frozen=True)
class Exchange:
    """One layer's exchanges of an implementation: `op` on tensors of `nbytes` (a ring step's K and V, or the whole
    input of one all-to-all), `forward` and `backward` calls of it."""

    op: str
    nbytes: int
    forward: int
    backward: int

    def sent(self, cp: int) -> int:
        """Bytes one rank puts on the wire per call: a ring step sends its whole tensor, an all-to-all (cp - 1) / cp."""
        return self.nbytes if self.op == "send_recv" else self.nbytes * (cp - 1) // cp


def exchange(impl: str, cp: int, a: AttentionShape) -> Exchange:
    """The ring passes K and V (each `shard` with kv_heads) on cp - 1 times forward, and backward again cp - 1 times
    with their gradients cp times (home after the last step); all_to_all exchanges q, k, v and the output (k and v
    repeated to every head first) forward, and their gradients backward."""
    if impl == "ring":
        return Exchange("send_recv", 2 * a.shard(cp) * a.kv_heads // a.heads * a.element, cp - 1, 2 * cp - 1)
    return Exchange("all_to_all", a.shard(cp) * a.element, 4, 4)


def sent_bytes(impl: str, cp: int, a: AttentionShape) -> dict[str, int]:
    """Bytes one rank sends in one micro-batch's forward and backward, by `comm_bytes` kind (none alone)."""
    if cp == 1:
        return {}
    e = exchange(impl, cp, a)
    return {e.op: a.layers * (e.forward + e.backward) * e.sent(cp)}


def attention_bytes(impl: str, cp: int, a: AttentionShape) -> int:
    """Bytes one rank's attention keeps for backward over one micro-batch's forward, every layer: q, k and v (k and v
    with kv_heads; all_to_all repeats them to every head before its exchange), the output and one log-sum-exp per
    query and head, all on seq / cp positions, so falling as 1 / cp (all_to_all puts the gathered sequence in global
    order and back by its chunks, which keeps no index)."""
    tokens = a.rows * a.seq // cp
    kv_heads = a.heads if impl == "all_to_all" else a.kv_heads
    per_token = (2 * a.heads + 2 * kv_heads) * a.head_dim + a.heads
    return a.layers * tokens * per_token * a.element


def longest_sequence(budget: float, impl: str, cp: int, a: AttentionShape) -> int:
    """The longest sequence (a multiple of the 2 cp chunks either implementation splits it into) whose
    `attention_bytes` on one rank fit `budget`; `a.seq` is ignored. 0 where none does."""
    step = 2 * cp
    per_seq = attention_bytes(impl, cp, AttentionShape(a.layers, a.heads, a.kv_heads, a.head_dim, a.rows, step,
                                                       a.element))  # linear in seq: the bytes of one step's worth
    return int(budget // per_seq) * step
