"""The log's record kinds as typed definitions: the one place the writer (the trainer), the reader
(gptpar.run.logfile) and the analysis learn which fields a record has, what each means, and which a
reader may rely on. Torch-free, so the login side and the analysis import it.

A field is required (every log of schema 1 or 2 has it; a reader may index it) or optional (added
later, or written only by some runs: absent from a record is not the same as null, e.g. `bleu` is
absent outside translation and null with train.bleu_samples=0). Field order is the order of the
JSON keys. docs/log_schema.md's table is generated from these classes (`make log-reference`).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from time import time as now
from typing import Any, ClassVar

from gptpar.markdown import between_markers

FINAL_STATUSES = ("completed", "failed", "requeued", "stopped")  # stopped: SIGTERM/SIGINT, resumable


class Absent(enum.Enum):
    """The value of an optional field a record does not have (its key is left out of the JSON)."""

    ABSENT = "absent"


ABSENT = Absent.ABSENT


def _meta(help: str, may_diverge: bool = False, choices: tuple[str, ...] | None = None) -> dict[str, Any]:
    return {"help": help, "may_diverge": may_diverge, "choices": choices}


def required(help: str, *, may_diverge: bool = False, choices: tuple[str, ...] | None = None) -> Any:
    """A field every record of its kind has. may_diverge: the number may be non-finite (written as a string)."""
    return dataclasses.field(metadata=_meta(help, may_diverge, choices))


def optional(help: str, *, may_diverge: bool = False) -> Any:
    """A field some records of its kind lack (older logs, or runs that do not produce it)."""
    return dataclasses.field(default=ABSENT, metadata=_meta(help, may_diverge))


@dataclass(frozen=True, kw_only=True)
class Record:
    """What every record has: its kind (the class's KIND, written first) and the time it was written."""

    KIND: ClassVar[str]
    time: float = dataclasses.field(default_factory=now, metadata=_meta("Unix seconds when the record was written."))

    def fields(self) -> dict[str, Any]:
        """The record as the log writes it: `kind` first, then the fields in order, absent ones left out."""
        values = ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))
        return {"kind": self.KIND, **{name: value for name, value in values if value is not ABSENT}}


@dataclass(frozen=True, kw_only=True)
class HeaderRecord(Record):
    KIND = "header"
    schema_version: int = required("1 (first release) or 2.")
    run_id: str = required("The run's name, its folder under log.runs_dir.")
    config: dict[str, Any] = required("The config the rank ran, with the launcher's world size.")
    config_digest: str | Absent = optional("Digest of `config`, to group runs of one config.")
    rank: int = required("This rank's number.")
    world_size: int = required("Ranks in the job.")
    coords: dict[str, int] = required("This rank's place in the grid: `pp`, `dp`, `cp`, `tp` (0 when unused), and `ep` "
                                      "(its dp coordinate mod parallel.ep; absent from older logs).")
    sizes: dict[str, int] = required("The grid's size per dimension: `pp`, `dp`, `cp`, `tp` (1 when unused), and `ep` "
                                     "(inside dp, not a factor of the world size; absent from older logs).")
    restart: int = required("Segments this rank's log held before this one (0 on the first start).")
    host: str = required("The host name.")
    device: str = required("The rank's torch device.")
    device_name: str | Absent = optional("The GPU's name (`cpu` on CPU), for the MFU peak.")
    torch_version: str = required("torch.__version__.")
    transformers_version: str = required("transformers.__version__.")
    git_commit: str = required("The checkout's commit (a code snapshot's: the one it was taken at), or `unknown`.")
    slurm: dict[str, str] = required("SLURM job id, array ids, node list, node, restart count ({} outside SLURM).")
    start_time: float = required("Unix seconds when this segment started.")
    launcher: str | Absent = optional("Who started the rank: `slurm`, `submitit`, `torchrun`, `local`, `single`.")
    precision: str | Absent = optional("train.precision as the rank ran it (`auto` resolved for its device).")
    activation_checkpointing: str | Absent = optional("train.activation_checkpointing.")
    tokenizer: str | Absent = optional("The tokenizer's name (absent when set-up failed before it).")
    vocab_size: int | Absent = optional("The tokenizer's vocabulary size (absent when set-up failed).")
    stage_devices: list[str] | Absent = optional("The devices this rank drives (absent when set-up failed).")
    total_steps: int | Absent = optional("The steps this run trains in all (absent when set-up failed).")
    fast_path: dict[str, Any] | Absent = optional(
        "What the step's fast path resolved to on this rank: `optimizer` (fused, foreach or for-loop), `vocab_rows` "
        "(the token table's rows, padded by model.pad_vocab and parallel.tp), `sync_every` (log.sync_every for the "
        "device), `compile` (false, blocks or model), `loss` (compiled, chunked, plain or vocabulary-parallel) (absent "
        "when set-up failed).")
    lora: dict[str, Any] | Absent = optional(
        "train.lora_rank > 0: the adapters' `rank`, `alpha` and `targets`, the `trainable` parameters (the adapters) "
        "of all `params`, and `state_bytes`, the closed form of this rank's training state (4 bytes per frozen "
        "weight, 16 per trainable one, split as parallel.dp_sync shards them) that the memory record is held to "
        "(absent without LoRA).")
    code_snapshot: dict[str, Any] | Absent = optional(
        "The code snapshot the rank ran from (launch.launcher=submitit): its `path`, the `commit` it was taken at "
        "and whether the tree was `dirty` (absent when the rank ran a checkout or an installed package).")


@dataclass(frozen=True, kw_only=True)
class StepRecord(Record):
    KIND = "step"
    step: int = required("The optimizer step just taken, from 1.")
    epoch: int = required("The epoch it belongs to, from 0.")
    loss: float | None = required("This replica's loss; null on pipeline stages that do not compute it.",
                                  may_diverge=True)
    global_loss: float | None | Absent = optional("The mean loss over replicas.", may_diverge=True)
    lr: float = required("The learning rate of the step.")
    grad_norm: float = required("The gradient norm before clipping (`Infinity` on a skipped step).",
                                may_diverge=True)
    skipped: bool | Absent = optional("An fp16 overflow skipped the optimizer step.")
    loss_scale: float | None | Absent = optional("fp16's loss scale, else null.")
    tokens: int = required("Tokens of this rank's replica in the step (translation's padding included): every "
                           "pipeline stage, tensor- and context-parallel rank of a replica logs the same count, the "
                           "rows it shares (under parallel.cp each rank runs a 1/cp shard of every row), so a job's "
                           "tokens are summed over one rank per replica, each token once.")
    step_time_s: float = required("Seconds of the step, data loading included.")
    tokens_per_s: float = required("This rank's tokens / step_time_s: its replica's rate (summed over one rank per "
                                   "replica for the job's).")
    compute_s: float | Absent = optional(
        "This rank's own compute in the step: step_time_s less the spans it was blocked in gptpar's communication "
        "(a blocking collective or point-to-point call, or the wait for an asynchronous one; on a GPU CUDA events on "
        "its compute stream, which such a call stalls until done). A rank that waits for a slow peer waits there, so "
        "this sets the slow rank apart; under a pipeline it is the stage's compute (its waits for neighbours are "
        "left out). Collectives issued inside torch (parallel.dp_sync=ddp, fsdp2, deepspeed) are not gptpar's, and "
        "waiting in them counts as compute.")
    rank_compute_s: list[float] | Absent = optional(
        "Rank 0's record: every rank's `compute_s` of the step, by rank (one small gather at each fetch of records, "
        "log.sync_every), which `gptpar report` and `gptpar status` flag a straggler from (report.straggler_ratio).")
    data_time_s: float = required("Seconds spent fetching the step's batches.")
    peak_mem_bytes: int = required("Peak device memory (CUDA's allocator; the process's peak RSS on CPU).")
    bubble: float | None | Absent = optional("Pipeline modes: the measured idle share; else null.")
    aux_loss: float | Absent = optional(
        "A mixture of experts: the router's load-balancing loss (top-k when balanced), the mean over the step's "
        "micro-steps, each over every replica's tokens; `loss` includes model.moe_aux_loss_coef times it.")
    moe: dict[str, Any] | Absent = optional(
        "A mixture of experts: `tokens_per_expert` (`min`, `max`, `mean` over experts and layers of the tokens routed "
        "to each in the step, on every replica; top-k picks each) and `dropped` (the picks past an expert's capacity, "
        "model.moe_capacity_factor, over every block and replica; 0 without a capacity).")
    comm_bytes: dict[str, int] | Absent = optional(
        "Bytes this rank sent to other ranks in the step, by collective, counted from what was sent: `all_to_all` "
        "(parallel.ep's tokens to their experts and back, forward and backward, and the counts before them; "
        "parallel.grad_comm=int8's reduce-scatter), `all_reduce`, `reduce_scatter` and `all_gather` (the gradients "
        "and parameters of parallel.dp_sync naive, bucketed, ddp, zero1, zero2 and fsdp, and the experts' replicas, "
        "in ring terms: an all-reduce of n bytes over g ranks 2n(g-1)/g, an all-gather n(g-1)/g of its output, a "
        "reduce-scatter n(g-1)/g of its input; fsdp2's, inside torch, are not counted; fsdp's parameters in "
        "parallel.param_comm's type), and `all_gather_intra` (parallel.hpz: fsdp's gathers within a node group, over "
        "its size; `all_gather` then holds only the gathers over the whole data-parallel group, those that cross "
        "nodes).")
    comm_s: dict[str, float] | Absent = optional(
        "Seconds of the step inside this rank's timed collectives, by kind: so far `all_to_all` (parallel.ep's; CUDA "
        "events around each on a GPU, the host's clock on a CPU, where a call returns once done): waiting for a slower "
        "peer counts.")
    pp_busy_s: dict[str, float] | Absent = optional("parallel.pp > 1: seconds busy per action kind (`F`, `B`, `W`).")
    pp_window_s: float | Absent = optional("parallel.pp > 1: seconds of the schedule's window.")
    pp_peak_activation_bytes: int | Absent = optional(
        "parallel.pp > 1: bytes autograd saved for backward that the rank held at once.")
    pp_timeline: list[list[Any]] | Absent = optional(
        "parallel.pp > 1: `[kind, micro-batch, stage, start_s, end_s]` per compute action, from the step's start.")


@dataclass(frozen=True, kw_only=True)
class EvalRecord(Record):
    KIND = "eval"
    step: int = required("The step evaluated after (every train.eval_every).")
    epoch: int = required("Its epoch.")
    val_loss: float | None = required("The validation loss (null where this rank does not compute it).",
                                      may_diverge=True)
    accuracy: float | None | Absent = optional(
        "data.task=classify: the share (0-1) of the evaluated validation images (train.eval_batches batches of every "
        "replica's shard) whose top logit is their label, summed over the replicas (the same on every rank); null "
        "where no batch was evaluated.", may_diverge=True)
    accuracy_top5: float | None | Absent = optional(
        "data.task=classify with 100 classes or more: the same share for the label among the five top logits.",
        may_diverge=True)


@dataclass(frozen=True, kw_only=True)
class MemoryRecord(Record):
    KIND = "memory"
    step: int = required("Once per start, after its first optimizer step: that step.")
    params: int = required("This rank's parameter count.")
    trainable: int | Absent = optional("train.lora_rank > 0: of them, those that train (the adapters), the only ones "
                                       "with gradients and optimizer state (absent: all train).")
    params_bytes: int = required("Bytes of the distinct storages of its parameters (a tied matrix counted once).")
    grads_bytes: int = required("Bytes of its gradients (a gradient bucket counted once).")
    optimizer_bytes: int = required("Bytes of its optimizer state (AdamW's scalar `step` counters left out).")
    host_bytes: int | Absent = optional(
        "parallel.offload: bytes of training state on the host (its parameters, gradients and optimizer state there); "
        "the three fields above count the device's. On a CPU-only machine the same memory, counted by what moved.")
    gathered_peak_bytes: int | Absent = optional(
        "parallel.dp_sync=fsdp: peak bytes of unsharded parameters and gradients held at once.")
    attention_bytes: int | Absent = optional(
        "parallel.cp > 1 (without recompute, a pipeline or compile): bytes this rank's attention kept for backward in "
        "the run's first micro-batch, every layer: q, k, v, the output and a log-sum-exp per query on seq / cp "
        "positions, the closed form "
        "gptpar.strategies.context_parallel.attention_bytes.")
    hpz_bytes: int | Absent = optional(
        "parallel.hpz: bytes of fsdp's secondary copy of the parameters (this rank's share of its node's), held "
        "beside the state counted above.")
    hpz_node_size: int | Absent = optional(
        "parallel.hpz: the ranks of this rank's node group, L (parallel.hpz_node_size as resolved), which the report's "
        "closed form of `hpz_bytes` divides by.")
    host_bytes: int | Absent = optional(
        "parallel.offload: bytes of the training state counted above that the strategy keeps on the host (on a "
        "CPU-only machine host and device are one memory, and this says what moved).")


# The keys inside a step record's `moe` (a mixture of experts' load), which the report reads.
MOE_LOAD_KEYS = ("tokens_per_expert", "min", "max", "mean", "dropped")

# The task's scores an epoch record may carry, in the order lines show them.
EPOCH_SCORES = ("bleu", "test_bleu", "answer_accuracy")
# The validation pass's own scores (data.task=classify) that eval and epoch records may carry.
EVAL_SCORES = ("accuracy", "accuracy_top5")
# Every score a line about a run shows (its epoch's, `gptpar logs`', the one `gptpar train` ends with), in that order.
LINE_SCORES = (*EVAL_SCORES, *EPOCH_SCORES)


@dataclass(frozen=True, kw_only=True)
class EpochRecord(Record):
    KIND = "epoch"
    epoch: int = required("The epoch ended, from 0.")
    training_time_s: float = required("Seconds of its steps.")
    tokens_per_s: float = required("Mean over the epoch's steps.")
    val_loss: float | None = required("The validation loss at its end.", may_diverge=True)
    steps: int = required("Steps it ran in this segment.")
    bleu: float | None | Absent = optional(
        "data.task=translation: corpus BLEU 0-100 of train.bleu_samples validation pairs, the same on every "
        "replica; null with train.bleu_samples=0.")
    test_bleu: float | None | Absent = optional(
        "Where the source has a test split and train.bleu_samples > 0: the same of the first test pairs.")
    accuracy: float | None | Absent = optional(
        "data.task=classify: top-1 validation accuracy (0-1) at the epoch's end, as the eval record's.",
        may_diverge=True)
    accuracy_top5: float | None | Absent = optional(
        "data.task=classify with 100 classes or more: top-5 validation accuracy at the epoch's end.", may_diverge=True)
    answer_accuracy: float | None | Absent = optional(
        "data.task=sft: the share (0-1) of train.answer_samples validation prompts whose greedy response states the "
        "reference's final answer (`The answer is: X`), the same on every replica; null with train.answer_samples=0.")


@dataclass(frozen=True, kw_only=True)
class FinalRecord(Record):
    KIND = "final"
    status: str = required("How the segment ended.", choices=FINAL_STATUSES)
    step: int = required("The last step taken.")
    loss: float | None | Absent = optional("The last step's loss (absent when the run failed).", may_diverge=True)
    error: str | Absent = optional("A failed run's error, one line.")
    signal: str | None | Absent = optional("The signal that stopped the run, else null (absent when it failed).")
    hang: dict[str, Any] | Absent = optional(
        "A rank that failed inside a collective (a peer's timeout, parallel.timeout_s), once every rank dumped its "
        "flight recorder and stack (job/rank<R>.flight.json, job/rank<R>.stack): `collective`, its `group` "
        "(dp, tp, pp, ep, world), `bytes`, `step`, `micro_step` and `seq` (its number in the group), the `waiting` "
        "ranks and `waited_s`, the `stuck` ranks of the group that never entered it or were stopped (SIGSTOP) in it "
        "(`rank`, `host`, `pid`, `where`: file:line of gptpar's innermost frame, `function`, whether it `entered` it, "
        "its `state` there, whether it was `stopped`; null ones: no dump came), and `summary`, the sentence "
        "`gptpar status` shows (gptpar.run.hang). Where the call is a pipeline's send or recv: its `peer` (the other "
        "end's global rank), `micro_batch`, and `seq` counts that op with that peer. Where the ranks issued different "
        "collectives: `mismatch` true, `calls` (each rank's call under the number: op, group, bytes, step, "
        "micro_step, seq; a rank that left no dump read from its job/rank<R>.ledger) and `ahead`, the rank ahead "
        "(null: cannot tell).")


RECORDS: dict[str, type[Record]] = {c.KIND: c for c in (HeaderRecord, StepRecord, EvalRecord, MemoryRecord,
                                                      EpochRecord, FinalRecord)}


def is_required(spec: dataclasses.Field) -> bool:
    return spec.default is not ABSENT


# Per kind, computed once for the reader: its fields, those it may rely on, and those whose values are a closed set.
DECLARED = {kind: frozenset(f.name for f in dataclasses.fields(cls)) for kind, cls in RECORDS.items()}
REQUIRED = {kind: tuple(f.name for f in dataclasses.fields(cls) if is_required(f)) for kind, cls in RECORDS.items()}
_CHOICES = {kind: tuple((f.name, f.metadata["choices"]) for f in dataclasses.fields(cls) if f.metadata["choices"])
            for kind, cls in RECORDS.items()}


def names(cls: type[Record], *wanted: str) -> tuple[str, ...]:
    """`wanted`, checked to be fields of `cls`: a reader's key list that cannot name an undeclared field."""
    unknown = [name for name in wanted if name not in DECLARED[cls.KIND]]
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {', '.join(unknown)}")
    return wanted


def validate_record(record: dict[str, Any]) -> type[Record]:
    """The record's class; a ValueError naming its unknown kind, first missing fields or a value not allowed,
    so a bad log is reported precisely."""
    kind = record.get("kind")
    if kind not in RECORDS:
        raise ValueError(f"unknown record kind {kind!r}; allowed: {', '.join(RECORDS)}")
    missing = [name for name in REQUIRED[kind] if name not in record]
    if missing:
        raise ValueError(f"{kind} record lacks field(s): {', '.join(missing)}")
    for name, allowed in _CHOICES[kind]:
        if record[name] not in allowed:
            raise ValueError(f"{kind} {name} {record[name]!r}; allowed: {', '.join(allowed)}")
    return RECORDS[kind]


def parse(record: dict[str, Any], strict: bool = False) -> Record:
    """A decoded log line as its record class. Keys the class does not declare are ignored (a newer
    log), or a ValueError when `strict`."""
    cls = validate_record(record)
    declared = DECLARED[cls.KIND]
    unknown = [key for key in record if key not in declared and key != "kind"]
    if strict and unknown:
        raise ValueError(f"{cls.KIND} record has undeclared field(s): {', '.join(unknown)}")
    return cls(**{key: value for key, value in record.items() if key in declared})


def _type(spec: dataclasses.Field) -> str:
    """The annotation as docs/log_schema.md shows it: Absent is the required column's, `|` escaped for the table."""
    return str(spec.type).replace(" | Absent", "").replace("|", "\\|")


def reference_markdown() -> str:
    """The log schema table, generated so that it cannot go stale."""
    lines = ["| record | field | type | required | meaning |", "| --- | --- | --- | --- | --- |"]
    common = {f.name for f in dataclasses.fields(Record)}  # `time`: in the prose, with `kind`
    for kind, cls in RECORDS.items():
        for f in (f for f in dataclasses.fields(cls) if f.name not in common):
            choices = f" One of: {', '.join(f'`{c}`' for c in f.metadata['choices'])}." if f.metadata["choices"] else ""
            diverge = " May be `NaN`, `Infinity` or `-Infinity`." if f.metadata["may_diverge"] else ""
            lines.append(f"| `{kind}` | `{f.name}` | `{_type(f)}` | {'yes' if is_required(f) else 'no'} | "
                         f"{f.metadata['help']}{choices}{diverge} |")
    return "\n".join(lines)


def with_reference(text: str) -> str:
    """`text` (docs/log_schema.md) with the generated log schema between its two markers."""
    return between_markers(text, "log-reference", reference_markdown())
