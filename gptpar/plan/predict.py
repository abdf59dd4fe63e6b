"""One training step of a layout, added up: compute from the calibration, communication from the network, overlap
as each strategy really does it, the pipeline through `schedules.simulate`, memory from the strategy table's closed
form plus activations held per schedule (`peak_activations`).

Overlap, as each sync does it (gptpar/parallel/data_parallel):
- a data-parallel strategy is priced by its row's `pricing` (gptpar/strategies/data_parallel.py): the shape of its
  sync (`SYNC_SHAPES` says each: per tensor, buckets, units), what it shards, what it holds in flight; the planner
  never names a strategy, and refuses one whose row has no pricing;
- under the multi-process pipeline every data-parallel sync reduces in finish(), after the schedule: exposed;
- tensor parallelism's all-reduces (or all-gathers and reduce-scatters with sequence parallelism) sit between the
  matmuls that need them: exposed, added to the actions they belong to;
- the pipeline's sends and receives are added to the forward and backward that produce them;
- context parallelism's ring steps or all-to-alls (parallel.cp) are added to each block's forward and backward,
  exposed; a rank computes its seq_len / cp tokens (each rank an equal share of the causal work, the ring's split
  being load-balanced) and keeps their activations, and the data-parallel sync runs over the dp x cp replicas.
  Where the calibration timed the cp block whole (its cp and cp_impl, `cp_kind`), a block costs what was timed,
  the exchange it prices taken out of it to be shown as exposed (as the tp block's collectives); else the plain
  block's rate on the rank's tokens, which left cp2 47% (ring) and 40% (all_to_all) under the measured step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gptpar.errors import GptparError
from gptpar.flops import FlopsShape, flops_per_token, peak_flops
from gptpar.plan.calibration import RECOMPUTED, Calibration, cp_kind, tp_kind
from gptpar.plan.layout import Layout, block_flops, head_flops
from gptpar.plan.network import Network
from gptpar.strategies.context_parallel import exchange
from gptpar.strategies.data_parallel import (
    DP_STRATEGIES,
    MOVED,
    WIRE_BYTES,
    DataParallelStrategy,
    Pricing,
    either,
    hpz_bytes,
    wire_value_bytes,
)
from gptpar.strategies.pipeline import Action, peak_activations, schedule, schedule_shape, simulate

ACTIVATION_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}
# Of the activations a transformer block saves, the share tensor parallelism splits (Korthikanti et al. 2022: 34sbh
# bytes per layer, of which 24sbh are inside the split attention and MLP and 10sbh the replicated norms and
# residuals, which sequence parallelism splits too).
TP_SPLIT_SHARE = 24 / 34
BLOCK_KINDS = ("block_f", "block_b", "block_w")
CP_LABEL = {"ring": "cp send_recv", "all_to_all": "cp all_to_all"}  # parallel.cp's exchanges in exposed_comm_s


@dataclass
class Prediction:
    """A layout's predicted step: seconds by part, memory per rank by part, throughput and utilisation."""

    step_time_s: float
    tokens_per_s: float
    memory_bytes: int  # the fullest rank's
    compute_s: float
    bubble_s: float
    exposed_comm_s: dict[str, float]
    memory: dict[str, int]
    mfu: float | None
    gpus: int
    notes: list[str] = field(default_factory=list)
    memory_ranks: list[dict[str, int]] = field(default_factory=list)  # each pipeline rank's, as `memory`

    def to_dict(self) -> dict[str, object]:
        return {"step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "memory_bytes": self.memory_bytes, "compute_s": self.compute_s, "bubble_s": self.bubble_s,
                "exposed_comm_s": self.exposed_comm_s, "memory": self.memory, "mfu": self.mfu, "gpus": self.gpus,
                "notes": self.notes, "memory_per_pipeline_rank": self.memory_ranks}


@dataclass(frozen=True)
class Costs:
    """Seconds of one micro-batch's actions on one pipeline rank (tensor-parallel communication included)."""

    f: float
    b: float
    w: float
    tp_comm: float  # of which tensor-parallel communication
    ep_comm: float = 0.0  # and parallel.ep's all-to-alls
    cp_comm: float = 0.0  # and parallel.cp's ring steps or all-to-alls

    @property
    def whole(self) -> float:
        return self.f + self.b + self.w


class Model:
    """The cost model of one layout on one calibration and network."""

    def __init__(self, layout: Layout, calib: Calibration, net: Network) -> None:
        self.lay, self.c, self.net = layout, calib, net
        self.alone = layout.world == 1  # one rank: on a CPU it has the machine to itself
        # On a CPU the backend's threads copy and sum the bytes on the cores the ranks compute on, so what a
        # strategy overlaps with backward still takes its time from the step (bench-plan: backward ran 31% slower
        # beside a sync's bucket all-reduces than alone). On GPUs the collectives run beside the kernels.
        self.overlaps = calib.device != "cpu"
        self.act = ACTIVATION_BYTES.get(layout.precision, 4)
        self.exposed: dict[str, float] = {}
        self.block_f = self.block_bw = self.head_f = self.head_bw = 0.0

    def _add(self, kind: str, seconds: float) -> None:
        if seconds > 0:
            self.exposed[kind] = self.exposed.get(kind, 0.0) + seconds

    def _tp(self, op: str, nbytes: float) -> float:
        return self.net.seconds(op, nbytes, self.lay.tp, 1)

    def block_comm(self) -> tuple[float, float]:
        """A block's tensor-parallel communication in forward and in backward: two all-reduces of the hidden states
        each way (attention's and the MLP's row-parallel outputs), or with sequence parallelism an all-gather and a
        reduce-scatter in their place."""
        if self.lay.tp == 1:
            return 0.0, 0.0
        hidden = self.lay.tokens * self.lay.shape.n_embd * self.act
        one = (self._tp("all_gather", hidden) + self._tp("reduce_scatter", hidden) if self.lay.sequence_parallel
               else self._tp("all_reduce", hidden))
        return 2 * one, 2 * one

    def expert_comm(self) -> tuple[float, float]:
        """A mixture block's all-to-alls under parallel.ep in forward and in backward (gptpar.parallel.expert_parallel):
        forward exchanges each expert's count of picks (int64), then sends its tokens' top-k picks to their experts'
        ranks and the results back; backward sends their gradients the same two ways. (0, 0) without ep."""
        lay = self.lay
        if lay.ep == 1 or not lay.shape.moe:
            return 0.0, 0.0
        picks = lay.tokens * lay.shape.top_k * lay.shape.n_embd * self.act
        counts = self.net.seconds("all_to_all", lay.shape.n_experts * 8, lay.ep, lay.tp)
        both_ways = 2 * self.net.seconds("all_to_all", picks, lay.ep, lay.tp)
        return counts + both_ways, both_ways

    def context_comm(self) -> tuple[float, float]:
        """A block's exchanges under parallel.cp in forward and in backward (gptpar.strategies.context_parallel's
        `exchange`, the closed form `comm_bytes` is held to): the ring's steps each a send to the next rank of the cp
        group (tp ranks apart; the step waits for the hop that wraps round, (cp - 1) tp apart), all_to_all's over the
        cp group. Priced as exposed: the ring's overlap of a step's transfer with its block's attention is not
        modelled. (0, 0) without cp."""
        lay = self.lay
        if lay.cp == 1:
            return 0.0, 0.0
        e = exchange(lay.cp_impl, lay.cp, lay.attention(self.act))
        if e.op == "send_recv":
            one = self.net.seconds("send_recv", e.nbytes, 2, lay.tp * (lay.cp - 1))
        else:
            one = self.net.seconds("all_to_all", e.nbytes, lay.cp, lay.tp)
        return e.forward * one, e.backward * one

    def head_comm(self) -> tuple[float, float]:
        """The vocabulary-parallel embedding's and head's communication in forward and in backward (gptpar.parallel.
        tensor_parallel.layers): the embedding's partial rows all-reduced, and the head's input all-reduced in
        backward (its copy to the group); with sequence parallelism a reduce-scatter into sequence shards and an
        all-gather of them for the head in forward, the conjugates in backward. Then the loss, forward only: three
        all-reduces of one fp32 number per token on vocabulary shards (parallel.loss_parallel), else an all-gather of
        the logits."""
        if self.lay.tp == 1:
            return 0.0, 0.0
        tokens, d = self.lay.tokens, self.lay.shape.n_embd
        hidden = tokens * d * self.act
        one_way = (self._tp("reduce_scatter", hidden) + self._tp("all_gather", hidden) if self.lay.sequence_parallel
                   else self._tp("all_reduce", hidden))
        loss = (3 * self._tp("all_reduce", tokens * 4) if self.lay.loss_parallel
                else self._tp("all_gather", tokens * self.lay.vocab * self.act))
        return one_way + loss, one_way

    def rank_costs(self, rank: int) -> Costs:
        """One micro-batch's F, B and W on pipeline rank `rank`: the sum of its stages'."""
        self.head_f = self.head_bw = 0.0
        parts = [self.stage_costs(s) for s in self.lay.stages_of(rank)]
        return Costs(*(sum(getattr(p, name) for p in parts) for name in ("f", "b", "w", "tp_comm", "ep_comm",
                                                                         "cp_comm")))

    def stage_costs(self, stage: int) -> Costs:
        """One micro-batch's F, B and W on pipeline stage `stage`: its blocks, recomputation in backward, the head and
        loss on the last stage, and tensor-parallel communication."""
        lay, c = self.lay, self.c
        f, b, w = block_flops(lay.shape, lay.tokens, lay.seq_len, lay.tp, lay.block_trainable if lay.lora else None)
        comm_f, comm_b = self.block_comm()
        cp_f, cp_b = self.context_comm()
        kinds = timed_whole(lay, c)
        if kinds:  # measured whole: its collectives (tp's, else cp's exchanges) are inside, priced apart as exposed
            inside = (comm_f, comm_b, 0.0) if lay.tp > 1 else (cp_f, cp_b, 0.0)
            bf, bb, bw = (c.seconds(k, flops) - comm for k, flops, comm in zip(kinds, (f, b, w), inside, strict=True))
        else:
            # The pipeline engine counts the bytes each forward saves (pp_peak_activation_bytes), a Python hook on
            # every saved tensor: its forwards are timed so where the calibration has them.
            forward = "block_f_counted" if lay.pp > 1 and "block_f_counted" in c.compute else "block_f"
            bf, bb, bw = (c.seconds(forward, f, self.alone), c.seconds("block_b", b, self.alone),
                          c.seconds("block_w", w, self.alone))
        n, recomputed = lay.stage_blocks[stage], lay.recomputed_in_stage(stage)
        if not kinds and lay.tp == 1 and all(k in c.compute for k in RECOMPUTED):  # a recomputed block timed whole
            rf, rb, rw = (c.seconds(k, flops, self.alone) for k, flops in zip(RECOMPUTED, (f, b, w), strict=True))
        else:  # its forward again in backward
            rf, rb, rw = bf, bb + bf, bw
        tp_comm = n * (comm_f + comm_b) + recomputed * comm_f
        a2a_f, a2a_b = self.expert_comm()
        ep_comm = n * (a2a_f + a2a_b) + recomputed * a2a_f
        cp_comm = n * (cp_f + cp_b) + recomputed * cp_f
        comm_f, comm_b = comm_f + a2a_f + cp_f, comm_b + a2a_b + cp_b
        kept = n - recomputed
        cost_f = kept * (bf + comm_f) + recomputed * (rf + comm_f)
        cost_b = kept * (bb + comm_b) + recomputed * (rb + comm_b + comm_f)
        cost_w = kept * bw + recomputed * rw
        self.block_f, self.block_bw = bf + comm_f, bb + comm_b + bw
        if stage == lay.last_stage:
            hf = head_flops(lay.shape.n_embd, lay.vocab, lay.head_rows, lay.tp)
            head_cf, head_cb = self.head_comm()
            kinds = [tp_kind(k, lay.tp, lay.sequence_parallel, lay.loss_parallel) for k in ("head_f", "head_bw")]
            back, weights = head_backward(lay, hf)
            if lay.tp > 1 and all(k in c.compute for k in kinds):  # measured whole: its collectives are inside
                head_f, hbw = c.seconds(kinds[0], hf), c.seconds(kinds[1], 2 * hf)
            else:  # an image classifier's patch projection (pp = 1: its first stage is its last) at the head's rate
                head_f = c.seconds("head_f", hf + lay.patch_flops, self.alone) + head_cf
                hbw = c.seconds("head_bw", back + weights, self.alone) + head_cb
            cost_f += head_f
            self.head_f, self.head_bw = head_f, hbw
            cost_b += hbw * back / (back + weights)
            cost_w += hbw * weights / (back + weights)
            tp_comm += head_cf + head_cb
        return Costs(cost_f, cost_b, cost_w, tp_comm, ep_comm, cp_comm)

    def p2p(self) -> float:
        """One activation (or its gradient) sent to the next stage."""
        if self.lay.pp == 1:
            return 0.0
        lay = self.lay
        return self.net.seconds("send_recv", lay.tokens * lay.shape.n_embd * self.act, 2, lay.replicas * lay.tp)

    def pipeline(self) -> tuple[float, float, list[list[Action]]]:
        """(window of one micro-step's schedule, mean compute inside it, each rank's actions)."""
        lay = self.lay
        last = lay.last_stage
        costs = [self.stage_costs(s) for s in range(last + 1)]
        hop = self.p2p()
        split = schedule_shape(lay.schedule, lay.pp, lay.chunks, lay.virtual).split_backward
        lists = schedule(lay.schedule, lay.pp, lay.chunks, lay.virtual)

        def cost(action: Action) -> float:
            """The action's stage's cost (its own blocks, the head on the last), and the send that follows it."""
            sc = costs[action.stage]
            if action.kind == "F":
                return sc.f + (hop if action.stage < last else 0.0)
            if action.kind == "B":
                return (sc.b if split else sc.b + sc.w) + (hop if action.stage > 0 else 0.0)
            return sc.w

        timeline = simulate(lists, cost_of=cost)
        busy = sum(sc.whole for sc in costs) * lay.chunks / lay.pp
        self._add("send_recv", 2 * lay.chunks * lay.virtual * hop if lay.pp > 1 else 0.0)
        self._add("tp", sum(sc.tp_comm for sc in costs) / lay.pp * lay.chunks)
        self._add("all_to_all", sum(sc.ep_comm for sc in costs) / lay.pp * lay.chunks)
        self._add(CP_LABEL[lay.cp_impl], sum(sc.cp_comm for sc in costs) / lay.pp * lay.chunks)
        return timeline.makespan, busy, lists

    def dp_sync(self, backward_s: float, n: int, rank: int) -> float:
        """Exposed seconds of the data-parallel sync of one step on pipeline rank `rank`, whose last micro-step's
        backward took `backward_s` (what buckets overlap with) and whose rank trains `n` parameters (their gradients
        synced, their updated shards gathered): the shape its row's pricing names, over the dp x cp replicas (tp ranks
        apart)."""
        lay = self.lay
        if lay.replicas == 1:
            return 0.0
        row = DP_STRATEGIES[lay.dp_sync]
        wire = WIRE_BYTES.get(lay.grad_comm, 4.0)
        ops = ("all_to_all", "all_gather") if lay.grad_comm == "int8" else None
        grads = n * (1.0 if ops else wire)
        stride = lay.tp

        def coll(op: str, nbytes: float) -> float:
            if ops and op in ("all_reduce", "reduce_scatter"):  # qgZ: an all-to-all (and an all-gather)
                t = self.net.seconds("all_to_all", nbytes, lay.replicas, stride)
                return t + (self.net.seconds("all_gather", nbytes, lay.replicas, stride) if op == "all_reduce" else 0.0)
            return self.net.seconds(op, nbytes, lay.replicas, stride)

        params_gather = self.net.seconds("all_gather", n * 4.0, lay.replicas, stride)
        if lay.pp > 1:  # the pipeline syncs in finish(), after its schedule
            op = "reduce_scatter" if "grads" in row.sharded else "all_reduce"
            exposed = coll(op, grads) + (params_gather if row.sharded else 0.0)
            self._add(op, exposed)
            return exposed
        pricing = priced(lay.dp_sync)
        if pricing.shape == "tensors":
            t = sum(coll("all_reduce", grads * share) for share in self.tensors(rank))
            self._add("all_reduce", t)
            return t
        if pricing.shape == "units":
            return self.gathered_units(n, pricing.label or "gathers and reduce-scatters")
        return self.bucket_sync(row, backward_s, grads, coll, params_gather)

    def bucket_sync(self, row: DataParallelStrategy, backward_s: float, grads: float, coll,
                    params_gather: float) -> float:
        """The "buckets" shape: sharded gradients reduce-scattered in every micro-step (else all-reduced once), and
        sharded state's updated parameters all-gathered after the step."""
        shards_grads = "grads" in row.sharded
        op = "reduce_scatter" if shards_grads else "all_reduce"
        exposed = self.buckets(backward_s, grads, op, coll) * (self.lay.grad_accum if shards_grads else 1)
        self._add(op, exposed)
        if row.sharded:
            self._add("all_gather", params_gather)
            exposed += params_gather
        return exposed

    def units(self) -> list[tuple[float, float]]:
        """The parameters pipeline rank 0 trains in backward's order as (share of them, share of backward done when
        their gradients are complete): the final norm (under LoRA the head's adapters and the modules that train
        whole) after the head's backward, each block after its own, the embedding tables (the tied head's gradient
        included; under LoRA their adapters or the patch projection's) last."""
        lay = self.lay
        n, blocks = lay.trainable(0), lay.blocks_of(0)
        late = lay.lora.last if lay.lora else lay.shape.norm_parameters() if lay.holds_head(0) else 0
        head, block = self.head_bw, self.block_bw
        total = head + blocks * block
        units = [(late / n, head / total)]
        units += [(lay.block_trainable / n, (head + (i + 1) * block) / total) for i in range(blocks)]
        return [*units, ((lay.end_trainable(0) - late) / n, 1.0)]

    def buckets(self, backward_s: float, grads: float, op: str, coll) -> float:
        """Exposed seconds of buckets of parallel.bucket_mb reduced one after another as backward completes them."""
        cap = self.lay.bucket_mb * 2**20
        size = ready = 0.0
        done, free = [], 0.0
        for share, at in self.units():
            size += share * grads
            ready = at * backward_s
            if size >= cap:
                done.append((size, ready))
                size = 0.0
        if size:
            done.append((size, ready))
        if not self.overlaps:
            return sum(coll(op, nbytes) for nbytes, _ in done)
        for nbytes, ready_at in done:
            free = max(free, ready_at) + coll(op, nbytes)
        return max(0.0, free - backward_s)

    def gathered_units(self, n: int, label: str) -> float:
        """Exposed seconds of the "units" shape's gathers and reduce-scatters over one step (under `label`): a FIFO of
        collectives, each block's gather issued when the block before it starts (one unit of prefetch), its
        reduce-scatter after its backward."""
        lay = self.lay
        costs = self.rank_costs(0)
        blocks = lay.blocks_of(0)
        block_bytes, root_bytes = lay.block_parameters * 4.0, lay.end_parameters(0) * 4.0  # every weight gathered
        block_grads, root_grads = lay.block_trainable * 4.0, lay.end_trainable(0) * 4.0  # the trained reduced
        wire = WIRE_BYTES.get(lay.grad_comm, 4.0) / 4.0
        gathered = wire_value_bytes(lay.param_comm, lay.quant_block) / 4.0  # parallel.param_comm (qwZ at int8)
        later = lay.hpz_node or lay.replicas  # under hpZ only the step's first gather of each unit crosses nodes

        def ag(nbytes: float, group: int) -> float:
            return self.net.seconds("all_gather", nbytes * gathered, group, lay.tp)

        def rs(nbytes: float) -> float:
            return self.net.seconds("reduce_scatter", nbytes * wire, lay.replicas, lay.tp)

        if not self.overlaps:  # every gather and reduce-scatter of every micro-step, one after another
            exposed = 0.0
            for micro in range(lay.grad_accum):
                forward = lay.replicas if micro == 0 else later
                exposed += ag(root_bytes, forward) + blocks * ag(block_bytes, forward)
                exposed += blocks * (ag(block_bytes, later) + rs(block_grads)) + rs(root_grads)
            self._add(label, exposed)
            return exposed

        per_f = [self.block_f] * blocks
        head_f = self.head_f
        per_bw = [self.block_bw + (costs.b + costs.w - self.head_bw - blocks * self.block_bw) / max(blocks, 1)] * blocks
        exposed = 0.0
        for micro in range(lay.grad_accum):
            # forward: root, then blocks with one prefetched
            forward = lay.replicas if micro == 0 else later
            t = free = ag(root_bytes, forward)
            gather_end = free = free + ag(block_bytes, forward)
            for i in range(blocks):
                start = max(t, gather_end)
                if i + 1 < blocks:
                    gather_end = free = max(free, start) + ag(block_bytes, forward)
                t = start + per_f[i]
            t += head_f + self.head_bw
            compute = sum(per_f) + head_f + self.head_bw
            # backward: the head's (the root stays gathered), then blocks last to first, each gathered again (the
            # last block's when the head's backward hands it its gradient), its gradients reduce-scattered after it
            gather_end = free = max(free, t) + ag(block_bytes, later)
            for i in range(blocks):
                start = max(t, gather_end)
                if i + 1 < blocks:
                    gather_end = free = max(free, start) + ag(block_bytes, later)
                t = start + per_bw[i]
                free = max(free, t) + rs(block_grads)
            free = max(free, t) + rs(root_grads)
            compute += sum(per_bw)
            exposed += max(free, t) - compute
        self._add(label, exposed)
        return exposed

    def tensors(self, rank: int) -> list[float]:
        """The rank's parameter tensors as shares of its parameters (the "tensors" shape reduces each alone): per block
        its weights, biases and norms, then the tables and final norm."""
        s = self.lay.shape
        t = s.traits
        if self.lay.lora:  # the adapters' A and B, the modules that train whole
            return [1.0 / self.lay.lora.tensors] * self.lay.lora.tensors
        if t.gated_mlp:  # q, k, v, o, gate, up, down and two norms; qwen2's q, k and v biases
            per_block = 9 + 3 * t.qkv_bias
        else:  # GPT-2: fused qkv, its projection, fc, proj, each with its bias, and two norms with theirs
            per_block = 12
        blocks = self.lay.blocks_of(rank)
        ends = 1 + t.learned_positions + 1 + t.norm_biases + (0 if s.tied else 1)
        count = blocks * per_block + ends
        return [1.0 / count] * count


def head_backward(lay: Layout, hf: float) -> tuple[float, float]:
    """FLOPs of the head's backward whose forward is `hf`: its input gradient, and the weight gradients (the head's
    and an image classifier's patch projection's, whose pixels need no input gradient). Under LoRA the frozen weights
    get none: the head's only where it trains whole (ViT's classifier); the adapters at the ends are not counted."""
    if lay.lora:
        return hf, hf if lay.lora.head_whole else 0.0
    return hf, hf + lay.patch_flops


def timed_whole(lay: Layout, calib: Calibration) -> list[str] | None:
    """The calibration's kinds of `lay`'s block F, B and W timed whole with its communication inside: our
    tensor-parallel block at its tp (and SP), else under parallel.cp the context-parallel block at its cp and cp_impl;
    None where it timed no such block (a layout without either, or a calibration older than those timings or of
    another group size)."""
    if lay.tp > 1:
        kinds = [tp_kind(k, lay.tp, lay.sequence_parallel) for k in BLOCK_KINDS]
    elif lay.cp > 1:
        kinds = [cp_kind(k, lay.cp, lay.cp_impl) for k in BLOCK_KINDS]
    else:
        return None
    return kinds if all(k in calib.compute for k in kinds) else None


def priced(dp_sync: str) -> Pricing:
    """The pricing of parallel.dp_sync's row, or a one-line refusal naming the strategies the planner can price."""
    pricing = DP_STRATEGIES[dp_sync].pricing
    if pricing is None:
        pricable = [name for name, row in DP_STRATEGIES.items() if row.pricing is not None]
        raise GptparError(f"parallel.dp_sync={dp_sync} has no pricing in its row (gptpar/strategies/data_parallel.py), "
                          f"so the planner cannot predict it; plan with parallel.dp_sync={either(pricable)}")
    return pricing


def predict(layout: Layout, calib: Calibration, net: Network, device: str) -> Prediction:
    """The step of `layout` on `device` (its calibration `calib`, its links `net`): the schedule (or the micro-steps),
    the slowest pipeline rank's data-parallel sync, the optimizer on what the rank steps, and the step's small
    all-reduces (the global loss over dp, the gradient norm over pp)."""
    lay = layout
    if lay.replicas > 1:
        priced(lay.dp_sync)
    if lay.precision != calib.precision:
        raise GptparError(f"train.precision={lay.precision} but the calibration was measured in "
                          f"{calib.precision}; calibrate with --precision {lay.precision}, or set "
                          f"train.precision={calib.precision}")
    model = Model(lay, calib, net)
    row = DP_STRATEGIES[lay.dp_sync]
    sharded = bool(row.sharded) and lay.replicas > 1
    # Pipeline stages, shards and our tensor-parallel pieces sum the norm's squares per tensor (clip_gradients'
    # groups, as Trainer._norm_plan picks them); torch's DTensor pieces and DTensor shards (a row whose pricing says
    # grouped_norm=False) take torch's own norm.
    ours = lay.tp > 1 and lay.tp_impl == "gptpar"
    grouped = lay.pp > 1 or ours or lay.ep > 1 or (sharded and row.pricing.grouped_norm)
    kind = "optimizer_grouped" if grouped and "optimizer_grouped" in calib.compute else "optimizer"
    optimizer = max(calib.seconds(kind, lay.trainable(r) / (lay.replicas if sharded else 1), model.alone)
                    for r in range(lay.pp))
    lists = None
    if lay.pp > 1:
        window, busy, lists = model.pipeline()
        compute_s, bubble_s, core = busy * lay.grad_accum, max(window - busy, 0.0) * lay.grad_accum, window
    else:
        costs = model.rank_costs(0)
        compute_s, bubble_s, core = costs.whole - costs.tp_comm - costs.ep_comm - costs.cp_comm, 0.0, costs.whole
        model._add("tp", costs.tp_comm * lay.grad_accum)
        model._add("all_to_all", costs.ep_comm * lay.grad_accum)
        model._add(CP_LABEL[lay.cp_impl], costs.cp_comm * lay.grad_accum)
        compute_s *= lay.grad_accum
    core *= lay.grad_accum
    first = model.rank_costs(0)
    backward = first.b + first.w
    before, (sync, exposed) = dict(model.exposed), (0.0, dict(model.exposed))
    for r in range(lay.pp):  # every pipeline rank syncs its own stage; the step waits for the slowest
        model.exposed = dict(before)
        seconds = model.dp_sync(backward, lay.trainable(r), r)
        if seconds >= sync:
            sync, exposed = seconds, model.exposed
    model.exposed = exposed
    small = (net.seconds("all_reduce", 8, lay.replicas, lay.tp)
             + net.seconds("all_reduce", 8, lay.pp, lay.replicas * lay.tp))
    model._add("small", small)
    tied = 0.0
    if lay.pp > 1 and lay.shape.tied:  # the embedding's two copies (first and last stage) add their gradients
        stride = lay.replicas * lay.tp * (lay.pp - 1)
        tied = net.seconds("all_reduce", lay.vocab // lay.tp * lay.shape.n_embd * 4, 2, stride)
        model._add("tied embedding all_reduce", tied)
    copies = max(host_copy_s(lay, net, r) for r in range(lay.pp))
    model._add("host-device copies", copies)
    step = core + sync + optimizer + small + tied + copies
    memory = memory_parts(lay, calib, lists)
    fullest = max(memory, key=lambda m: m["total"])
    tokens_per_s = lay.step_tokens / step
    peak = peak_flops(device, lay.precision)
    flops = flops_per_token(FlopsShape(lay.shape, lay.seq_len, lay.vocab, lora=lay.lora))
    mfu = flops * tokens_per_s / (lay.world * peak) if peak else None
    notes = approximations(lay, calib)
    return Prediction(step, tokens_per_s, fullest["total"], compute_s + optimizer, bubble_s, dict(model.exposed),
                      fullest, mfu, lay.world, notes, memory)


def host_copy_s(lay: Layout, net: Network, rank: int) -> float:
    """Seconds of one step's copies between pipeline rank `rank`'s device and its host under parallel.offload (its
    row's `host_copy_bytes` of the rank's parameters and those it trains, over the network's host-device link), all
    exposed."""
    nbytes = DP_STRATEGIES[lay.dp_sync].host_copy_bytes(lay.rank_parameters(rank), lay.replicas, lay.offload,
                                                        lay.grad_accum, lay.trainable(rank))
    return net.host_device.seconds("send_recv", nbytes, 1) if nbytes else 0.0


def approximations(lay: Layout, calib: Calibration) -> list[str]:
    """What the prediction of `lay` on `calib` prices as something close to it, said beside it."""
    notes = []
    if lay.grad_comm == "powersgd":
        notes.append("parallel.grad_comm=powersgd is priced as fp32 (its low-rank P and Q are not modelled)")
    row = DP_STRATEGIES[lay.dp_sync]
    if row.syncs(lay.replicas, lay.offload) and row.pricing.note:
        notes.append(row.pricing.note)
    if lay.tp > 1 and lay.tp_impl == "torch":
        notes.append("parallel.tp_impl=torch is priced as our tensor-parallel block and head (the same collectives "
                     "between the same matmuls; DTensor's dispatch is not timed)")
    if lay.offload != "none":
        notes.append(f"parallel.offload={lay.offload}: the host-device copies are priced as exposed and the host's "
                     "optimizer step at the device's calibrated rate")
    if lay.cp > 1 and (lay.tp > 1 or not timed_whole(lay, calib)):
        notes.append(f"parallel.cp={lay.cp}, cp_impl={lay.cp_impl}: the calibration timed no such block whole (it "
                     "times one at cp = its ranks, without tp), so its blocks are priced at the calibrated block's "
                     "rate (sdpa's kernel: the ring attends by plain matmuls, all_to_all reorders its tensors) and its "
                     "exchanges as exposed beside them")
    if lay.lora:
        notes.append(f"train.lora_rank={lay.lora_rank}: {lay.lora.total:,} parameters train (gptpar/adapters.py), "
                     "their gradients, optimizer state and sync alone priced; the activations are full training's "
                     "calibrated figure (a frozen layer may save less): an upper bound")
    elif lay.lora_rank:
        notes.append(f"train.lora_rank={lay.lora_rank} is priced as full training (every weight's gradient, "
                     f"optimizer state and gradient sync): train.lora_targets {', '.join(lay.lora_unknown)} names no "
                     "layer the closed form counts (gptpar/adapters.py: a mixture's experts or router, a norm, a "
                     "padded LM head or a name the model lacks), so its memory and step time are upper bounds")
    if lay.ep > 1 and lay.shape.moe:
        notes.append("parallel.ep: the experts' gradients are priced as reduced over all of dp (they are reduced "
                     "over their dp/ep replicas), and routing as balanced")
    return notes


def stage_activation_bytes(lay: Layout, calib: Calibration, stage: int) -> float:
    """Bytes one micro-batch leaves saved for backward in `stage`: its blocks' (the calibrated bytes per token and
    unit of width, the share tensor parallelism splits divided by tp; a recomputed block only its input), and the
    loss's fp32 logits (an image classifier's: one row per image) where the stage holds the head."""
    act = ACTIVATION_BYTES.get(lay.precision, 4)
    split = 1 / lay.tp if lay.sequence_parallel else (1 - TP_SPLIT_SHARE) + TP_SPLIT_SHARE / lay.tp
    block = lay.tokens * calib.activation_bytes_per_token_width * lay.shape.n_embd * split
    recomputed = lay.recomputed_in_stage(stage)
    held = (lay.stage_blocks[stage] - recomputed) * block + recomputed * lay.tokens * lay.shape.n_embd * act
    head = stage == lay.last_stage
    return held + (lay.head_rows * lay.vocab / lay.tp * 4 if head else 0.0)


def memory_parts(lay: Layout, calib: Calibration, lists: list[list[Action]] | None) -> list[dict[str, int]]:
    """Each pipeline rank's bytes: training state on the device by the strategy table's closed form (under LoRA
    gradients and optimizer state of what trains only; under parallel.offload what moved is "host", outside the
    device's total), activations of the
    micro-batches it holds at once (weighted `peak_activations` of its schedule, one micro-step without a pipeline),
    the units a sharding sync holds unsharded (its pricing's `gathered_bytes`, wherever a sync runs: over dp x cp
    replicas, or over a group of one under parallel.offload, whose units are copied in to run), hpZ's secondary copy
    (`hpz_bytes`)."""
    row = DP_STRATEGIES[lay.dp_sync]
    out = []
    for r in range(lay.pp):
        n, trained = lay.rank_parameters(r), lay.trainable(r)
        if lists is None:
            held = stage_activation_bytes(lay, calib, 0)
        else:
            held = peak_activations(lists[r], lambda a: stage_activation_bytes(lay, calib, a.stage))
        gathered = 0
        if row.syncs(lay.replicas, lay.offload):  # its units are gathered (over a group of one: copied in) to run
            gathered = int(row.pricing.gathered_bytes(lay.end_parameters(r), lay.block_parameters, trained,
                                                      lay.replicas == 1, lay.grad_accum > 1))
        # by role, the device's: what parallel.offload moved is 0 here and in "host"
        shard = {part: math.inf if part in MOVED[lay.offload] else lay.replicas if part in row.sharded else 1
                 for part in ("params", "grads", "optimizer")}
        device, host = row.placed_bytes(n, lay.replicas, lay.offload, trained)
        parts = {"params": int(n * 4 / shard["params"]), "grads": int(trained * 4 / shard["grads"]),
                 "optimizer": int(trained * 8 / shard["optimizer"]), "state": int(device), "host": int(host),
                 "activations": int(held), "gathered": gathered,
                 "hpz": int(hpz_bytes(n, lay.hpz_node, lay.param_comm, lay.quant_block)) if lay.hpz_node else 0}
        parts["total"] = parts["state"] + parts["activations"] + parts["gathered"] + parts["hpz"]
        out.append(parts)
    return out
