"""DCP checkpoints: exact round trips, atomic replacement, recovery from a killed swap, one-line errors, export,
a checkpoint that would run code refused without running it, and a two-rank gloo save/load."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from gloo_pool import GlooPools
from hostile_pickle import CALLED, RunsCode
from logsets import Rank, config
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gptpar.cli import main
from gptpar.errors import GptparError
from gptpar.parallel.process_group import RankInfo
from gptpar.run.folder import EXPORT_FILE
from gptpar.train.checkpoint import (
    CHECKPOINT_DIR,
    checkpoint_dir,
    export_checkpoint,
    load_checkpoint,
    load_model_state,
    model_state,
    save_checkpoint,
)


class TrainState:
    """What the trainer will pass: model, optimizer and a plain step counter behind one state_dict()."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int = 0) -> None:
        self.model, self.optimizer, self.step = model, optimizer, step

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = model_state(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        load_model_state(self.model, self.optimizer, sd["model"], sd["optim"])
        self.step = sd["step"]


def build(seed: int, steps: int = 1) -> TrainState:
    """A tiny model and AdamW after `steps` steps, so the optimizer has state worth checking."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.randn(3, 8)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return TrainState(model, optimizer, step=steps)


def assert_same(a: TrainState, b: TrainState) -> None:
    assert a.step == b.step
    for (name, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for index, state in sa["state"].items():
        for key, value in state.items():
            assert torch.equal(value, sb["state"][index][key]), (index, key)


def test_round_trip_into_fresh_model(tmp_path: Path) -> None:
    saved = build(seed=0)
    saved.step = 7
    fresh = build(seed=1, steps=0)
    assert not load_checkpoint(tmp_path, {"train": fresh})
    assert save_checkpoint(tmp_path, {"train": saved}) == checkpoint_dir(tmp_path)
    assert load_checkpoint(tmp_path, {"train": fresh})
    assert_same(saved, fresh)
    assert fresh.step == 7


def test_optimizer_state_loads_into_a_model_whose_gradients_already_exist(tmp_path: Path) -> None:
    """The bucketed reducer keeps every .grad as a view of its buckets from the start; torch would then skip
    creating the fresh optimizer's state and silently load none of it."""
    saved = build(seed=0)
    save_checkpoint(tmp_path, {"train": saved})
    fresh = build(seed=1, steps=0)
    views = [torch.zeros_like(p) for p in fresh.model.parameters()]
    for p, view in zip(fresh.model.parameters(), views, strict=True):
        p.grad = view
    assert load_checkpoint(tmp_path, {"train": fresh})
    assert_same(saved, fresh)
    assert all(p.grad is view for p, view in zip(fresh.model.parameters(), views, strict=True))


def test_second_save_replaces_first(tmp_path: Path) -> None:
    state = build(seed=0)
    save_checkpoint(tmp_path, {"train": state})
    newer = build(seed=0, steps=2)
    save_checkpoint(tmp_path, {"train": newer})
    assert os.listdir(tmp_path) == [CHECKPOINT_DIR]
    loaded = build(seed=1, steps=0)
    load_checkpoint(tmp_path, {"train": loaded})
    assert_same(newer, loaded)


def test_interrupted_swap_loads_old_and_next_save_recovers(tmp_path: Path) -> None:
    saved = build(seed=0)
    save_checkpoint(tmp_path, {"train": saved})
    checkpoint_dir(tmp_path).rename(tmp_path / f"{CHECKPOINT_DIR}.old")  # killed after the first rename
    (tmp_path / f"{CHECKPOINT_DIR}.tmp").mkdir()  # and a stale half-written save beside it
    loaded = build(seed=1, steps=0)
    assert load_checkpoint(tmp_path, {"train": loaded})
    assert_same(saved, loaded)
    save_checkpoint(tmp_path, {"train": loaded})
    assert os.listdir(tmp_path) == [CHECKPOINT_DIR]


@pytest.mark.parametrize("damage", ["random metadata", "empty folder"])
def test_corrupt_checkpoint_is_one_line_error(tmp_path: Path, damage: str) -> None:
    folder = checkpoint_dir(tmp_path)
    if damage == "empty folder":
        folder.mkdir()
    else:
        save_checkpoint(tmp_path, {"train": build(seed=0)})
        (folder / ".metadata").write_bytes(torch.randint(0, 256, (256,), generator=torch.Generator().manual_seed(0),
                                                         dtype=torch.uint8).numpy().tobytes())
    with pytest.raises(GptparError) as err:
        load_checkpoint(tmp_path, {"train": build(seed=1, steps=0)})
    message = str(err.value)
    assert "\n" not in message and str(folder) in message and "delete" in message


def test_export_is_one_plain_file(tmp_path: Path) -> None:
    saved = build(seed=0)
    save_checkpoint(tmp_path, {"train": saved, "seed": 1234})
    out = export_checkpoint(tmp_path, tmp_path / "export" / "model.pt")
    exported = torch.load(out, weights_only=False)
    assert exported["seed"] == 1234 and exported["train"]["step"] == 1
    model = saved.model.state_dict()
    assert exported["train"]["model"].keys() == model.keys()
    assert all(torch.equal(exported["train"]["model"][k], v) for k, v in model.items())


REFUSAL = ("refused to load{value}: it names " + CALLED + ", which a checkpoint never holds; gptpar did not write this "
           "file as it is (loading it could run code): do not use this folder")


def _hostile_checkpoint(run_dir: Path, where: str, marker: Path) -> tuple[Path, str]:
    """A real checkpoint holding a pickle that creates `marker` when unpickled without restriction: in its index
    (`.metadata`) among DCP's own records, or as a non-tensor value saved beside the model. Returns the file the
    refusal must name and what it must say."""
    if where == "value":
        save_checkpoint(run_dir, {"train": build(seed=0), "extra": RunsCode(marker)})
        return checkpoint_dir(run_dir) / "__0_0.distcp", REFUSAL.format(value=" the value of extra")
    save_checkpoint(run_dir, {"train": build(seed=0)})
    index = checkpoint_dir(run_dir) / ".metadata"
    metadata = pickle.loads(index.read_bytes())  # written by this test: trusted
    metadata.planner_data["extra"] = RunsCode(marker)
    index.write_bytes(pickle.dumps(metadata))
    return index, REFUSAL.format(value="")


@pytest.mark.parametrize("where", ["index", "value"])
@pytest.mark.parametrize("reader", ["resume", "export"])
def test_a_checkpoint_that_would_run_code_is_refused_in_one_line_and_runs_none(tmp_path: Path, where: str,
                                                                               reader: str) -> None:
    """Resuming (load_checkpoint, as `gptpar train` does) and `gptpar checkpoint export` read a copied run folder."""
    marker = tmp_path / "MARK"
    file, message = _hostile_checkpoint(tmp_path / "run", where, marker)
    with pytest.raises(GptparError) as err:
        if reader == "resume":
            load_checkpoint(tmp_path / "run", {"train": build(seed=1, steps=0), "extra": None})
        else:
            export_checkpoint(tmp_path / "run", tmp_path / "whole.pt")
    assert not marker.exists()  # nothing the file names ran
    assert str(err.value) == f"{file}: {message}"


@pytest.mark.parametrize("out, entry", [
    ("r/checkpoint/__0_0.distcp", "r/checkpoint"),  # the checkpoint being read
    ("r/rank0.jsonl", "r/rank0.jsonl"), ("r/config.yaml", "r/config.yaml"),  # the run would vanish from status
    ("log-link", "r/rank0.jsonl"),  # a link is followed to what it names
    ("r/checkpoint/../config.yaml", "r/config.yaml"),
    ("other/config.yaml", "other/config.yaml"),  # another run's file
    ("other/job/x.pt", "other/job"),
])
def test_export_never_writes_over_a_run_folders_files(tmp_path: Path, capsys: pytest.CaptureFixture, out: str,
                                                      entry: str) -> None:
    """Issue 46 point 2: `--out` naming a file a run folder keeps (or a path inside one) is one line, and every
    file of the runs is left as it was; the default, RUN/checkpoint.pt beside the checkpoint, is still written."""
    runs = tmp_path / "runs"
    for name in ("r", "other"):
        Rank(runs / name, 0, config()).header().step(1).final("stopped", step=1)
        (runs / name / "config.yaml").write_text(yaml.safe_dump(config()))
    save_checkpoint(runs / "r", {"w": torch.arange(4.0), "step": 1})
    (runs / "log-link").symlink_to(runs / "r" / "rank0.jsonl")
    before = {p: p.read_bytes() for p in runs.rglob("*") if p.is_file()}
    assert main(["checkpoint", "export", str(runs / "r"), "--out", str(runs / out)]) == 2
    assert capsys.readouterr().err == (
        f"gptpar: error: --out {str(runs / out)!r} would write over {runs / entry}, which run folder "
        f"{(runs / entry).parent} keeps for its run; write the export outside it, or as {runs / 'r' / EXPORT_FILE} "
        "(the default)\n")
    assert {p: p.read_bytes() for p in runs.rglob("*") if p.is_file()} == before
    assert main(["checkpoint", "export", str(runs / "r")]) == 0
    assert torch.load(runs / "r" / EXPORT_FILE)["step"] == 1


def _two_rank_save_load(info: RankInfo, run_dir: Path) -> None:
    """Save a DDP-wrapped replica, scramble it differently per rank, load, and record what each rank holds."""
    state = build(seed=0)
    state.model = DistributedDataParallel(state.model)
    save_checkpoint(run_dir, {"train": state})
    with torch.no_grad():
        for param in state.model.parameters():
            param.fill_(100.0 + info.rank)
    state.step = -1
    assert load_checkpoint(run_dir, {"train": state})
    torch.save({"step": state.step, "model": state.model.module.state_dict()}, run_dir / f"rank{info.rank}.pt")


@pytest.mark.slow
def test_two_gloo_ranks_save_and_load(tmp_path: Path, gloo_pool: GlooPools) -> None:
    gloo_pool.run(2, _two_rank_save_load, tmp_path)
    expected = build(seed=0)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["step"] == 1, rank
        assert all(torch.equal(got["model"][k], v) for k, v in expected.model.state_dict().items()), rank
    assert sorted(os.listdir(tmp_path)) == [CHECKPOINT_DIR, "rank0.pt", "rank1.pt"]
    plain = build(seed=1, steps=0)  # names are fully qualified: a DDP checkpoint loads into a plain module
    assert load_checkpoint(tmp_path, {"train": plain})
    assert_same(expected, plain)
