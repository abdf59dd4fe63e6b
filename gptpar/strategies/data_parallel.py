"""The data-parallel strategies (`parallel.dp_sync`) as one table: for each, the class that runs it, what it
shards over the replicas, what it composes with, its memory closed form and how the planner prices its
communication. The config's choices and checks (gptpar/config/parallel_checks.py), the trainer's choice of sync, the
report's memory check and the planner all read this table; a new strategy is one module under
gptpar/parallel/data_parallel/ (a GradSync with `from_setup`) plus one row here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from gptpar.errors import ConfigError, GptparError

# Bytes per parameter of fp32 AdamW training state (weight, gradient, two moments), in the parts a strategy
# may shard over its W replicas; every rank holds the parts it does not shard whole.
STATE_BYTES = {"params": 4, "grads": 4, "optimizer": 8}
# parallel.grad_comm: how gradients cross the wire. The half types all-reduce in bf16 or fp16; int8 is our reducers'
# blockwise quantisation (an all-to-all and an all-gather), powersgd torch's low-rank hook for DDP.
HALF = ("fp32", "bf16", "fp16")
GRAD_COMMS = (*HALF, "int8", "powersgd")
# parallel.param_comm: how a sync that shards the parameters gathers them. bf16 casts each shard for the wire; int8 is
# ZeRO++'s qwZ, each shard in blocks of parallel.quant_block values with one fp32 scale each (param_comm.py).
PARAM_COMMS = ("fp32", "bf16", "int8")
# parallel.offload: what a strategy keeps on the host instead of the device, and the parts of STATE_BYTES each moves.
OFFLOADS = ("none", "optimizer", "params")
MOVED = {"none": (), "optimizer": ("optimizer",), "params": tuple(STATE_BYTES)}
# parallel.zero_stage: the parts of STATE_BYTES each ZeRO stage shards (a row with `stages` reads its `sharded` here).
ZERO_STAGES = {1: ("optimizer",), 2: ("grads", "optimizer"), 3: ("params", "grads", "optimizer")}
# Bytes per value on the wire, by parallel.grad_comm or parallel.param_comm type (the syncs count them, the planner
# prices them); int8 adds a 4-byte scale per parallel.quant_block values.
WIRE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}


# How the planner models a strategy's sync over one step without the multi-process pipeline (gptpar/plan/predict.py
# prices each shape; under the pipeline every sync reduces after the schedule, all of it exposed):
SYNC_SHAPES = {
    "tensors": "every parameter tensor all-reduced alone after backward: all of it exposed",
    "buckets": "flat buckets of parallel.bucket_mb (last parameter first), each reduced as the last micro-step's "
               "backward fills it, one after another: what runs past backward's end is exposed; sharded gradients are "
               "reduce-scattered so in every micro-step, and sharded state all-gathers the updated parameters after "
               "the step (exposed)",
    "units": "the root unit gathered, then each block while the one before it computes (one unit of prefetch), in "
             "forward and again in backward, each block's gradients reduce-scattered after its backward; one "
             "collective at a time on the group",
}


@dataclass(frozen=True)
class Pricing:
    """What the planner needs of a strategy beyond its state: the shape of its communication, and what it holds or
    computes differently from that shape."""

    shape: str  # a key of SYNC_SHAPES
    label: str = ""  # the entry its exposed seconds go under; "" for the collectives' own names
    in_flight: tuple[int, int] = (0, 0)  # (root, block) units it holds unsharded at once, 4 bytes a parameter each,
    # over W > 1 replicas with one micro-step a step (parameters, gradients, and buffers of a unit's size)
    # (over a group of one: parallel.offload at dp=1, under train.grad_accum > 1) -> the (root, block) units held at
    # each moment that may be the peak, where they differ from `in_flight`; under accumulation beside every unit's
    # whole unsharded gradient, which stays on the device from one micro-step to the next (`gathered_bytes`)
    in_flight_cases: dict[tuple[bool, bool], tuple[tuple[int, int], ...]] = field(default_factory=dict)
    grouped_norm: bool = True  # its gradient shards' norm is summed per tensor over dp (clip_gradients' groups);
    # False: torch's own norm over DTensor shards
    note: str = ""  # what its price approximates, said beside the prediction
    # parallel.offload -> (per step, per micro-step): copies between host and device of the rank's optimizer shard (4
    # bytes a value) that offload makes (zero1/zero2 optimizer: the gradient shard down and the updated shard up once
    # a step; fsdp2 params: the gradient shard down once, the parameter shard up for forward's and backward's gathers)
    host_copies: dict[str, tuple[float, float]] = field(default_factory=dict)

    def in_flight_units(self, alone: bool, accumulating: bool) -> tuple[tuple[int, int], ...]:
        """The (root, block) units held at each moment that may be the peak: over a group of one (`alone`), under
        train.grad_accum > 1 (`accumulating`; beside every unit's whole gradient where `in_flight_cases` says so)."""
        return self.in_flight_cases.get((alone, accumulating), (self.in_flight,))

    def gathered_bytes(self, root: float, block: float, whole: float, alone: bool, accumulating: bool) -> float:
        """Bytes a rank holds unsharded at the step's peak, beside its state: the most of `in_flight_units`' moments
        at 4 bytes a parameter of the `root` unit and of a `block`, and under accumulation a case of `in_flight_cases`
        adds the `whole` rank's unsharded gradient (`keeps_whole_gradient`)."""
        units = max(4 * (roots * root + blocks * block) for roots, blocks in self.in_flight_units(alone, accumulating))
        return units + (4 * whole if self.keeps_whole_gradient(alone, accumulating) else 0)

    def keeps_whole_gradient(self, alone: bool, accumulating: bool) -> bool:
        """Under train.grad_accum > 1 every unit's unsharded gradient stays from one micro-step to the next: where
        `in_flight_cases` prices accumulation."""
        return accumulating and (alone, accumulating) in self.in_flight_cases

    def __post_init__(self) -> None:
        if self.shape not in SYNC_SHAPES:
            raise GptparError(f"Pricing.shape={self.shape!r} is no sync shape the planner knows; use one of "
                              f"{', '.join(SYNC_SHAPES)}")


@dataclass(frozen=True)
class DataParallelStrategy:
    """One row: `sync` is "module:Class" of its GradSync, imported only when a rank builds it (this table
    stays torch-free); `pricing` is how the planner prices it (None: the planner refuses it)."""

    sync: str
    help: str
    sharded: tuple[str, ...] = ()  # parts of STATE_BYTES split over the replicas
    without_pipeline: str = ""  # why it cannot sync a stage of the multi-process pipeline; "" if it can
    tensor_parallel: tuple[str, ...] = ("gptpar",)  # parallel.tp_impl values it composes with at dp > 1
    materialises_shards: bool = False  # with model.init_device=meta it builds only its shards itself
    without_whole_compile: str = ""  # why train.compile=model cannot capture its model in one graph; "" if it can
    grad_comm: tuple[str, ...] = ("fp32",)  # the parallel.grad_comm types it sends gradients in
    expert_parallel: bool = False  # syncs the dense parameters only, beside parallel.ep's expert shards
    param_comm: tuple[str, ...] = ("fp32",)  # the parallel.param_comm types it gathers parameters in
    hpz: bool = False  # keeps parallel.hpz's secondary copy of the parameter shards within each node
    offloads: tuple[str, ...] = ()  # the parallel.offload values (besides none) it can run with
    without_lora: str = ""  # why it cannot train a model with frozen weights (train.lora_rank > 0); "" if it can
    stages: bool = False  # shards by parallel.zero_stage (ZERO_STAGES; `sharded` is then stage 3's, see at_stage)
    alone: bool = False  # runs at parallel.dp=1 too, over a group of one (DeepSpeed: its offload on one device)
    master: bool = False  # its optimizer steps an fp32 master copy of its parameter partition, 4N/W more (DeepSpeed
    # keeps one even in fp32)
    pricing: Pricing | None = None

    def at_stage(self, zero_stage: int) -> DataParallelStrategy:
        """The row as it runs at parallel.zero_stage: a row with `stages` shards that stage's parts; others are one
        stage each and ignore it."""
        return replace(self, sharded=ZERO_STAGES[zero_stage]) if self.stages else self

    @property
    def whole_gradients(self) -> bool:
        """Every rank holds the whole averaged gradient after the sync (what train.dump_grads saves)."""
        return "grads" not in self.sharded

    def state_bytes(self, n: float, w: int, offload: str = "none", trainable: float | None = None) -> float:
        """Bytes of training state one rank holds for n parameters over w replicas, unpadded, device and host
        together: the closed form a measured count is checked against. Of `trainable` of them (train.lora_rank > 0:
        the adapters; None: all) only: gradients and optimizer state; frozen weights are weights only."""
        return math.fsum(self.placed_bytes(n, w, offload, trainable))

    def placed_bytes(self, n: float, w: int, offload: str = "none", trainable: float | None = None
                     ) -> tuple[float, float]:
        """`state_bytes` as (device, host) under parallel.offload: optimizer moves the optimizer state (8 bytes a value
        of the shard it steps) and puts fp32 copies of that shard's parameters and gradients beside it on the host
        (the step's inputs), leaving the device its parameters and gradients; params moves every part. A `master` row's
        fp32 copy of its partition is on the device, or on the host with every part under params (under optimizer it
        is the host's shard copy already counted)."""
        stepped = n if trainable is None else trainable
        counts = {"params": n, "grads": stepped, "optimizer": stepped}
        parts = {part: counts[part] * size / (w if part in self.sharded else 1) for part, size in STATE_BYTES.items()}
        moved = MOVED[offload]
        device = math.fsum(v for part, v in parts.items() if part not in moved)
        host = math.fsum(v for part, v in parts.items() if part in moved)
        if offload == "optimizer":  # the step's inputs beside its state: fp32 copies of the shard and its gradient
            host += (STATE_BYTES["params"] + STATE_BYTES["grads"]) * stepped / (w if "optimizer" in self.sharded else 1)
        elif self.master:
            master = STATE_BYTES["params"] * stepped / w
            device, host = (device, host + master) if offload == "params" else (device + master, host)
        return device, host

    def group_of_one(self, offload: str) -> bool:
        """At parallel.dp=1 its sync is built over the world of one that process_group.init_distributed joins for it
        (needs_group): parallel.offload lives in the sync (a student's one device, whose optimizer or parameters the
        host holds). A row that runs `alone` (DeepSpeed) is built there anyway and makes its own group."""
        return offload != "none" and not self.alone

    def syncs(self, replicas: int, offload: str) -> bool:
        """Its sync runs: over replicas > 1, or at one over a group of one (`group_of_one`)."""
        return replicas > 1 or self.group_of_one(offload)

    def host_copy_bytes(self, n: float, w: int, offload: str, micro_steps: int, trainable: float | None = None
                        ) -> float:
        """Bytes copied between host and device in one step of `micro_steps` under parallel.offload, by its pricing's
        `host_copies` of the rank's optimizer shard (fp32); 0 without offload. The per-step copies are the optimizer
        step's (gradients down, updated values up): of the `trainable` parameters only (None: all); the per-micro-step
        ones are forward's and backward's parameters, frozen ones too."""
        per_step, per_micro = self.pricing.host_copies.get(offload, (0.0, 0.0)) if self.pricing else (0.0, 0.0)
        share = 4 / (w if "optimizer" in self.sharded else 1)
        return share * ((n if trainable is None else trainable) * per_step + n * per_micro * micro_steps)


def hpz_bytes(n: float, node_size: int, param_comm: str = "fp32", quant_block: int = 256) -> float:
    """Bytes of parallel.hpz's secondary partition one rank holds for n parameters, unpadded, beside `state_bytes`:
    its node's 1/node_size share of the gathered parameters, kept as they came over the wire (parallel.param_comm's
    type; int8 with one fp32 scale per quant_block values), so that the node can gather them again without the other
    nodes."""
    return n * wire_value_bytes(param_comm, quant_block) / node_size


def wire_value_bytes(mode: str, quant_block: int = 256) -> float:
    """Bytes one value takes on the wire in `mode` (grad_comm's or param_comm's), int8's share of its block's fp32
    scale included."""
    return WIRE_BYTES[mode] + (4 / quant_block if mode == "int8" else 0)


_NOT_SHARDED_YET = "does not shard pipeline stages yet"
_PIPELINE_DDP = "cannot sync a pipeline stage (DDP reduces inside every backward, the engine runs many per step)"
_WHOLE_COMPILE_FSDP = ("gathers and frees each block's parameters in hooks around the block, which one whole-model "
                       "graph cannot hold")
_BUCKETS = Pricing("buckets")
_BUCKETS_OFFLOADED = Pricing("buckets", host_copies={"optimizer": (2.0, 0.0)})
_UNITS = "fsdp gathers and reduce-scatters"
# What torch's fully_shard holds unsharded at once (tests/unsharded_units.py measures it on real steps; read
# torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py for why). The root is not resharded after forward, and its
# gradients (the tied matrix's two uses summed by autograd) live from the head's backward to the root's reduce-scatter:
# 2 root units. In backward, block i holds its parameters and gradients, the all-gather output of block i-1 (the
# implicit backward prefetch, issued in block i's pre-backward and copied out in block i-1's) and block i+1's
# reduce-scatter input (reduce_scatter_states keeps one until the next unit's reduce): 4 block units over W > 1. A
# group of one gathers nothing (each parameter copied straight into its unsharded storage): 2 + 3. Under accumulation
# (set_requires_gradient_sync(False)) each unit's unsharded gradient stays after its backward to the last micro-step's
# reduce-scatter, every unit's whole gradient (4 bytes a parameter) beside: in a later micro-step's forward the root's
# parameters, its all-gather output (kept to overlap the next copy-out) and block 0's gathered output (2 root + 1 block
# units), or in the last micro-step's backward the root's parameters, block i's, block i-1's prefetch and block i+1's
# reduce-scatter input, its gradient freed (1 + 2); over a group of one the root's and a block's parameters (1 + 1).
# All at 4 bytes a value: under parallel.grad_comm=bf16 the reduce-scatter inputs and accumulated gradients are bf16
# (an upper bound there).
_FSDP2_IN_FLIGHT = {(True, False): ((2, 3),), (False, True): ((2, 1), (1, 2)), (True, True): ((1, 1),)}

DP_STRATEGIES: dict[str, DataParallelStrategy] = {
    "naive": DataParallelStrategy(
        "gptpar.parallel.data_parallel.naive:NaiveSync", "all-reduce per parameter", grad_comm=(*HALF, "int8"),
        expert_parallel=True, pricing=Pricing("tensors")),
    "bucketed": DataParallelStrategy(
        "gptpar.parallel.data_parallel.bucketed:BucketedSync", "overlapped flat buckets", grad_comm=(*HALF, "int8"),
        expert_parallel=True, pricing=_BUCKETS),
    "ddp": DataParallelStrategy(
        "gptpar.parallel.data_parallel.ddp:DDPSync", "torch DDP", without_pipeline=_PIPELINE_DDP,
        grad_comm=(*HALF, "powersgd"), expert_parallel=True, pricing=_BUCKETS),
    "zero1": DataParallelStrategy(
        "gptpar.parallel.data_parallel.zero:ZeroOneSync", "bucketed, optimizer state sharded", ("optimizer",),
        _NOT_SHARDED_YET, grad_comm=HALF, expert_parallel=True, offloads=("optimizer",), pricing=_BUCKETS_OFFLOADED),
    "zero2": DataParallelStrategy(
        "gptpar.parallel.data_parallel.zero:ZeroTwoSync", "gradients sharded too", ("grads", "optimizer"),
        _NOT_SHARDED_YET, grad_comm=(*HALF, "int8"), expert_parallel=True, offloads=("optimizer",),
        pricing=_BUCKETS_OFFLOADED),
    "fsdp": DataParallelStrategy(
        "gptpar.parallel.data_parallel.fsdp:FSDPSync", "ours, ZeRO-3: parameters sharded too, gathered per block",
        ("params", "grads", "optimizer"), _NOT_SHARDED_YET, materialises_shards=True, grad_comm=(*HALF, "int8"),
        param_comm=PARAM_COMMS, hpz=True, without_whole_compile=_WHOLE_COMPILE_FSDP,
        without_lora="its units shard trainable parameters only, and a unit of frozen weights alone has none",
        pricing=Pricing("units", _UNITS, in_flight=(2, 4))),  # 2 root and 4 block units in flight (fsdp.py)
    "fsdp2": DataParallelStrategy(
        "gptpar.parallel.data_parallel.fsdp2:FSDP2Sync", "torch's fully_shard, the same units",
        ("params", "grads", "optimizer"), _NOT_SHARDED_YET, tensor_parallel=("torch",), grad_comm=HALF,
        expert_parallel=True, offloads=("params",),
        pricing=Pricing("units", _UNITS, grouped_norm=False, host_copies={"params": (1.0, 2.0)}, in_flight=(2, 4),
                        in_flight_cases=_FSDP2_IN_FLIGHT,
                        note="fsdp2's collectives are priced as our fsdp's (the same units, one unit of prefetch); "
                             "its memory holds what torch's fully_shard holds unsharded at once")),
    # DeepSpeed's engine as a third reference (the `deepspeed` extra); ZeRO++'s qwZ/qgZ/hpZ through its own config,
    # on GPUs only (its CPU backend lacks them). Not priced: its bucketing and prefetch are its own.
    "deepspeed": DataParallelStrategy(
        "gptpar.parallel.data_parallel.deepspeed:DeepSpeedSync", "DeepSpeed's engine at parallel.zero_stage",
        ZERO_STAGES[3], "drives its own engine, which syncs whole models only", tensor_parallel=(),
        without_whole_compile="runs its own engine around the model", grad_comm=("fp32", "int8"),
        param_comm=("fp32", "int8"), hpz=True, offloads=("optimizer", "params"), stages=True,
        alone=True, master=True,
        without_lora="builds its engine's optimizer over every parameter it is handed; frozen weights under it are not "
                     "tested yet"),
}


def closed_form_state_bytes(strategy: str, n: float, w: int, offload: str = "none", trainable: float | None = None,
                            zero_stage: int = 3) -> float | None:
    """`DataParallelStrategy.state_bytes` of a named strategy (at parallel.zero_stage); None for a name the table
    lacks (an old log)."""
    row = DP_STRATEGIES.get(strategy)
    return row.at_stage(zero_stage).state_bytes(n, w, offload, trainable) if row is not None else None


def either(names: list[str], conjunction: str = "or") -> str:
    """`a, b or c`: the allowed values an error message offers (`a, b and c` with conjunction="and")."""
    return ", ".join(names[:-1]) + f" {conjunction} {names[-1]}" if len(names) > 1 else names[0]


def strategies_where(has: Callable[[DataParallelStrategy], bool]) -> list[str]:
    """The names of the rows that `has` holds for, in the table's order: what help text lists, read from the rows."""
    return [name for name, row in DP_STRATEGIES.items() if has(row)]


def hpz_node_size(node_size: int, dp: int, tp: int, ranks_per_node: int) -> int:
    """The data-parallel ranks of one parallel.hpz group: parallel.hpz_node_size (`node_size`), or where it is 0 those
    on one node, the launcher's ranks per node (LOCAL_WORLD_SIZE, SLURM's tasks per node) over parallel.tp (the grid
    puts tp fastest, so a node holds ranks_per_node / tp consecutive dp coordinates), at most parallel.dp."""
    size = node_size or min(dp, max(1, ranks_per_node // tp))
    if dp % size:
        source = (f"parallel.hpz_node_size={size}" if node_size else
                  f"parallel.hpz_node_size=0 takes {size} data-parallel ranks per node (the launcher's "
                  f"{ranks_per_node} ranks per node over parallel.tp={tp}), which")
        raise ConfigError(f"{source} does not divide parallel.dp={dp}; set parallel.hpz_node_size to a divisor of "
                          "it (the data-parallel ranks on one node)")
    return size
