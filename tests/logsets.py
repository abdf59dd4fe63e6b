"""Build synthetic run folders with real RankLogger files, so analysis tests know every answer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gptpar.config import Config
from gptpar.run.logfile import RankLogger
from gptpar.strategies.pipeline import COMPUTE, schedule, simulate

T0 = 1_700_000_000.0  # the clock of every synthetic record; tests pass `now` relative to it


def config(name: str = "run", dp: int = 1, pp_mode: str = "single", chunks: int = 4, devices: str = "",
           **overrides: Any) -> dict[str, Any]:
    """A resolved config dict; overrides are "section.key" -> value."""
    cfg = Config().to_dict()
    cfg["log"]["name"] = name
    cfg["parallel"].update(dp=dp, pp_mode=pp_mode, chunks=chunks, devices=devices)
    for dotted, value in overrides.items():
        section, key = dotted.split(".")
        cfg[section][key] = value
    return cfg


class Rank:
    """One rank's log file; every record gets the next tick of a fake clock."""

    def __init__(self, run_dir: Path, rank: int, cfg: dict[str, Any], coords: dict[str, int] | None = None,
                 sizes: dict[str, int] | None = None, device: str = "cpu", **header: Any):
        self.logger = RankLogger(run_dir, rank)
        self.path = self.logger.path
        self.rank, self.cfg, self.device, self.extra = rank, cfg, device, header
        self.coords = coords or {"dp": rank, "pp": 0}
        self.sizes = sizes or {"dp": cfg["parallel"]["dp"], "pp": 1}
        self.clock = T0

    def _log(self, kind: str, **fields: Any) -> None:
        self.clock += 1.0
        self.logger.log(kind, time=self.clock, **fields)

    def header(self, restart: int = 0, schema_version: int = 1) -> Rank:
        self._log("header", schema_version=schema_version, run_id=self.path.parent.name, config=self.cfg,
                  rank=self.rank, world_size=self.sizes["dp"] * self.sizes["pp"], coords=self.coords, sizes=self.sizes,
                  restart=restart, device=self.device, torch_version="2", transformers_version="5",
                  git_commit="abc", slurm={}, start_time=self.clock, **{"host": "testhost", **self.extra})
        return self

    def step(self, step: int, epoch: int = 1, step_time_s: float = 1.0, tokens: int = 100,
             tokens_per_s: float | None = None, loss: float | None = 3.0, peak_mem_bytes: int = 0,
             **extra: Any) -> Rank:
        rate = tokens / step_time_s if tokens_per_s is None else tokens_per_s
        self._log("step", step=step, epoch=epoch, loss=loss, lr=1e-3, grad_norm=1.0, tokens=tokens,
                  step_time_s=step_time_s, tokens_per_s=rate, data_time_s=0.0, peak_mem_bytes=peak_mem_bytes, **extra)
        return self

    def memory(self, params: int, params_bytes: int, grads_bytes: int, optimizer_bytes: int, step: int = 1,
               **optional: Any) -> Rank:
        """The training-state record the trainer logs once per start, after its first optimizer step (`optional`:
        its optional fields, e.g. hpz_bytes)."""
        self._log("memory", step=step, params=params, params_bytes=params_bytes, grads_bytes=grads_bytes,
                  optimizer_bytes=optimizer_bytes, **optional)
        return self

    def eval(self, step: int, val_loss: float, epoch: int = 1, **scores: Any) -> Rank:
        """An eval record; scores holds its optional fields, such as a classifier's `accuracy`."""
        self._log("eval", step=step, epoch=epoch, val_loss=val_loss, **scores)
        return self

    def epoch(self, epoch: int, training_time_s: float, tokens_per_s: float, steps: int = 1,
              val_loss: float | None = 2.0, **extra: Any) -> Rank:
        """An epoch record; extra holds optional fields, such as the translation workload's `bleu`."""
        self._log("epoch", epoch=epoch, training_time_s=training_time_s, tokens_per_s=tokens_per_s,
                  val_loss=val_loss, steps=steps, **extra)
        return self

    def final(self, status: str = "completed", step: int = 0, **optional: Any) -> Rank:
        """The segment's final record; `optional`: its optional fields (signal, error)."""
        self._log("final", status=status, step=step, **optional)
        self.logger.close()
        return self


def dp_run(run_dir: Path, tokens_per_s: list[float], epoch_times: list[float] | None = None,
           epochs: int = 2, steps_per_epoch: int = 2, status: str = "completed",
           memory: list[tuple[int, int, int, int]] | None = None, memory_fields: dict[str, Any] | None = None,
           bleu: list[float] | None = None,
           test_bleu: list[float] | None = None, answer_accuracy: list[float] | None = None, jitter: float = 0.0,
           device: str = "cpu", **cfg: Any) -> list[Rank]:
    """A completed data-parallel run, one rank per entry of tokens_per_s: in every epoch rank r
    reports tokens_per_s[r] and epoch_times[r]; every step carries 100 tokens and takes rank r
    100 / tokens_per_s[r] s, so the job's tokens/s is dp x 100 / the slowest rank's step time. The
    loss of step s is 4 - 0.1 s, every epoch's val_loss 2.0. With `jitter` j, odd steps take 1 + j
    and even steps 1 - j times as long (the job's tokens/s unchanged, the step-time spread of two steps
    sqrt(2) j). With `memory`, rank r logs memory[r] (params, params_bytes, grads_bytes,
    optimizer_bytes) after step 1, with `memory_fields`' optional fields on every rank; with `bleu`
    (`test_bleu`, `answer_accuracy`), rank 0's record of epoch e carries bleu[e - 1] (test_bleu[e - 1],
    answer_accuracy[e - 1]). The ranks' header names `device` (cpu, or cuda:0 for a GPU run)."""
    dp = len(tokens_per_s)
    times = epoch_times or [10.0] * dp
    ranks = [Rank(run_dir, r, config(name=run_dir.name, dp=dp, **cfg), device=device).header() for r in range(dp)]
    step = 0
    for e in range(1, epochs + 1):
        for _ in range(steps_per_epoch):
            step += 1
            for rank in ranks:
                stretch = 1 + jitter if step % 2 else 1 - jitter
                rank.step(step, e, step_time_s=stretch * 100 / tokens_per_s[rank.rank], loss=4.0 - 0.1 * step)
                if memory and step == 1:
                    rank.memory(*memory[rank.rank], **(memory_fields or {}))
        for r, rank in enumerate(ranks):
            scores = {"bleu": bleu, "test_bleu": test_bleu, "answer_accuracy": answer_accuracy}.items()
            extra = {key: values[e - 1] for key, values in scores if values and r == 0}
            rank.epoch(e, times[r], tokens_per_s[r], steps=steps_per_epoch, **extra)
    for rank in ranks:
        rank.final(status, step)
    return ranks


def classify_run(path: Path, dp: int, step_s: float, scores: dict[int, tuple[float, float | None]], steps: int = 4,
                 peaks: tuple[int, ...] = (), **cfg: Any) -> None:
    """A completed run of an image classifier (data.task=classify's eval records): dp ranks of `steps` steps of step_s s
    and 100 tokens each (rank r's peak memory peaks[r]), one epoch timed step_s * steps, and an eval record at each
    step of `scores` (step -> (top-1, top-5 or None)) carrying its accuracies; with no scores, a language run: one
    eval record at the end, without accuracy."""
    ranks = [Rank(path, r, config(name=path.name, dp=dp, **cfg)).header() for r in range(dp)]
    for step in range(1, steps + 1):
        for rank in ranks:
            rank.step(step, 1, step_time_s=step_s, loss=3.0, global_loss=3.0,
                      peak_mem_bytes=peaks[rank.rank] if peaks else 0)
            if step in scores:
                top1, top5 = scores[step]
                rank.eval(step, 2.0, accuracy=top1, **({} if top5 is None else {"accuracy_top5": top5}))
            elif not scores and step == steps:
                rank.eval(step, 2.0)
    for rank in ranks:
        rank.epoch(1, step_s * steps, 100 / step_s, steps=steps, val_loss=None).final(step=steps)


def engine_run(run_dir: Path, bubbles: list[float], dp: int = 1, chunks: int = 4, pp_schedule: str = "1f1b",
               virtual: int = 1, steps: int = 3, losses: list[float] | None = None, unit_s: float = 0.01,
               memory: list[tuple[int, int, int, int]] | None = None, **cfg: Any) -> list[Rank]:
    """A completed run of the multi-process pipeline: P = len(bubbles) stage ranks per replica, global rank
    stage * dp + replica as the grid lays them out. Every step each stage rank logs bubbles[stage] and the
    timeline its schedule simulates for unit costs (F = B = W = 1 unit of unit_s seconds, a whole backward
    2); steps take 1 s and carry 100 tokens on every rank; only the last stage logs a loss (replica d's is
    losses[d]), every rank the global_loss, their mean. With `memory`, each rank of stage s logs memory[s]
    (params, params_bytes, grads_bytes, optimizer_bytes) after step 1."""
    stages = len(bubbles)
    losses = losses or [3.0] * dp
    cfg = config(name=run_dir.name, dp=dp, chunks=chunks, **{"parallel.pp": stages, "parallel.pp_schedule": pp_schedule,
                                                              "parallel.pp_virtual": virtual, **cfg})
    sizes = {"pp": stages, "dp": dp, "tp": 1}
    ranks = [Rank(run_dir, stage * dp + d, cfg, coords={"pp": stage, "dp": d, "tp": 0}, sizes=sizes,
                  stage_devices=["cpu"]).header() for stage in range(stages) for d in range(dp)]
    timeline = simulate(schedule(pp_schedule, stages, chunks, virtual))
    spans = [[[a.kind, a.microbatch, a.stage, start * unit_s, end * unit_s] for r, a, start, end in timeline.spans
              if r == stage] for stage in range(stages)]
    for step in range(1, steps + 1):
        for rank in ranks:
            stage, d = rank.coords["pp"], rank.coords["dp"]
            busy = {k: sum(end - start for kind, _, _, start, end in spans[stage] if kind == k) for k in COMPUTE}
            rank.step(step, 1, loss=losses[d] if stage == stages - 1 else None, global_loss=sum(losses) / dp,
                      bubble=bubbles[stage], pp_busy_s=busy, pp_window_s=timeline.makespan * unit_s,
                      pp_peak_activation_bytes=0, pp_timeline=spans[stage])
            if memory and step == 1:
                rank.memory(*memory[stage])
    for rank in ranks:
        rank.epoch(1, float(steps), 100.0, steps=steps).final(step=steps)
    return ranks


# Bytes one rank sends per step by parallel.grad_comm, as a dp=2 run of the demo's model logs them (issue 48): fp32
# and bf16 all-reduce, int8 quantises into an all-to-all (reduce-scatter) and an all-gather with one scale a block.
COMM_BYTES = {"fp32": {"all_reduce": 5_400_000}, "bf16": {"all_reduce": 2_700_000},
              "int8": {"all_to_all": 685_000, "all_gather": 685_000}}


def comm_run(run_dir: Path, grad_comm: str, step_time_s: float, steps: int = 4) -> list[Rank]:
    """A completed run of 2 data-parallel ranks sending gradients in `grad_comm`: every step logs COMM_BYTES[grad_comm]
    on each rank, takes step_time_s and carries 100 tokens a rank."""
    cfg = config(name=run_dir.name, dp=2, **{"parallel.grad_comm": grad_comm})
    ranks = [Rank(run_dir, r, cfg).header() for r in range(2)]
    for step in range(1, steps + 1):
        for rank in ranks:
            rank.step(step, 1, step_time_s=step_time_s, loss=4.0 - 0.1 * step, comm_bytes=COMM_BYTES[grad_comm])
    for rank in ranks:
        rank.epoch(1, step_time_s * steps, 100 / step_time_s, steps=steps).final(step=steps)
    return ranks
