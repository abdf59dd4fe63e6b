"""Training on a rank through the trainer's own step, for the equality tests of every parallelism.

Spawned ranks build a `Trainer` from a config, train a few steps with `Trainer.train_step` (the code
`gptpar train` runs) and save losses and parameters under their GPT2LMHeadModel names; `reference_run`
trains the same config as one process on the same global batch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from gptpar.config import Config, load_config, updated
from gptpar.parallel.dims import ParallelDims
from gptpar.parallel.grid import grid_sizes
from gptpar.parallel.process_group import RankInfo
from gptpar.parallel.tensor_parallel.state import whole
from gptpar.parallel.tensor_parallel.torch_plan import whole_parameters
from gptpar.run.folder import run_folder
from gptpar.run.logfile import RankLogger
from gptpar.train.checkpoint import load_checkpoint
from gptpar.train.entry import run_rank
from gptpar.train.step_records import read_now
from gptpar.train.trainer import Trainer

STEPS = 2
Regroup = Callable[[list], list]  # a step's micro-batches, recut
BASE = ["model.n_layer=4", "model.n_embd=32", "model.n_head=2", "data.seq_len=16", "data.source=synthetic",
        "data.vocab_size=300", "data.synthetic_tokens=20000", "train.batch_size=8", "train.warmup_steps=0",
        "train.lr=0.01", "train.grad_clip=0.5", "train.threads=1", "parallel.timeout_s=60"]
# vit-tiny (2 layers of width 64, 4 heads) on 80 images of the embedded set's 10 classes, with BASE's training.
VIT_BASE = ["model.preset=vit-tiny", "data.task=classify", "data.source=synthetic", "data.synthetic_images=80",
            "train.batch_size=8", "train.warmup_steps=0", "train.lr=0.01", "train.grad_clip=0.5", "train.threads=1",
            "parallel.timeout_s=60"]


def corpus_base(corpus: Path) -> list[str]:
    """BASE on the shared tinyshakespeare text where `corpus` is that file (a BPE of BASE's 300 symbols trained on
    its first 100,000 characters, so the model, its parameter count and every closed form are BASE's), else BASE
    itself (synthetic tokens)."""
    if not corpus.is_file():
        return BASE
    text = [f"data.source=text:{corpus}", "data.tokenizer=bpe", "data.max_chars=100000"]
    return [*(o for o in BASE if not o.startswith(("data.source=", "data.synthetic_tokens="))), *text]


def train_as_gptpar_does(info: RankInfo, overrides: list[str]) -> None:
    """What `gptpar train` runs on each rank (header, training, final record), for a test on the gloo pool."""
    run_rank(load_config(None, overrides))


def make_config(overrides: list[str], runs: Path, name: str, base: list[str] = BASE) -> Config:
    return load_config(None, [*base, *overrides, f"log.runs_dir={runs}", f"log.run_id={name}"])


def make_trainer(cfg: Config, info: RankInfo) -> Trainer:
    grid = ParallelDims.build(info, grid_sizes(cfg))
    folder = run_folder(cfg.log.runs_dir, cfg.log.run_id)
    folder.path.mkdir(parents=True, exist_ok=True)
    return Trainer(cfg, grid, folder, RankLogger(folder.path, info.rank))


def train_steps(trainer: Trainer, count: int, regroup: Regroup | None = None, records: list | None = None
                ) -> list[float]:
    """`count` steps; `regroup` recuts each step's micro-batches first; `records` gets each step's mixture fields
    (aux_loss, moe) as its record would hold them."""
    batches = trainer.batches(0, trainer.step)
    losses = []
    for _ in range(count):
        batch = next(batches)
        loss, _ = trainer.train_step(regroup(batch) if regroup is not None else batch)
        trainer.step += 1
        losses.append(float(loss))
        if records is not None:
            records.append(read_now(trainer.router_load.step_fields()))
    return losses


def as_pipeline_chunks(replicas: int, chunks: int) -> Regroup:
    """A step's global micro-batches recut as a pipeline's micro-batches fall on `replicas` data-parallel replicas
    cutting their shard into `chunks`: micro-batch j of a step holds every replica's chunk j. A mixture's
    load-balancing loss is a mean over micro-steps, which under the pipeline are its chunks (summed over replicas),
    so one process trained on these micro-batches is the pipeline's reference."""
    def regroup(batches: list) -> list:
        cut = [[[part.chunk(chunks) for part in tensor.chunk(replicas)] for tensor in batch] for batch in batches]
        return [tuple(torch.cat([parts[r][j] for r in range(replicas)]) for parts in tensors)
                for tensors in cut for j in range(chunks)]
    return regroup


def named_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    net = trainer.net
    if trainer.tp_group is not None and trainer.cfg.parallel.tp_impl == "torch":
        with trainer.sync.whole_parameters():
            return whole_parameters(net.model)
    params = net.original_parameters() if trainer.pipeline else {n.removeprefix("model."): p for n, p in
                                                                  net.named_parameters()}
    # A DTensor (FSDP2) is gathered whole, fsdp's units inside whole_parameters(), our tensor-parallel pieces from the
    # tp group, expert slices from the ep group: collectives, in the same order on every rank.
    experts = trainer.experts if trainer.experts is not None and trainer.experts.sharded else None
    slices = {id(p) for p in experts.params} if experts is not None else set()

    def made_whole(p: torch.Tensor) -> torch.Tensor:
        p = experts.whole(p) if id(p) in slices else p
        return whole(p.full_tensor() if isinstance(p, DTensor) else p, trainer.tp_group).clone()

    with trainer.sync.whole_parameters():
        return {n: made_whole(p) for n, p in params.items()}


def resumed_run(cfg: Config, info: RankInfo, before: int = 1, after: int = 1) -> dict:
    """`before` steps, a checkpoint, a new trainer loaded from it, `after` more steps: what a resume continues with
    (losses and parameters of the second trainer) and the parameters that were saved."""
    first = make_trainer(cfg, info)
    train_steps(first, before)
    first.checkpoints.save()
    saved = named_params(first)
    second = make_trainer(cfg, info)
    assert load_checkpoint(second.folder.path, {"trainer": second})
    return {"losses": train_steps(second, after), "params": named_params(second), "saved": saved}


def save_cases(info: RankInfo, runs: Path, cases: list[tuple[str, list[str]]], base: list[str] = BASE) -> None:
    """On each pool rank: train every case STEPS steps and save its losses, parameters, place and validation loss
    as `<runs>/<name>.rank<R>.pt`."""
    for name, overrides in cases:
        trainer = make_trainer(make_config(overrides, runs, name, base), info)
        record = {"losses": train_steps(trainer, STEPS), "params": named_params(trainer),
                  "coords": dict(trainer.dims.coords), "val": trainer.evaluate()}
        torch.save(record, runs / f"{name}.rank{info.rank}.pt")


def assert_trains_like_one_process(ref: dict, ranks: list[dict], token_table: str, name: str) -> None:
    """Each replica's mean loss and validation loss are the reference's (rel 1e-5), every parameter is the
    reference's on whichever rank holds it (a tied head under the token table's name), and ranks of one stage hold
    bitwise equal parameters."""
    for place in {(r["coords"]["pp"], r["coords"]["tp"]) for r in ranks}:  # each reports its replica's loss
        replicas = [r for r in ranks if (r["coords"]["pp"], r["coords"]["tp"]) == place]
        mean = [sum(losses) / len(replicas) for losses in zip(*(r["losses"] for r in replicas), strict=True)]
        assert mean == pytest.approx(ref["losses"], rel=1e-5)
        assert all(r["val"] == pytest.approx(ref["val"], rel=1e-5) for r in replicas)
    seen: set[str] = set()
    for rank in ranks:
        for param, value in rank["params"].items():
            expected = ref["params"].get(param, ref["params"][token_table] if param == "lm_head.weight" else None)
            # AdamW moves a weight whose gradient is near its eps (1e-8) by a step that rounding can change: an
            # element or two of a matrix lands 1e-4 off under tensor parallelism. A real error in a plan moves whole
            # rows by about lr (0.01), so all but a thousandth of the elements are held ten times tighter still.
            torch.testing.assert_close(value, expected, rtol=1e-4, atol=1e-3,
                                       msg=lambda m, p=param: f"{name}: {p}: {m}")
            assert ((value - expected).abs() > 1e-4).sum() <= max(2, value.numel() // 1000), param
            seen.add(param)
        same_stage = [r for r in ranks if r["coords"]["pp"] == rank["coords"]["pp"]]
        assert all(torch.equal(v, r["params"][p]) for r in same_stage for p, v in rank["params"].items())
    assert set(ref["params"]) <= seen  # every parameter lives on some rank


def saved_ranks(runs: Path, name: str) -> list[dict]:
    """What each spawned rank saved as `<runs>/<name>.rank<R>.pt`, in rank order."""
    return [torch.load(path, weights_only=False) for path in sorted(runs.glob(f"{name}.rank*.pt"))]


def assert_resumed_bitwise(runs: Path, name: str) -> None:
    """Run `resumed-<name>` (a step, a checkpoint, a new trainer, a step) logged the straight run's second loss and
    ends with its parameters, bit for bit, on every rank."""
    straight, resumed = saved_ranks(runs, name), saved_ranks(runs, f"resumed-{name}")
    for a, b in zip(straight, resumed, strict=True):
        assert b["losses"] == [a["losses"][1]]
        for param in a["params"]:
            assert torch.equal(a["params"][param], b["params"][param]), param


def reference_run(cfg: Config, regroup: Regroup | None = None) -> dict:
    """One process, the same config with one stage and one replica, the same global batch (recut by `regroup`); a
    mixture's step fields and the validation pass's scores (classify's accuracy) too."""
    single = updated(cfg, {"parallel.pp": 1, "parallel.dp": 1, "parallel.tp": 1, "parallel.ep": 1, "parallel.cp": 1,
                           "parallel.pp_virtual": 1,
                           "parallel.pp_split": "", "parallel.dp_sync": "bucketed", "parallel.param_comm": "fp32",
                           "parallel.hpz": False, "parallel.zero_stage": 2, "parallel.offload": "none",
                           "log.run_id": cfg.log.run_id + "-single"})
    info = RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="", master_port=0,
                    launcher="single", backend="gloo", device=torch.device("cpu"))
    trainer = make_trainer(single, info)
    records = [] if trainer.router_load is not None else None
    losses = train_steps(trainer, STEPS, regroup, records)
    val = trainer.evaluate()
    return {"losses": losses, "val": val, "params": named_params(trainer), "records": records,
            "scores": trainer.val_scores.scores()}
