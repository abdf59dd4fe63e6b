"""Per-run metrics (time, throughput, loss, BLEU, memory, MFU) from the rank logs, and the keys that group runs.

Definitions (they are repeated in the summary's footnotes):
- epoch time: each rank's epoch `training_time_s`, averaged over ranks; an epoch a restart split (its
  record counts only the steps after the restart) is timed from its step records instead, each step
  once (the latest segment's), and its tokens/s is the mean of those steps' tokens/s;
- tokens/s: each data-parallel replica's tokens/s, summed over replicas; a replica's pipeline
  stages are counted once (only the last stage is read), and so are its tensor- and context-parallel ranks, each
  of which logs its replica's tokens (only the first is read): every token of the job once;
- job tokens/s: all kept tokens of all replicas over the slowest rank's summed step time;
- bubble: the logged idle share of the kept steps, per step the mean over the replicas (one-process
  pipelines) or over every stage rank (the multi-process engine, parallel.pp > 1: each stage idles its
  own share), then the mean and sample std over steps; a share outside [0, 1] is flagged;
- warm-up: the first `warmup_epochs` epochs are dropped when more epochs remain, otherwise the
  first `warmup_steps` steps; mean and sample std are over kept epochs, else over kept steps;
- loss: the step's `global_loss` (the mean over replicas), or for schema-1 logs the mean of the
  replicas' own losses; a non-finite loss (a diverged run) is kept as the final loss and the step it
  first appeared, and left out of the curves;
- memory: each rank's latest `memory` record (bytes of its live parameters, gradients and optimizer
  state), mean and max over ranks, against the closed form of fp32 AdamW state for the run's
  data-parallel strategy (over its W = dp x cp ranks) and the rank's own parameter count; a rank off it by more
  than 1% + 4 KiB (the padding of sharded buffers) is flagged. fsdp's optional `gathered_peak_bytes` (unsharded
  parameters and gradients held at once during a step, transient) is carried beside it, outside the closed form; its
  optional `hpz_bytes` (parallel.hpz's secondary copy, held all step) is inside the total, and its closed form N·b/L
  (strategies.data_parallel.hpz_bytes: b by parallel.param_comm, L the logged `hpz_node_size`, else a nonzero
  parallel.hpz_node_size) inside the run's; a run whose L is unknown has no closed form; under parallel.offload its
  `host_bytes` (the state on the host) is inside the total, and the closed form is the row's for that offload;
- peak memory: each rank's highest `peak_mem_bytes` over its step records (null where the device does not
  measure it), mean and max over the ranks that logged a number;
- job tokens/s spread: the sample std over the kept epochs (else kept steps) of each one's job tokens/s, the
  error bar of a point that has no repeats;
- progress: at the end of every step, the tokens seen (summed over replicas) and the training time (the
  slowest rank's step times summed: evaluation, checkpoints and restarts left out), the x of the loss and
  BLEU curves against tokens and time;
- validation points: the `eval` records, and each epoch record's `val_loss` at the epoch's last step;
- BLEU: an epoch record's optional `bleu` (corpus BLEU, 0-100, logged by one rank of the run);
- accuracy: the `eval` records' optional `accuracy` (top-1) and `accuracy_top5` (0-1, data.task=classify), per
  evaluated step the mean over replicas; a run's final accuracy is its last evaluated step's (none for a run that
  logs no accuracy, such as a language model's, never 0);
- communication: the bytes a rank sent per kept step (`comm_bytes`), by collective and in all, per rank the mean
  over its steps, then the mean over ranks.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from analysis.mfu import device_label, model_shape, utilisation
from analysis.trace import RankTrace
from gptpar.run.logfile import RankLog
from gptpar.run.names import replaced
from gptpar.run.records import EPOCH_SCORES, EvalRecord, names
from gptpar.run.resume import current_layout
from gptpar.run.segments import Segment, segments
from gptpar.run.state import RunLog, job_of, replica_indices
from gptpar.run.stragglers import Straggler, run_stragglers
from gptpar.run.sweeps import stale_runs
from gptpar.strategies.data_parallel import DP_STRATEGIES, STATE_BYTES, closed_form_state_bytes, hpz_bytes
from gptpar.strategies.pipeline import Action, Timeline, closed_form_bubble

ACCURACY_KEYS = names(EvalRecord, "accuracy", "accuracy_top5")  # the eval record's scores (data.task=classify)
TOP_LEVEL = "top-level"  # the sweep of the runs that are not in a sweep folder
LAYOUT_DIMS = ("dp", "cp", "tp", "ep")  # the grid sizes a layout names, in the grid's order (pp: pp_mode's)
# The config keys a layout string names (the grid's sizes beyond dp and pp, and cp's implementation)
LAYOUT_KEYS = ("parallel.cp", "parallel.cp_impl", "parallel.tp", "parallel.ep")
GPU_KEYS = ("parallel.dp", "parallel.pp", "parallel.devices", "launch.gpus", "launch.nodes")
PIPELINE_KEYS = ("parallel.pp_mode", "parallel.chunks", "parallel.pp_schedule", "parallel.pp_virtual")
# Keys that do not change what a run measures per step: how long it trains, how often and how much it evaluates
# or checkpoints, how long it waits for a peer, where it dumps its last gradients; runs that differ only in them
# belong to one series.
NEUTRAL_KEYS = ("train.max_steps", "train.epochs", "train.eval_every", "train.eval_batches", "train.checkpoint_every",
                "parallel.timeout_s", "data.hub_timeout_s", "train.dump_grads")
# Keys that never define a sweep axis: bookkeeping, scheduling (launch.repeat included), repeat seeds and the above.
NON_AXIS_PREFIXES = ("log.", "launch.", "report.")
NON_AXIS_KEYS = ("data.dir", "train.seed", *NEUTRAL_KEYS, *GPU_KEYS, *PIPELINE_KEYS)


# Measured over closed form within this share + bytes still matches: sharded buffers are padded to multiples of W.
MEMORY_REL_TOL, MEMORY_ABS_TOL = 0.01, 4096


@dataclass
class MemoryUse:
    """Training-state bytes per rank from the ranks' `memory` records, beside the strategy's closed form."""

    strategy: str  # parallel.dp_sync, or NO_STRATEGY with one replica
    ranks: int  # ranks that logged a memory record
    params: float  # parameters per rank, mean over ranks (a sharded parameter counted at its global size)
    mean: dict[str, float]  # "params", "grads", "optimizer", "total" (and under parallel.offload "host") -> bytes,
    # mean over ranks; total holds the host's bytes too
    max: dict[str, float]  # the same, max over ranks
    closed_form: float | None  # the closed form's total for each rank's own parameters, mean over ranks
    mismatched: list[int] = field(default_factory=list)  # ranks off their closed form beyond the tolerance
    # (mean, max) of `gathered_peak_bytes` over the ranks that log it (fsdp: unsharded parameters and gradients
    # held at once in a step); transient, so outside the closed form; None when no rank logs it
    gathered_peak: tuple[float, float] | None = None
    # (mean, max) of `hpz_bytes` (parallel.hpz: fsdp's secondary copy of the parameters), held all step long: inside
    # "total" and, where the node size L is known, the closed form (N·b/L); None when no rank logs it
    hpz: tuple[float, float] | None = None

    @property
    def ratio(self) -> float | None:
        return self.mean["total"] / self.closed_form if self.closed_form else None


NO_STRATEGY = "none (one replica)"


def _memory_strategy(w: int, dp_sync: str) -> str:
    """The data-parallel strategy that holds a run's training state: over one rank (W = dp x cp = 1) no strategy
    wraps the model, whatever parallel.dp_sync says, so the run is not shown as one."""
    return dp_sync if w > 1 else NO_STRATEGY


@dataclass(frozen=True)
class EpochPoint:
    """One epoch of a run as its epoch records and steps give it."""

    epoch: int
    step: int | None  # its last step (None: no step record of the epoch was kept)
    val_loss: float | None  # the mean over replicas of a finite val_loss
    bleu: float | None  # corpus BLEU (0-100) of validation pairs where a rank logged a number
    test_bleu: float | None = None  # the same of test pairs, where the source has a test split
    answer_accuracy: float | None = None  # data.task=sft: the share of decoded prompts with the right final answer


@dataclass
class RunMetrics:
    run: str  # path relative to the runs dir
    run_id: str
    sweep: str
    status: str
    detail: str
    params: dict[str, Any]  # the flattened resolved config, "section.key" -> value
    job_id: str = ""  # the scheduler's (or the local launcher's) job that ran it, "" for a plain `gptpar train`
    dp: int = 1
    cp: int = 1  # context-parallel ranks per replica: with dp, the W its data-parallel strategy shards over
    layout: str = "dp1"  # the rank grid's sizes above 1 (dp always), as `dp2 cp2 ring` (grid_layout)
    pp_mode: str = "single"  # a one-process mode, or the engine's "pp=P schedule[ v=V]"
    pp_schedule: str = ""  # the multi-process engine's schedule (parallel.pp > 1); empty for one-process runs
    pp_virtual: int = 1  # model chunks per engine rank
    chunks: int = 1
    devices: int = 1  # devices per data-parallel replica (pipeline stages)
    gpus: int = 1
    on_gpu: bool = False  # its ranks ran on CUDA devices (else on CPUs)
    basis: str = ""
    epoch_time: tuple[float | None, float | None] = (None, None)
    step_time: tuple[float | None, float | None] = (None, None)
    tokens_per_s: tuple[float | None, float | None] = (None, None)
    job_tokens_per_s: float | None = None
    job_tokens_std: float | None = None  # sample std over kept epochs (or steps) of their job tokens/s
    final_loss: float | None = None
    val_loss: float | None = None
    loss_curve: list[tuple[int, float]] = field(default_factory=list)
    # A mixture of experts: per step, the load-balancing loss, the busiest expert's tokens over the mean's, and the
    # step's share in all-to-all (rank 0's; nan where not logged)
    expert_load: list[tuple[int, float, float, float]] = field(default_factory=list)
    all_to_all_share: float | None = None  # seconds in all-to-all over the kept steps' seconds, mean over ranks
    # Bytes one rank sent per kept step (`comm_bytes`), by collective and in all, mean over the ranks that logged any
    comm_bytes: dict[str, float] = field(default_factory=dict)
    val_curve: list[tuple[int, float]] = field(default_factory=list)
    accuracy_curve: list[tuple[int, float]] = field(default_factory=list)  # (step, top-1 accuracy) per evaluation
    top5_curve: list[tuple[int, float]] = field(default_factory=list)  # (step, top-5 accuracy), where logged
    progress: dict[int, tuple[float, float]] = field(default_factory=dict)  # step -> (tokens seen, training s)
    epoch_points: list[EpochPoint] = field(default_factory=list)
    bubble_theory: float | None = None
    bubble_measured: float | None = None
    bubble_std: float | None = None  # sample std over the kept steps
    bubble_flagged: bool = False  # a logged bubble outside [0, 1]: warned about and left out of the figures
    pp_trace: Timeline | None = None  # an engine run's logged compute spans of one step on replica 0's stages
    pp_trace_step: int | None = None
    device: str = ""  # device name matched against the peak-FLOPs table
    precision: str = "fp32"
    vocab_size: int | None = None  # from the header; the LM head's FLOPs need it
    distinct_devices: int = 1  # devices the job ran on, each counted once (stages may share one)
    mfu: float | None = None
    hfu: float | None = None  # hardware FLOPs utilisation: recomputed forwards counted too
    mfu_note: str = ""
    speedup: float | None = None  # job tokens/s over the baseline point's (analysis.scaling)
    efficiency: float | None = None  # None for a pipeline against model parallel on the same devices
    baseline: str = ""  # the run id of the baseline point's first run
    baseline_runs: int = 0  # runs (repeats) the baseline's job tokens/s is the mean of
    ideal_speedup: float | None = None  # what the speedup would be without losses: GPU ratio, or the bubble's bound
    repeats: int = 1  # runs of its sweep point (itself included)
    noise: float | None = None  # relative spread of the measurement: over repeats, else over steps
    noise_basis: str = ""  # what the noise was measured over
    flag: str = ""  # why its speedup or efficiency breaks a physical bound; shown ⚠, not plotted
    target_loss: float | None = None  # the loss its sweep is timed to (analysis.target)
    target_basis: str = ""  # "validation" or "train": which of its losses was compared with the target
    target_final_loss: float | None = None  # the last value of the loss compared with the target (target_basis)
    target_origin: str = ""  # where the target came from: --target-loss, report.target_loss or the sweep's losses
    time_to_target_s: float | None = None  # training time at the first step that reached it; None: not reached
    tokens_to_target: float | None = None  # tokens seen (all replicas) by then
    target_speedup: float | None = None  # the baseline point's mean time to target over this run's
    target_accuracy: float | None = None  # the top-1 accuracy its sweep is timed to; None: it logs no accuracy
    target_accuracy_origin: str = ""  # report.target_accuracy or the sweep's accuracies
    time_to_accuracy_s: float | None = None  # training time at the first evaluation at or above it; None: not reached
    tokens_to_accuracy: float | None = None  # tokens seen (all replicas) by then
    diverged_at: int | None = None  # the first step with a non-finite loss
    plan: dict[str, Any] | None = None  # its plan.json (gptpar.plan.record): the prediction made before it ran
    stitched: list[int] = field(default_factory=list)  # kept epochs timed from step records (restarts)
    stale: str = ""  # why its numbers are not of its sweep's current definition, in one line
    set_aside: bool = False  # a folder --rerun / --start-over moved to <name>.replaced-<time>
    mixed: str = ""  # why its starts ran different configs: its numbers mix them (left out of table and figures)
    segments: list[Segment] = field(default_factory=list)  # a reshaped run's layouts, each timed alone; else []
    memory: MemoryUse | None = None  # None: no rank logged a memory record (logs older than it)
    peak_mem: tuple[float, float] | None = None  # (mean, max) over ranks of each rank's highest peak_mem_bytes
    traces: list[RankTrace] = field(default_factory=list)  # each rank's profiled steps (train.profile_steps)
    stragglers: list[Straggler] = field(default_factory=list)  # ranks whose compute stays above their peers'
    warnings: list[str] = field(default_factory=list)

    @property
    def replicas(self) -> int:
        """W: the ranks its data-parallel strategy shards the training state over and averages over (dp x cp)."""
        return self.dp * self.cp

    @property
    def engine(self) -> bool:
        """A run of the multi-process pipeline engine (one stage per rank), not of a one-process mode."""
        return bool(self.pp_schedule)

    @property
    def final_bleu(self) -> float | None:
        """The BLEU of the last epoch that has one."""
        return next((p.bleu for p in reversed(self.epoch_points) if p.bleu is not None), None)

    @property
    def final_test_bleu(self) -> float | None:
        return next((p.test_bleu for p in reversed(self.epoch_points) if p.test_bleu is not None), None)

    @property
    def final_accuracy(self) -> float | None:
        """The top-1 accuracy of the last evaluation that logged one; None for a run that logs none."""
        return self.accuracy_curve[-1][1] if self.accuracy_curve else None

    @property
    def final_accuracy_top5(self) -> float | None:
        return self.top5_curve[-1][1] if self.top5_curve else None

    @property
    def final_answer_accuracy(self) -> float | None:
        return next((p.answer_accuracy for p in reversed(self.epoch_points) if p.answer_accuracy is not None), None)


def flatten(config: dict[str, Any]) -> dict[str, Any]:
    return {f"{section}.{key}": value for section, values in config.items() if isinstance(values, dict)
            for key, value in values.items()}


def mean_std(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _shape(m: RunMetrics, header: dict[str, Any]) -> None:
    """Devices of the run from its header: the grid's sizes (dp x pp x cp x tp ranks) times the devices each
    rank drives (one, or the stages of a one-process pipeline). Schema-1 logs, which lack
    stage_devices, fall back to the config's device list. A grid with pp > 1 is the multi-process
    engine, whose schedule sets the closed-form bubble."""
    p = m.params
    sizes = header["sizes"]
    m.dp = int(sizes.get("dp", p.get("parallel.dp", 1)))
    m.cp = int(sizes.get("cp", 1))
    m.layout = grid_layout(sizes, str(p.get("parallel.cp_impl", "")))
    m.pp_mode = str(p.get("parallel.pp_mode", "single"))
    m.chunks = int(p.get("parallel.chunks", 1)) if m.pp_mode == "pipeline_parallel" else 1
    per_rank = len(header["stage_devices"]) if "stage_devices" in header else _schema1_devices(m, header)
    stages = int(sizes.get("pp", 1))
    replica = stages * int(sizes.get("cp", 1)) * int(sizes.get("tp", 1))  # ranks of one model replica
    m.devices = replica * per_rank
    m.gpus = m.dp * m.devices
    shared = len(set(header["stage_devices"])) if header.get("stage_devices") else per_rank
    m.distinct_devices = m.dp * replica * shared
    if stages > 1:
        m.pp_schedule = str(p.get("parallel.pp_schedule", "1f1b"))
        m.pp_virtual = int(p.get("parallel.pp_virtual", 1))
        m.chunks = int(p.get("parallel.chunks", 1))
        m.pp_mode = f"pp={stages} {m.pp_schedule}" + (f" v={m.pp_virtual}" if m.pp_virtual > 1 else "")
        m.bubble_theory = closed_form_bubble(m.pp_schedule, stages, m.chunks, m.pp_virtual)
    elif m.pp_mode != "single":
        m.bubble_theory = (m.devices - 1) / (m.chunks + m.devices - 1)


def grid_layout(sizes: dict[str, Any], cp_impl: str = "") -> str:
    """A run's rank grid within a pipeline stage as the report names it (the stages are its pp_mode's): each of dp, cp,
    tp and ep of the header's `sizes` larger than 1, dp always, cp followed by its implementation: `dp2`,
    `dp2 cp2 ring`, `dp1 tp2`, `dp4 ep2`."""
    parts = [f"{dim}{int(sizes.get(dim, 1))}" + (f" {cp_impl}" if dim == "cp" and cp_impl else "")
             for dim in LAYOUT_DIMS if dim == "dp" or int(sizes.get(dim, 1)) > 1]
    return " ".join(parts)


# A measured bubble this far (idle share) above its closed form is no noise: the closed form prices compute alone.
BUBBLE_GAP = 0.05
PIPELINE_OVERHEAD = (
    "the closed form counts compute alone; each micro-batch also pays a fixed per-micro-batch overhead and a "
    "point-to-point send between stages (on a CPU a copy through memory), which more micro-batches multiply")


def pipeline_shortfall(r: RunMetrics) -> str:
    """Why a pipeline run falls short of its closed form, in a few words ("" where it does not): slower than model
    parallel on the same devices, or a measured bubble BUBBLE_GAP or more above the closed form."""
    if r.pp_mode == "pipeline_parallel" and r.speedup is not None and r.speedup < 1 and r.baseline != r.run_id:
        return f"{r.speedup:.2f}× model parallel's job tokens/s"
    if (r.bubble_measured is not None and r.bubble_theory is not None and not r.bubble_flagged
            and r.bubble_measured - r.bubble_theory >= BUBBLE_GAP):
        return f"bubble {r.bubble_measured:.3f} against {r.bubble_theory:.3f} closed form"
    return ""


def _schema1_devices(m: RunMetrics, header: dict[str, Any]) -> int:
    if m.pp_mode == "single":
        return 1
    listed = [d for d in str(m.params.get("parallel.devices", "")).split(",") if d.strip()]
    if listed:
        return len(listed)
    return int(m.params.get("launch.gpus", 1)) if str(header["device"]).startswith("cuda") else 1  # every GPU


def epoch_figures(log: RankLog) -> tuple[dict[int, tuple[float, float]], set[int]]:
    """({epoch: (training time s, tokens/s)}, the epochs stitched from step records) of one rank.

    An epoch record covers the steps of its own segment only (its `steps` field counts them): after a
    restart inside an epoch it misses the steps before the restart. Such an epoch is timed from its
    step records instead, each step once (the latest segment's record), with the trainer's own sums:
    time is the sum of step_time_s, tokens/s the mean of the steps' tokens/s. A log of one segment
    cannot have such an epoch, so only restarted logs pay for the pass over their steps."""
    figures = {e: (rec["training_time_s"], rec["tokens_per_s"]) for e, rec in log.epochs.items()}
    stitched: set[int] = set()
    if len(log.headers) < 2:
        return figures, stitched
    by_epoch: dict[int, list[dict[str, Any]]] = {}
    for rec in log.steps.values():
        by_epoch.setdefault(rec["epoch"], []).append(rec)
    for e, rec in log.epochs.items():
        steps = by_epoch.get(e, [])
        if len(steps) > rec["steps"]:
            figures[e] = (math.fsum(r["step_time_s"] for r in steps),
                          statistics.fmean(r["tokens_per_s"] for r in steps))
            stitched.add(e)
    return figures, stitched


def _warmup(m: RunMetrics, ranks: list[RankLog], figures: list[dict[int, tuple[float, float]]],
            warmup_epochs: int, warmup_steps: int) -> tuple[list[int], set[int]]:
    """(kept epochs, kept step numbers): epochs are the basis when any remain after the warm-up,
    and then the kept steps are those of the kept epochs; else the first steps are dropped."""
    epochs = sorted(set.intersection(*(set(log.epochs) for log in ranks)))
    if len(epochs) > warmup_epochs:
        kept = epochs[warmup_epochs:]
        m.basis = f"epochs {kept[0]}-{kept[-1]} of {len(epochs)}" if len(kept) > 1 else f"epoch {kept[0]}"
        m.epoch_time = mean_std([statistics.fmean(f[e][0] for f in figures) for e in kept])
        kept_set = set(kept)
        return kept, {s for log in ranks for s, r in log.steps.items() if r["epoch"] in kept_set}
    if len(epochs) == 1:
        m.epoch_time = (statistics.fmean(f[epochs[0]][0] for f in figures), None)
    numbers = sorted(set().union(*(log.steps for log in ranks)))
    if len(numbers) <= warmup_steps:
        m.warnings.append(f"{m.run}: only {len(numbers)} step(s); no warm-up steps dropped")
        warmup_steps = 0
    kept_steps = numbers[warmup_steps:]
    if kept_steps:
        m.basis = f"steps {kept_steps[0]}-{kept_steps[-1]} of {len(numbers)}"
    return [], set(kept_steps)


def run_metrics(run: RunLog, rel: str, warmup_epochs: int = 1, warmup_steps: int = 5) -> RunMetrics:
    m = RunMetrics(rel, run.run_id, run.sweep or TOP_LEVEL, run.state, run.detail, flatten(run.config),
                   mixed=run.mixed, warnings=list(run.warnings))
    job = job_of(run.folder, [h for log in run.ranks[:1] for h in log.headers] if run.ranks else None)
    m.job_id = job[1] if job else ""
    if m.mixed:
        m.warnings.append(f"run {rel}: {m.mixed}; left out of the table and figures")
    if run.reshaped:
        m.warnings.append(f"run {rel}: {run.reshaped}")
        m.segments = segments(run.ranks)
    ranks = run.ranks
    if not ranks:
        return m
    header = ranks[0].header
    _shape(m, header)
    m.stragglers = run_stragglers(run)
    m.on_gpu = str(header["device"]).startswith("cuda")
    whole_run, ranks = ranks, current_layout(ranks)  # a reshaped run is timed on its current layout alone
    replicas = replica_indices(ranks)
    figures, stitched = zip(*(epoch_figures(log) for log in ranks), strict=True)
    kept_epochs, kept_steps = _warmup(m, ranks, list(figures), warmup_epochs, warmup_steps)
    shown_epochs = set(kept_epochs) if kept_epochs else set.intersection(*(set(log.epochs) for log in ranks))
    m.stitched = sorted(set().union(*stitched) & shown_epochs)
    if m.stitched:
        m.basis += (f" (stitched across restarts: epoch{'s' if len(m.stitched) > 1 else ''} "
                    f"{', '.join(map(str, m.stitched))})")
    kept = [{s: r for s, r in log.steps.items() if s in kept_steps} for log in ranks]
    kept_replicas = [kept[i] for i in replicas]
    if kept_epochs:
        m.tokens_per_s = mean_std([sum(figures[i][e][1] for i in replicas) for e in kept_epochs])
    else:
        in_all = sorted(set.intersection(*(set(k) for k in kept_replicas)))
        m.tokens_per_s = mean_std([sum(k[s]["tokens_per_s"] for k in kept_replicas) for s in in_all])
    common = sorted(set.intersection(*(set(k) for k in kept)))
    m.step_time = mean_std([sum(k[s]["step_time_s"] for k in kept) / len(kept) for s in common])
    m.job_tokens_per_s, m.job_tokens_std = _job_rates(kept, set(replicas), by_epoch=bool(kept_epochs))
    _bubble(m, [(ranks[i].rank, kept[i]) for i in (range(len(ranks)) if m.engine else replicas)])
    if m.engine:
        _trace(m, ranks, common)

    whole_replicas = replica_indices(whole_run)  # losses, progress and epochs: the whole run's
    replica_logs = [whole_run[i] for i in whole_replicas]
    losses = loss_series(replica_logs)
    m.loss_curve = [(s, v) for s, v in losses if math.isfinite(v)]
    m.final_loss = losses[-1][1] if losses else None
    m.expert_load = expert_load(ranks[0])
    m.all_to_all_share = comm_share(kept, "all_to_all")
    m.comm_bytes = comm_bytes(kept)
    m.diverged_at = next((s for s, v in losses if not math.isfinite(v)), None)
    m.progress, ends = _progress(whole_run, set(whole_replicas))
    m.epoch_points = _epoch_points(m, whole_run, replica_logs, ends)
    vals = _mean_series([{s: r["val_loss"] for s, r in log.evals.items()} for log in replica_logs])
    val_points = {s: v for s, v in vals if math.isfinite(v)}
    for point in m.epoch_points:  # an epoch's validation counts at its last step, unless an eval record is there
        if point.step is not None and point.val_loss is not None:
            val_points.setdefault(point.step, point.val_loss)
    m.val_curve = sorted(val_points.items())
    m.accuracy_curve, m.top5_curve = (eval_series(replica_logs, key) for key in ACCURACY_KEYS)
    if vals:
        m.val_loss = vals[-1][1]
    else:
        last = [log.epochs[max(log.epochs)]["val_loss"] for log in replica_logs if log.epochs]
        finite = [v for v in last if _finite(v)]
        m.val_loss = statistics.fmean(finite) if finite else None
    m.device, m.precision = device_label(header, m.params)
    m.vocab_size = header.get("vocab_size")
    _memory(m, ranks)
    peaks = [_peak_mem(log) for log in ranks]
    m.peak_mem = _mean_max([peak for peak in peaks if peak is not None])
    return m


def _job_rates(kept: list[dict[int, dict[str, Any]]], replicas: set[int],
               by_epoch: bool) -> tuple[float | None, float | None]:
    """(job tokens/s, its sample std over units) of the kept steps of every rank: the replicas' tokens over the
    slowest rank's summed step time, over all kept steps, then per kept epoch (by_epoch) or per kept step."""
    times: list[dict[int, float]] = []
    tokens: dict[int, float] = {}
    for i, steps in enumerate(kept):
        time: dict[int, float] = {}
        for step, rec in steps.items():
            unit = rec["epoch"] if by_epoch else step
            time[unit] = time.get(unit, 0.0) + rec["step_time_s"]
            if i in replicas:
                tokens[unit] = tokens.get(unit, 0.0) + rec["tokens"]
        times.append(time)
    wall = max(math.fsum(time.values()) for time in times)
    walls = {unit: max(time.get(unit, 0.0) for time in times) for unit in tokens}
    per_unit = [tokens[unit] / w for unit, w in sorted(walls.items()) if w > 0]
    return (math.fsum(tokens.values()) / wall if wall > 0 else None), mean_std(per_unit)[1]


def _progress(ranks: list[RankLog], replicas: set[int]) -> tuple[dict[int, tuple[float, float]], dict[int, int]]:
    """({step: (tokens seen, training seconds) at its end}, {epoch: its last step}) over every logged step: tokens
    summed over the replicas, seconds the slowest rank's step times summed, so that curves against tokens or time
    compare runs of any width by what they cost."""
    slowest: dict[int, float] = {}
    tokens: dict[int, float] = {}
    ends: dict[int, int] = {}
    for i, log in enumerate(ranks):
        replica = i in replicas
        for step, rec in log.steps.items():
            slowest[step] = max(slowest.get(step, 0.0), rec["step_time_s"])
            if replica:
                tokens[step] = tokens.get(step, 0.0) + rec["tokens"]
            ends[rec["epoch"]] = max(ends.get(rec["epoch"], step), step)
    seen = seconds = 0.0
    progress: dict[int, tuple[float, float]] = {}
    for step in sorted(slowest):
        seen += tokens.get(step, 0.0)
        seconds += slowest[step]
        progress[step] = (seen, seconds)
    return progress, ends


def _epoch_points(m: RunMetrics, ranks: list[RankLog], replica_logs: list[RankLog],
                  ends: dict[int, int]) -> list[EpochPoint]:
    """Every epoch a replica recorded: its last step, the replicas' mean finite val_loss, and the scores (BLEU, test
    BLEU, answer accuracy) that one rank logged (any rank: a pipeline's first stage may be the one)."""
    points = []
    for epoch in sorted(set().union(*(log.epochs for log in replica_logs))):
        vals = [v for log in replica_logs if _finite(v := log.epochs.get(epoch, {}).get("val_loss"))]
        points.append(EpochPoint(epoch, ends.get(epoch), statistics.fmean(vals) if vals else None,
                                 **{key: _logged_score(m, ranks, epoch, key) for key in EPOCH_SCORES}))
    return points


def _logged_score(m: RunMetrics, ranks: list[RankLog], epoch: int, key: str) -> float | None:
    """An epoch's score as the first rank that logged a number gives it; one that is not a number is warned about."""
    logged = [(log.rank, log.epochs[epoch][key]) for log in ranks if log.epochs.get(epoch, {}).get(key) is not None]
    score = next((float(v) for _, v in logged if _finite(v)), None)
    if logged and score is None:
        m.warnings.append(f"{m.run}: epoch {epoch}'s {key} (rank {logged[0][0]}) is not a number: "
                          f"{logged[0][1]!r}; left out")
    return score


def _mean_max(values: list[float]) -> tuple[float, float] | None:
    """(mean, max) of per-rank values, None for none: the memory table shows both where ranks differ."""
    return (statistics.fmean(values), max(values)) if values else None


def _peak_mem(log: RankLog) -> float | None:
    """A rank's highest logged peak_mem_bytes over its steps; None where no step logged a number (a CPU run
    logs null), so that an unmeasured peak does not read as zero."""
    values = [rec.get("peak_mem_bytes") for rec in log.steps.values()]
    return max((float(v) for v in values if _finite(v)), default=None)


def _memory(m: RunMetrics, ranks: list[RankLog]) -> None:
    """Training-state bytes per rank against the closed form for the rank's own parameter count (a pipeline
    stage's, with parallel.pp > 1); a rank off it beyond the tolerance flags the run with a warning. A record
    with a field that is not a finite number (an optional gathered_peak_bytes that is not null included) is warned
    about and left out."""
    rows: list[tuple[int, float, dict[str, float], float | None]] = []  # rank, N, bytes, hpZ's closed form
    gathered: list[float] = []
    held: list[float] = []
    trainable: dict[int, float | None] = {}  # train.lora_rank: the adapters, the only state beyond weights
    for log in ranks:
        if log.memory is None:
            continue
        parts = {part: _number(log.memory[f"{part}_bytes"]) for part in STATE_BYTES}
        if "host_bytes" in log.memory:  # parallel.offload: what the device's parts above do not hold
            parts["host"] = _number(log.memory["host_bytes"])
        n = _number(log.memory["params"])
        trainable[log.rank] = _number(log.memory["trainable"]) if "trainable" in log.memory else None
        extra, copy = log.memory.get("gathered_peak_bytes"), log.memory.get("hpz_bytes")
        optional = [] if extra is None else [_number(extra)]
        hpz = [] if copy is None else [_number(copy)]
        if not all(map(math.isfinite, [n, *parts.values(), *optional, *hpz])):
            m.warnings.append(f"{m.run}: rank {log.rank}'s memory record has a field that is not a number; left out")
            continue
        rows.append((log.rank, n, {**parts, "total": math.fsum([*parts.values(), *hpz])},
                     _hpz_closed_form(m, log.memory, n) if hpz else 0.0))
        gathered += optional
        held += hpz
    if not rows:
        return
    strategy = str(m.params.get("parallel.dp_sync", ""))
    # Under parallel.ep a sharding strategy shards only the dense part; the closed form knows one kind of parameter.
    row = DP_STRATEGIES.get(strategy)
    split_experts = _number(m.params.get("parallel.ep", 1)) > 1 and row is not None and bool(row.sharded)
    offload = str(m.params.get("parallel.offload", "none"))
    stage = int(_number(m.params.get("parallel.zero_stage", 3)))
    closed = [None if split_experts or form is None else
              _plus(closed_form_state_bytes(strategy, n, m.replicas, offload, trainable[rank], stage), form)
              for rank, n, _, form in rows]
    if any(form is None for *_, form in rows):
        m.warnings.append(f"{m.run}: its memory records hold hpZ's copy but not its node size (hpz_node_size), so "
                          "its memory has no closed form to check")
    known = [c for c in closed if c is not None]  # all or none: one strategy per run
    off = [(rank, b["total"], c) for (rank, _, b, _), c in zip(rows, closed, strict=True)
           if c is not None and abs(b["total"] - c) > MEMORY_REL_TOL * c + MEMORY_ABS_TOL]
    m.memory = MemoryUse(strategy=_memory_strategy(m.replicas, strategy), ranks=len(rows),
                         params=statistics.fmean(n for _, n, *_ in rows),
                         mean={k: statistics.fmean(b[k] for _, _, b, _ in rows) for k in rows[0][2]},
                         max={k: max(b[k] for _, _, b, _ in rows) for k in rows[0][2]},
                         closed_form=statistics.fmean(known) if known else None, mismatched=[rank for rank, *_ in off],
                         gathered_peak=_mean_max(gathered), hpz=_mean_max(held))
    if off:
        rank, total, c = off[0]
        more = f" (and {len(off) - 1} more rank(s))" if len(off) > 1 else ""
        m.warnings.append(f"{m.run}: rank {rank} holds {total / 1e6:.4g} MB of training state, {total / c:.3g}x the "
                          f"closed form {c / 1e6:.4g} MB for {m.memory.strategy} with W={m.replicas}{more}; flagged "
                          "(⚠) in the memory table and figure")


def _hpz_closed_form(m: RunMetrics, record: dict[str, Any], n: float) -> float | None:
    """N·b/L of a rank that logged `hpz_bytes`: b by the run's parallel.param_comm and quant_block, L its logged node
    group size (older records: a nonzero parallel.hpz_node_size); None where neither says L."""
    size = record.get("hpz_node_size") or m.params.get("parallel.hpz_node_size") or 0
    if not _finite(size) or int(size) < 1:
        return None
    return hpz_bytes(n, int(size), str(m.params.get("parallel.param_comm", "fp32")),
                     int(m.params.get("parallel.quant_block", 256)))


def _plus(state: float | None, copy: float) -> float | None:
    return None if state is None else state + copy


def _bubble(m: RunMetrics, kept: list[tuple[int, dict[int, dict[str, Any]]]]) -> None:
    """Measured bubble of the given ranks' kept steps (rank, {step: record}): per step the mean over those
    ranks, then mean and std over steps. An idle share outside [0, 1] breaks a physical bound: the run is
    flagged, with a warning naming the first such values, and its bubble is left out of the figures."""
    per_step: dict[int, list[float]] = {}
    outside: list[str] = []
    for rank, steps in kept:
        for step, rec in steps.items():
            value = rec.get("bubble")
            if not _finite(value):
                continue
            per_step.setdefault(step, []).append(float(value))
            if not 0.0 <= value <= 1.0:
                outside.append(f"{value:.4g} (rank {rank}, step {step})")
    m.bubble_measured, m.bubble_std = mean_std([statistics.fmean(v) for _, v in sorted(per_step.items())])
    if outside:
        m.bubble_flagged = True
        more = f" and {len(outside) - 3} more" if len(outside) > 3 else ""
        m.warnings.append(f"{m.run}: measured pipeline bubble outside [0, 1]: {', '.join(outside[:3])}{more}; "
                          "left out of the figures")


def _trace(m: RunMetrics, ranks: list[RankLog], common: list[int]) -> None:
    """The last kept step that every rank logged, as replica 0's stage ranks ran it (row = pp coordinate),
    kept as a Timeline (seconds from the step's start; each rank's logged bubble as its idle share) for the
    figure that draws it beside the simulated schedule. An unreadable timeline is warned about, not fatal."""
    stages = sorted((log for log in ranks if log.header["coords"].get("dp", 0) == 0
                     and log.header["coords"].get("tp", 0) == 0), key=lambda log: log.header["coords"].get("pp", 0))
    rows = [log.header["coords"].get("pp", 0) for log in stages]
    step = next((s for s in reversed(common)
                 if all(isinstance(log.steps[s].get("pp_timeline"), list) for log in stages)), None)
    if step is None or rows != list(range(len(stages))):
        return
    records = [log.steps[step] for log in stages]
    try:
        spans = [(row, Action(str(kind), int(mb), int(stage)), float(start), float(end))
                 for row, rec in zip(rows, records, strict=True) for kind, mb, stage, start, end in rec["pp_timeline"]]
    except (TypeError, ValueError):
        m.warnings.append(f"{m.run}: step {step} has an unreadable pp_timeline; no timeline figure")
        return
    windows = [float(rec["pp_window_s"]) for rec in records if _finite(rec.get("pp_window_s"))]
    window = max([*windows, *(end for *_, end in spans)], default=0.0)
    if window <= 0:
        return
    busy = dict.fromkeys(rows, 0.0)
    for row, _, start, end in spans:
        busy[row] += end - start
    idle = [float(rec["bubble"]) if _finite(rec.get("bubble")) else 1.0 - busy[row] / window
            for row, rec in zip(rows, records, strict=True)]
    m.pp_trace, m.pp_trace_step = Timeline(spans, window, idle), step


def apply_sweep_records(runs: list[RunMetrics], runs_dir: Path) -> None:
    """Flag the runs whose numbers are not of their sweep's current definition (gptpar.run.sweeps), which
    figures would otherwise mix with the new ones without a word; a folder that --rerun / --start-over
    set aside is also left out of the table and figures."""
    stale = {path.relative_to(runs_dir).as_posix(): reason for path, reason in stale_runs(runs_dir).items()}
    for m in runs:
        if m.run not in stale:
            continue
        m.stale, m.set_aside = stale[m.run], replaced(m.run.rpartition("/")[2])
        left_out = "; left out of the table and figures" if m.set_aside else ""
        m.warnings.append(f"run {m.run} is stale: {m.stale}{left_out}")


def apply_mfu(runs: list[RunMetrics], user_peak: float | None = None) -> None:
    """MFU and HFU of every run, from its tokens/s, devices, their peak (user_peak FLOP/s for a device the
    table lacks) and the model shape; an impossible one is flagged with a warning instead."""
    for r in runs:
        if not r.device:
            continue
        shape = model_shape(r.params, r.vocab_size) if r.vocab_size else None
        u = utilisation(r.tokens_per_s[0], r.distinct_devices, r.device, r.precision, shape, user_peak)
        r.mfu, r.hfu, r.mfu_note = u.mfu, u.hfu, u.note
        if u.note.startswith("flagged"):
            r.warnings.append(f"run {r.run}: MFU {u.note}; not reported")


def _number(value: Any) -> float:
    """A logged number as a float; anything else (a value the reader left as text) is not a number."""
    return float(value) if isinstance(value, (int, float)) else math.nan


def _mean_series(series: list[dict[int, Any]]) -> list[tuple[int, float]]:
    """Per step, the mean over replicas (a stage without a loss logs None, which is skipped); a step
    where any replica's value is not finite is not finite either."""
    values: dict[int, list[float]] = {}
    for one in series:
        for step, value in one.items():
            if value is not None:
                values.setdefault(step, []).append(_number(value))
    return [(step, math.fsum(v) / len(v) if all(map(math.isfinite, v)) else math.nan)
            for step, v in sorted(values.items())]


def eval_series(replica_logs: list[RankLog], key: str) -> list[tuple[int, float]]:
    """An optional score of the eval records (ACCURACY_KEYS) per evaluated step, the mean over the replicas that
    logged a value (a non-number is not finite and left out): [] where none did."""
    series = _mean_series([{s: r.get(key) for s, r in log.evals.items()} for log in replica_logs])
    return [(s, v) for s, v in series if math.isfinite(v)]


def expert_load(log: RankLog) -> list[tuple[int, float, float, float]]:
    """(step, aux_loss, max over mean tokens per expert, share of the step in all-to-all) of a mixture's steps, in
    step order; the first two are the same on every rank (over every replica's tokens), the share is this rank's
    (nan where the step logged none: no expert parallelism)."""
    points = []
    for step, rec in sorted(log.steps.items()):
        load = (rec.get("moe") or {}).get("tokens_per_expert") or {}
        if rec.get("aux_loss") is not None and load.get("mean"):
            share = _number((rec.get("comm_s") or {}).get("all_to_all")) / _number(rec["step_time_s"])
            points.append((step, _number(rec["aux_loss"]), _number(load["max"]) / _number(load["mean"]), share))
    return points


def comm_share(kept: list[dict[int, dict[str, Any]]], kind: str) -> float | None:
    """The seconds the kept steps spent in collectives of `kind` (`comm_s`) over their seconds, per rank, averaged
    over the ranks that logged any; None where none did."""
    shares = []
    for steps in kept:
        timed = [rec for rec in steps.values() if kind in (rec.get("comm_s") or {})]
        if timed:
            shares.append(math.fsum(_number(r["comm_s"][kind]) for r in timed)
                          / math.fsum(_number(r["step_time_s"]) for r in timed))
    return math.fsum(shares) / len(shares) if shares else None


def comm_bytes(kept: list[dict[int, dict[str, Any]]]) -> dict[str, float]:
    """Bytes a rank sent per kept step by collective (`comm_bytes`) and in all ("total"): per rank the mean over its
    steps that logged any, then the mean over those ranks; {} where none did (a run of one replica, older logs)."""
    per_rank: list[dict[str, float]] = []
    for steps in kept:
        logged = [rec["comm_bytes"] for rec in steps.values() if isinstance(rec.get("comm_bytes"), dict)]
        if logged:
            kinds = sorted(set().union(*logged))
            mean = {kind: math.fsum(_number(one.get(kind, 0)) for one in logged) / len(logged) for kind in kinds}
            per_rank.append({**mean, "total": math.fsum(mean.values())})
    if not per_rank:
        return {}
    kinds = sorted(set().union(*per_rank), key=lambda kind: (kind == "total", kind))
    return {kind: math.fsum(one.get(kind, 0.0) for one in per_rank) / len(per_rank) for kind in kinds}


def loss_series(replica_logs: list[RankLog]) -> list[tuple[int, float]]:
    """The loss of every step, non-finite values included: the logged `global_loss` (the mean over
    replicas, one all-reduce in the trainer, schema 2), else the mean of the replicas' own `loss`
    (schema-1 logs), so that the curves of dp=1 and dp=N runs overlay."""
    global_loss: dict[int, float] = {}
    for log in replica_logs:
        for step, rec in log.steps.items():
            value = rec.get("global_loss")
            if value is not None and step not in global_loss:
                global_loss[step] = _number(value)
    if not global_loss:
        return _mean_series([{s: r["loss"] for s, r in log.steps.items()} for log in replica_logs])
    local = _mean_series([{s: r["loss"] for s, r in log.steps.items() if s not in global_loss}
                          for log in replica_logs])
    return sorted([*global_loss.items(), *local])


# Keys --x and --group-by take besides config keys (section.key), with what they stand for.
PSEUDO_KEYS = {"gpus": "the job's devices: data-parallel ranks x devices per replica",
               "sweep": f"the sweep folder ({TOP_LEVEL} for runs outside one)"}


def key_value(r: RunMetrics, key: str) -> Any:
    """A run's value of a config key or of a pseudo key (PSEUDO_KEYS)."""
    if key == "gpus":
        return r.gpus
    return r.sweep if key == "sweep" else r.params.get(key)


def follows(runs: list[RunMetrics], key: str, x: str = "gpus") -> bool:
    """A key zipped with the x axis (the global batch of a weak-scaling sweep, against the GPU count) is no axis
    of its own: it has one value at each x, and x takes two or more."""
    by_x: dict[str, set[str]] = {}
    for r in runs:
        by_x.setdefault(repr(key_value(r, x)), set()).add(repr(key_value(r, key)))
    return len(by_x) > 1 and all(len(values) == 1 for values in by_x.values())


def sweep_axes(runs: list[RunMetrics], x: str = "gpus") -> list[str]:
    """Config keys whose values differ within a sweep, other than x, keys that follow it, GPU and pipeline keys,
    and keys that do not change what a run measures (NON_AXIS_KEYS)."""
    keys = sorted(set().union(*(r.params for r in runs))) if runs else []
    return [k for k in keys if not k.startswith(NON_AXIS_PREFIXES) and k not in NON_AXIS_KEYS and k != x
            and len({repr(r.params.get(k)) for r in runs}) > 1 and not follows(runs, k, x)]
