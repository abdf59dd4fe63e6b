"""The training loop of one rank: whatever the parallelism, the same loop runs on every rank.

Data parallelism enters through the data partition and the gradient sync, pipeline and model
parallelism through the module that maps token ids to logits; the loop itself does not change.
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers

from gptpar.checkpoint import load_checkpoint, save_checkpoint
from gptpar.config import Config, TrainConfig, config_from_dict, to_yaml, validate
from gptpar.data import BlockDataset, load_tokens, partition_dataset
from gptpar.distributed import RankInfo, destroy_distributed, init_distributed, layout_from_env, spawn_local
from gptpar.errors import GptparError
from gptpar.logs import SCHEMA_VERSION, RankLogger, rank_log_path
from gptpar.model import build_model, lm_loss
from gptpar.parallel import make_grad_sync
from gptpar.pipeline import build_parallel_model
from gptpar.preemption import install_preemption_handler, preemption_requested, requeue_current_job


def learning_rate(step: int, t: TrainConfig, total_steps: int) -> float:
    """Linear warm-up to `lr`, then cosine decay to `min_lr` at the last step (step is 0-based)."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = min(1.0, (step - t.warmup_steps) / max(1, total_steps - t.warmup_steps))
    return t.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (t.lr - t.min_lr)


def make_optimizer(module: torch.nn.Module, t: TrainConfig) -> torch.optim.AdamW:
    """AdamW that decays matrices only (not biases or norm gains), as GPT-2 training does."""
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2))


def new_run_id(name: str) -> str:
    job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    suffix = f"{job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if os.environ.get("SLURM_ARRAY_TASK_ID") else job
    return f"{name}-{suffix or time.strftime('%Y%m%d-%H%M%S')}"


def agree_run_id(cfg: Config, info: RankInfo) -> str:
    """Every rank must write into the same folder: rank 0 names it and tells the others."""
    run_id = [cfg.log.run_id or new_run_id(cfg.log.name)]
    if info.world_size > 1:
        dist.broadcast_object_list(run_id, src=0)
    return run_id[0]


def adopt_world_size(cfg: Config, info: RankInfo) -> None:
    """Under srun or torchrun the launcher fixes the rank count; the config must agree with it."""
    if info.world_size != cfg.parallel.dp:
        if cfg.parallel.dp != 1:
            raise GptparError(f"parallel.dp={cfg.parallel.dp} but the launcher started {info.world_size} ranks; "
                              f"set parallel.dp={info.world_size} or launch {cfg.parallel.dp} tasks")
        cfg.parallel.dp = info.world_size
        validate(cfg)


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


SLURM_FIELDS = {"job_id": "SLURM_JOB_ID", "array_job_id": "SLURM_ARRAY_JOB_ID",
                "array_task_id": "SLURM_ARRAY_TASK_ID", "job_nodelist": "SLURM_JOB_NODELIST",
                "node": "SLURMD_NODENAME", "node_id": "SLURM_NODEID", "restart_count": "SLURM_RESTART_COUNT",
                "job_name": "SLURM_JOB_NAME", "partition": "SLURM_JOB_PARTITION"}


def slurm_fields() -> dict[str, str]:
    return {key: os.environ[var] for key, var in SLURM_FIELDS.items() if var in os.environ}


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def count_headers(path: Path) -> int:
    """Segments already in a rank's log: a resumed run appends the next one."""
    if not path.is_file():
        return 0
    with open(path, "rb") as f:
        return sum(1 for line in f if line.startswith(b'{"kind": "header"'))


class Progress:
    """A tqdm bar on a terminal, periodic plain lines otherwise (batch logs), on rank 0 only."""

    def __init__(self, cfg: Config, rank: int, total: int, start: int):
        mode = cfg.log.progress
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.mode = mode if rank == 0 else "none"
        self.every, self.total = cfg.log.every, total
        self.bar = None
        if self.mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}")
        elif self.mode == "lines" and (step % self.every == 0 or step == self.total):
            print(f"step {step}/{self.total} loss {loss:.4f} {tokens_per_s:,.0f} tok/s", flush=True)

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        elif self.mode != "none":
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Trainer:
    """One rank's training run: set-up, the step loop, evaluation, checkpoints and logs."""

    def __init__(self, cfg: Config, info: RankInfo):
        self.cfg, self.info = cfg, info
        t = cfg.train
        if t.threads:
            torch.set_num_threads(t.threads)
        adopt_world_size(cfg, info)
        cfg.log.run_id = agree_run_id(cfg, info)
        self.run_dir = Path(cfg.log.runs_dir) / cfg.log.run_id
        if info.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(to_yaml(cfg))

        tokens = load_tokens(cfg.data)
        self.train_set = BlockDataset(tokens.train, cfg.data.seq_len, "train")
        self.val_set = BlockDataset(tokens.val, cfg.data.seq_len, "validation")
        self.vocab_size, self.tokenizer = tokens.vocab_size, tokens.tokenizer
        self.micro_batch = t.batch_size // t.grad_accum  # global, over all DP ranks
        if len(self.train_set) < self.micro_batch:
            raise GptparError(f"train.batch_size={t.batch_size} exceeds the {len(self.train_set)} training "
                              "blocks of the corpus; lower it or use a larger corpus")

        model = build_model(cfg.model, tokens.vocab_size, t.seed, cfg.data.hub_timeout_s)
        parallel = cfg.parallel
        if parallel.pp_mode == "single":
            parallel = dataclasses.replace(parallel, devices=str(info.device))
        self.net = build_parallel_model(model, parallel)
        self.sync = make_grad_sync(self.net, cfg.parallel, info)
        self.optimizer = make_optimizer(self.net, t)
        self.steps_per_epoch = len(self._loader(0)) // t.grad_accum
        self.total_steps = t.epochs * self.steps_per_epoch
        if t.max_steps:
            self.total_steps = min(self.total_steps, t.max_steps)
        self.step = 0
        self.log = RankLogger(self.run_dir, info.rank)

    def _loader(self, epoch: int):
        return partition_dataset(self.info.rank, self.info.world_size, self.train_set, self.micro_batch,
                                 seed=self.cfg.train.seed, epoch=epoch)

    def _resume(self) -> None:
        state = load_checkpoint(self.run_dir)
        if state is None:
            return
        self.net.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]

    def _save(self) -> None:
        if self.info.rank == 0:
            save_checkpoint(self.run_dir, {"model": self.net.state_dict(), "optimizer": self.optimizer.state_dict(),
                                           "step": self.step, "config": self.cfg.to_dict()})
        if self.info.world_size > 1:
            dist.barrier()

    def _header(self) -> None:
        info = self.info
        self.log.log(
            "header", schema_version=SCHEMA_VERSION, run_id=self.cfg.log.run_id, config=self.cfg.to_dict(),
            rank=info.rank, world_size=info.world_size, coords={"dp": info.rank, "pp": 0},
            sizes={"dp": info.world_size, "pp": 1}, restart=count_headers(rank_log_path(self.run_dir, info.rank)),
            host=socket.gethostname(), device=str(info.device),
            device_name=torch.cuda.get_device_name(info.device) if info.device.type == "cuda" else "cpu",
            torch_version=torch.__version__, transformers_version=transformers.__version__,
            git_commit=git_commit(), slurm=slurm_fields(), start_time=time.time(),
            tokenizer=self.tokenizer, vocab_size=self.vocab_size, launcher=info.launcher)

    def _batches(self, epoch: int, skip_steps: int) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
        """The epoch's optimizer steps, each a list of grad_accum micro-batches; resumed steps are skipped."""
        accum = self.cfg.train.grad_accum
        micro = iter(islice(self._loader(epoch), skip_steps * accum, self.steps_per_epoch * accum))
        while chunk := list(islice(micro, accum)):
            yield chunk

    def _sync_device(self) -> None:
        if self.info.device.type == "cuda":
            torch.cuda.synchronize(self.info.device)

    def _train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        t = self.cfg.train
        lr = learning_rate(self.step, t, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.net.train()
        total = 0.0
        for i, (x, y) in enumerate(micro_batches):
            with self.sync.accumulating(is_last_micro_step=i == len(micro_batches) - 1):
                logits = self.sync.module(x.to(self.net.input_device, non_blocking=True))
                loss = lm_loss(logits, y.to(logits.device, non_blocking=True)) / len(micro_batches)
                loss.backward()
            total += loss.item()
        self.sync.finish()
        params = [p for p in self.net.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip if t.grad_clip > 0 else math.inf)
        self.optimizer.step()
        self.sync.zero_grad()
        return total, float(grad_norm)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean validation loss over the first eval_batches of every rank's shard, averaged over ranks."""
        info = self.info
        batch = min(self.micro_batch, len(self.val_set) // info.world_size * info.world_size)
        if batch < info.world_size:
            return None
        self.net.eval()
        loader = partition_dataset(info.rank, info.world_size, self.val_set, batch, seed=0, epoch=0)
        losses = [lm_loss(logits := self.net(x.to(self.net.input_device)), y.to(logits.device)).item()
                  for x, y in islice(loader, self.cfg.train.eval_batches)]
        mean = torch.tensor([sum(losses) / len(losses)], dtype=torch.float64)
        if info.world_size > 1:
            mean = mean.to(info.device)
            dist.all_reduce(mean)
            mean /= info.world_size
        return float(mean.item())

    def _stop_requested(self) -> bool:
        """Preemption on any rank stops every rank at the same step."""
        flag = torch.tensor([1.0 if preemption_requested() else 0.0], device=self.info.device)
        if self.info.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def run(self) -> dict[str, Any]:
        cfg, info = self.cfg, self.info
        self._resume()
        self._header()
        progress = Progress(cfg, info.rank, self.total_steps, self.step)
        micro_tokens = self.micro_batch // info.world_size * cfg.data.seq_len
        status, loss = "completed", float("nan")
        try:
            while self.step < self.total_steps and status == "completed":
                epoch = self.step // self.steps_per_epoch
                epoch_start_step, epoch_time, epoch_rates = self.step, 0.0, []
                batches = self._batches(epoch, self.step - epoch * self.steps_per_epoch)
                while self.step < min(self.total_steps, (epoch + 1) * self.steps_per_epoch):
                    start = time.perf_counter()
                    micro_batches = next(batches)
                    data_time = time.perf_counter() - start
                    loss, grad_norm = self._train_step(micro_batches)
                    self._sync_device()
                    step_time = time.perf_counter() - start
                    self.step += 1
                    tokens = micro_tokens * len(micro_batches)
                    epoch_time += step_time
                    epoch_rates.append(tokens / step_time)
                    self.log.log("step", step=self.step, epoch=epoch, loss=loss,
                                 lr=self.optimizer.param_groups[0]["lr"], grad_norm=grad_norm, tokens=tokens,
                                 step_time_s=step_time, tokens_per_s=tokens / step_time, data_time_s=data_time,
                                 peak_mem_bytes=peak_memory_bytes(info.device), bubble=self.net.bubble)
                    progress.update(self.step, loss, tokens / step_time)
                    if cfg.train.eval_every and self.step % cfg.train.eval_every == 0:
                        val = self.evaluate()
                        self.log.log("eval", step=self.step, epoch=epoch, val_loss=val)
                        progress.message(f"step {self.step}: val_loss {val}")
                    if cfg.train.checkpoint_every and self.step % cfg.train.checkpoint_every == 0:
                        self._save()
                    if self._stop_requested():
                        status = "requeued"
                        break
                if status == "completed" and self.step > epoch_start_step:
                    val = self.evaluate()
                    self.log.log("epoch", epoch=epoch, training_time_s=epoch_time,
                                 tokens_per_s=sum(epoch_rates) / len(epoch_rates), val_loss=val,
                                 steps=self.step - epoch_start_step)
                    progress.message(f"epoch {epoch}: {epoch_time:.2f} s, val_loss {val}")
            self._save()
        except BaseException as exc:
            self.log.log("final", status="failed", step=self.step, error=f"{type(exc).__name__}: {exc}")
            raise
        finally:
            progress.close()
        self.log.log("final", status=status, step=self.step, loss=loss)
        self.log.close()
        if status == "requeued":
            if info.world_size > 1:
                dist.barrier()  # every rank's final record is on disk before SLURM kills the job
            if info.rank == 0:
                requeue_current_job()
        return {"status": status, "step": self.step, "loss": loss, "run_dir": str(self.run_dir)}


def train(cfg: Config) -> dict[str, Any]:
    """Train as one rank of the job described by the environment (a single process when there is none)."""
    install_preemption_handler()
    info = init_distributed(cfg.parallel)
    try:
        return Trainer(cfg, info).run()
    finally:
        destroy_distributed()


def _train_spawned_rank(info: RankInfo, cfg_dict: dict[str, Any]) -> None:
    train(config_from_dict(cfg_dict))


def run_training(cfg: Config) -> dict[str, Any]:
    """`gptpar train`: one rank under srun/torchrun, else spawn parallel.dp local ranks (or just train)."""
    if layout_from_env(os.environ).launcher != "single" or cfg.parallel.dp == 1:
        return train(cfg)
    cfg.log.run_id = cfg.log.run_id or new_run_id(cfg.log.name)
    spawn_local(_train_spawned_rank, cfg.parallel.dp, cfg.to_dict(), pcfg=cfg.parallel)
    run_dir = Path(cfg.log.runs_dir) / cfg.log.run_id
    return {"status": "completed", "run_dir": str(run_dir)}
