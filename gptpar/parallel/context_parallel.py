"""Context parallelism (parallel.cp): each sequence of a micro-batch split over the cp ranks of a model replica, so
attention's activations fall as 1/cp. Everything outside attention is per token and runs on the shard as it is;
attention is the one place the shards meet, through an attention function transformers calls by name
(`ATTENTION`, registered with its AttentionInterface) that finds this rank's `ContextParallel` on the attention
module itself (thread ranks of one process share the registry, not the modules). Tensor parallelism's attention asks
for it the same way (`active`) and runs the exchange on its own heads; the pieces that tensor and pipeline parallelism
run take token ids only, and their position table or rotary module asks it for the shard's positions (`positions`).

The shard of rank r is `shard_positions`: the sequence in 2 * cp chunks, chunks r and 2 * cp - 1 - r, so that under
the causal mask every rank has an equal share of the work (an early chunk sees few keys, its mirror many). Each
token keeps its global position id (GPT-2's learned positions, Llama's rotary), and causality is decided between
global positions, so both implementations are exact. Packed rows (data.packing) keep their examples' position ids,
and a query sees only the keys of its own example (gptpar.models.packed_attention, the mask one process uses): each
rank knows every example of the rows, which every rank of a cp group reads whole before it keeps its shard.

- ring (`_Ring`): K/V go around the cp group (one send and one receive per step, the next block on its way while
  this one is attended to); each block gives a partial softmax over its keys, merged into the running result by
  log-sum-exp (online softmax). Its backward is a second ring that recomputes each block's softmax from the saved
  log-sum-exp, the gradients of K/V travelling with their block back to the rank that owns it: a rank keeps only its
  own q, k, v, output and log-sum-exp, whatever cp.
- all_to_all (Ulysses): an all-to-all trades heads for sequence (each rank gets n_head / cp heads of the whole
  sequence), plain causal attention runs on them in global order, and a second all-to-all gives the heads back.

The loss needs nothing of its own: on blocks of text every rank holds an equal number of each row's targets, so the
mean over the dp x cp ranks (the data-parallel sync over ParallelDims.replica_group) of each rank's mean is the global
mean; pair rows' shards hold different numbers of targets, which the trainer weighs as it weighs replicas' (its loss
divisors, counted on the shards). A mixture's routers run on the shard too; their statistics are summed over dp x cp
(gptpar.train.moe), and an expert's gradient over every cp rank of its replicas (grid.EXPERT_REPLICAS).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from gptpar.errors import GptparError
from gptpar.models import packed_attention, packed_examples
from gptpar.parallel.comm import SENT, comm_span
from gptpar.tensor_bytes import SavedBytes

ATTENTION = "gptpar_context_parallel"  # the name transformers' models call the attention function by
IMPLS = ("ring", "all_to_all")


def shard_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions rank `rank` of `cp` holds: chunks rank and 2 cp - 1 - rank of 2 cp equal chunks."""
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])


class ContextParallel:
    """This rank's place in its cp group and the implementation, held by every attention module of its model
    (`attach`); sequences are split only inside `sharded` (the training forward): evaluation and decoding run whole
    sequences on every rank through plain sdpa."""

    def __init__(self, group: dist.ProcessGroup, impl: str, count_saved: bool = False):
        self.group, self.impl = group, impl
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.active = False
        # count_saved: the first `sharded` forward counts what attention saves for backward (the memory record's
        # attention_bytes); only where no other saved-tensor hooks run (recompute's, the pipeline's, a compiled graph)
        self.count_saved, self.saved, self.saved_bytes = count_saved, None, None
        self.rows: torch.Tensor | None = None  # inside `sharded`: the packed rows' whole position ids (None: unpacked)

    def attach(self, model: nn.Module) -> None:
        """Route `model`'s attention through `ATTENTION`, every module knowing this rank's cp group: transformers'
        attention modules and tensor parallelism's (`active`), and the position table or rotary module a pipeline
        piece asks for its positions (gptpar.models.base.position_ids)."""
        AttentionInterface.register(ATTENTION, attention)
        model.config._attn_implementation = ATTENTION
        for module in model.modules():
            module.context_parallel = self

    @contextlib.contextmanager
    def sharded(self, rows: torch.Tensor | None = None) -> Iterator[None]:
        """Attention over the cp group inside; `rows`: the whole position ids of packed rows, whose examples do not
        see each other (None: each row one sequence)."""
        self.active, self.rows = True, rows
        self.saved = SavedBytes(()) if self.count_saved and self.saved_bytes is None else None
        try:
            yield
        finally:
            self.active, self.rows = False, None
            if self.saved is not None:
                self.saved_bytes, self.saved = self.saved.total, None

    def positions(self, length: int, device: torch.device) -> torch.Tensor:
        """The global positions of `length` tokens of this rank's shard inside `sharded`, else 0..length - 1 (for
        the pieces tensor and pipeline parallelism run, whose rows are never packed under cp)."""
        if not self.active:
            return torch.arange(length, device=device)
        return shard_positions(length * self.size, self.size, self.rank).to(device)

    def shard(self, batch: tuple[torch.Tensor, ...], with_positions: bool = True) -> tuple[torch.Tensor, ...]:
        """(inputs, labels[, position ids of packed rows]) of whole rows as this rank's (inputs, labels, position
        ids): each token keeps its position id, the row's own or its example's; without the position ids for a
        model run as pieces (tensor or pipeline parallelism), which ask `positions` themselves."""
        inputs = batch[0]
        if not with_positions:
            return self.mine(inputs), self.mine(batch[1])
        positions = batch[2] if len(batch) > 2 else torch.arange(inputs.size(1), device=inputs.device).expand_as(inputs)
        return self.mine(inputs), self.mine(batch[1]), self.mine(positions)

    def mine(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's positions (`shard_positions`) of a (batch, T, ...) tensor of whole rows."""
        return rows[:, self.global_positions(rows.size(1) // self.size).to(rows.device)]

    def global_positions(self, local: int) -> torch.Tensor:
        """The global positions of this rank's shard of `local` positions a row (`shard_positions`)."""
        return self._positions(self.rank, local)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, groups: int,
               scale: float) -> torch.Tensor:
        """Causal attention of this rank's queries (batch, heads, T / cp, dim) over the whole sequence; K/V with
        n_head / `groups` heads. Returns (batch, T / cp, heads, dim), as transformers' attention functions do."""
        if self.impl == "ring":
            examples = packed_examples(self.rows) if self.rows is not None else None
            out = _Ring.apply(query, key, value, groups, scale, self, examples)
        else:
            out = self._all_to_all(query, repeat_kv(key, groups), repeat_kv(value, groups), scale)
        return out.transpose(1, 2).contiguous()

    def _positions(self, rank: int, local: int) -> torch.Tensor:
        return shard_positions(local * self.size, self.size, rank)

    def visible(self, local: int, step: int, device: torch.device, examples: torch.Tensor | None) -> torch.Tensor:
        """Which keys of the block held at ring step `step` (rank r - step's) this rank's queries see: (T/cp, T/cp),
        or per row (batch, 1, T/cp, T/cp) where `examples` (packed_examples of the whole rows) keep each query to
        its own example."""
        mine = self._positions(self.rank, local).to(device)
        theirs = self._positions((self.rank - step) % self.size, local).to(device)
        causal = mine[:, None] >= theirs[None, :]
        if examples is None:
            return causal
        return (causal & (examples[:, mine, None] == examples[:, None, theirs]))[:, None]

    def start_shift(self, tensor: torch.Tensor) -> tuple[torch.Tensor, list[dist.Work]]:
        """`tensor` on its way to the next rank of the cp group, and the buffer the previous one's is arriving in:
        the caller computes meanwhile and waits on the works before reading the buffer."""
        tensor = tensor.contiguous()
        received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, self._peer(1), self.group),
               dist.P2POp(dist.irecv, received, self._peer(-1), self.group)]
        with comm_span("send", "recv", phase="issue"):
            works = dist.batch_isend_irecv(ops)
        SENT["send_recv"] += tensor.numel() * tensor.element_size()
        return received, works

    def _peer(self, offset: int) -> int:
        """The global rank `offset` places round the cp group from this one."""
        return dist.get_global_rank(self.group, (self.rank + offset) % self.size)

    def _all_to_all(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        """Heads for sequence, causal sdpa over the whole sequence in global order, sequence for heads."""
        q, k, v = (self._in_global_order(self._heads_for_sequence(t)) for t in (query, key, value))
        mask = packed_attention(self.rows) if self.rows is not None else None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)
        return self._sequence_for_heads(self._in_rank_order(out))

    def _in_global_order(self, tensor: torch.Tensor) -> torch.Tensor:
        """(B, H, T, D) gathered in rank order (rank r's chunks r and 2 cp - 1 - r, `shard_positions`) put in global
        order by its chunks: a concatenation, which autograd keeps no index for (attention's bytes fall as 1/cp)."""
        pieces, cp = tensor.chunk(2 * self.size, dim=2), self.size
        return torch.cat([pieces[2 * j if j < cp else 2 * (2 * cp - 1 - j) + 1] for j in range(2 * cp)], dim=2)

    def _in_rank_order(self, tensor: torch.Tensor) -> torch.Tensor:
        """The inverse of `_in_global_order`."""
        chunks, cp = tensor.chunk(2 * self.size, dim=2), self.size
        return torch.cat([chunks[j] for r in range(cp) for j in (r, 2 * cp - 1 - r)], dim=2)

    def _heads_for_sequence(self, tensor: torch.Tensor) -> torch.Tensor:
        """(B, H, T/cp, D) -> (B, H/cp, T, D): head group j to rank j, rank j's sequence shard back (in rank order)."""
        b, h, t, d = tensor.shape
        send = tensor.reshape(b, self.size, h // self.size, t, d).movedim(1, 0).contiguous()
        received = _Exchange.apply(send, self)
        return received.movedim(0, 2).reshape(b, h // self.size, self.size * t, d)

    def _sequence_for_heads(self, tensor: torch.Tensor) -> torch.Tensor:
        """(B, H/cp, T, D) -> (B, H, T/cp, D): the inverse of `_heads_for_sequence`."""
        b, h, t, d = tensor.shape
        send = tensor.reshape(b, h, self.size, t // self.size, d).movedim(2, 0).contiguous()
        received = _Exchange.apply(send, self)
        return received.movedim(0, 1).reshape(b, self.size * h, t // self.size, d)

    def exchange(self, send: torch.Tensor) -> torch.Tensor:
        """All-to-all along dim 0 (slice j to rank j, rank j's slice back as slice j)."""
        send = send.contiguous()  # a gradient may come strided; the exchange reads and writes flat slices
        received = torch.empty_like(send)
        with comm_span("all_to_all"):
            dist.all_to_all_single(received, send, group=self.group)
        SENT["all_to_all"] += (self.size - 1) * send[0].numel() * send.element_size()
        return received


def _partial(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor,
             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over one K/V block and its log-sum-exp per query. A query that sees none of the block gets
    a finite lse (the dtype's lowest score plus a log), so its weight in the merge is exactly zero, never NaN."""
    scores = (query @ key.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ value, lse


def _merged(out: torch.Tensor, lse: torch.Tensor, block: torch.Tensor,
            block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial softmaxes over disjoint keys as one: each weighted by its share of the total exp-sum."""
    total = torch.logaddexp(lse, block_lse)
    return (out * (lse - total).exp()[..., None] + block * (block_lse - total).exp()[..., None]), total


def arrived(received: torch.Tensor, works: list[dist.Work]) -> torch.Tensor:
    """`start_shift`'s buffer once its transfers are done."""
    with comm_span("send", "recv", phase="wait"):
        for work in works:
            work.wait()
    return received


class _Ring(torch.autograd.Function):
    """Ring attention with its own backward ring, keeping only this rank's q, k, v, output and log-sum-exp (not the
    blocks it visited). Forward: at each of cp steps the next K/V block is on its way while this one is attended to.
    Backward: the K/V blocks go round again, each block's softmax recomputed from the saved log-sum-exp; dq stays
    here, dK/dV travel with their block and, after the last step, one more step takes them home. Blocks travel in
    the inputs' dtype; scores, softmax, the merged output and log-sum-exp are fp32 whatever it is, as sdpa's kernels
    accumulate (a tiny GPT-2's gradients under bf16 autocast, relative L2 from fp32's and from one bf16 process's:
    6.0e-3 and 5.1e-3, merged in bf16 6.6e-3 and 6.1e-3)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, groups: int, scale: float, cp: ContextParallel,
                examples: torch.Tensor | None) -> torch.Tensor:
        kv, out, lse = torch.stack([key, value]), None, None
        with torch.autocast(query.device.type, enabled=False):  # fp32 inside, whatever autocast around
            for step in range(cp.size):
                ahead = cp.start_shift(kv) if step < cp.size - 1 else None
                block, block_lse = _partial(query.float(), repeat_kv(kv[0].float(), groups),
                                            repeat_kv(kv[1].float(), groups),
                                            cp.visible(query.size(2), step, query.device, examples), scale)
                out, lse = (block, block_lse) if out is None else _merged(out, lse, block, block_lse)
                if ahead is not None:
                    kv = arrived(*ahead)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.groups, ctx.scale, ctx.cp, ctx.examples = groups, scale, cp, examples
        return out.to(query.dtype)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with torch.autocast(grad_out.device.type, enabled=False):  # fp32 inside, as the forward
            return _Ring.ring_backward(ctx, grad_out)

    @staticmethod
    def ring_backward(ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor
                      ) -> tuple[torch.Tensor | None, ...]:
        saved, key, value, out, lse = ctx.saved_tensors
        groups, scale, cp = ctx.groups, ctx.scale, ctx.cp
        query, grad_out = saved.float(), grad_out.float()
        delta = (grad_out * out).sum(-1, keepdim=True)  # softmax's backward: sum_j p_ij dP_ij per query
        grad_query, kv = torch.zeros_like(query), torch.stack([key, value])
        grad_kv = torch.zeros_like(kv)
        for step in range(cp.size):
            ahead = cp.start_shift(kv) if step < cp.size - 1 else None
            k, v = repeat_kv(kv[0].float(), groups), repeat_kv(kv[1].float(), groups)
            scores = ((query @ k.transpose(-1, -2)) * scale).masked_fill(
                ~cp.visible(query.size(2), step, query.device, ctx.examples), torch.finfo(query.dtype).min)
            probs = (scores - lse[..., None]).exp()
            grad_scores = probs * (grad_out @ v.transpose(-1, -2) - delta) * scale
            grad_query += grad_scores @ k
            b, h, t, d = key.shape
            grad_kv += torch.stack([(grad_scores.transpose(-1, -2) @ query).view(b, h, groups, t, d).sum(2),
                                    (probs.transpose(-1, -2) @ grad_out).view(b, h, groups, t, d).sum(2)])
            grad_kv = arrived(*cp.start_shift(grad_kv))  # with its block: after the last step, home
            if ahead is not None:
                kv = arrived(*ahead)
        return grad_query.to(saved.dtype), grad_kv[0], grad_kv[1], None, None, None, None


class _Exchange(torch.autograd.Function):
    """The all-to-all of equal slices, whose gradient goes back by the same exchange (slice j came from rank j)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, send: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
        ctx.cp = cp
        return cp.exchange(send)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.cp.exchange(grad), None


def active(module: nn.Module) -> ContextParallel | None:
    """The ContextParallel attached to `module` while it shards (the training forward), else None: tensor
    parallelism's attention (on this rank's heads) asks it, as transformers' modules do through `attention`."""
    cp: ContextParallel | None = getattr(module, "context_parallel", None)
    return cp if cp is not None and cp.active else None


def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              **kwargs: object) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: this rank's shard through its module's ContextParallel inside
    `sharded`, else plain sdpa (whole sequences: evaluation, decoding)."""
    cp = active(module)
    if cp is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kwargs.get("sliding_window"):
        raise GptparError(f"parallel.cp={cp.size} runs full causal attention, not a sliding window of "
                          f"{kwargs['sliding_window']}; set the model's use_sliding_window to false, or parallel.cp=1")
    scale = scaling if scaling is not None else query.size(-1) ** -0.5
    with cp.saved or contextlib.nullcontext():  # counting, in the first sharded forward (count_saved)
        return cp.attend(query, key, value, getattr(module, "num_key_value_groups", 1), scale), None
