"""gptpar.train.reshard on real checkpoint folders, in one process: pieces keyed by parameter and range load into
whole tensors and into other ranges, and a checkpoint that does not cover what a layout holds is one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gptpar.errors import GptparError
from gptpar.train.checkpoint import load_checkpoint, save_checkpoint

WHOLE = torch.arange(6.0).view(2, 3)  # one parameter's value (and, times 10, its exp_avg)


def _pieces(cuts: list[tuple[int, int]]) -> dict:
    """A sharding sync's checkpoint of WHOLE: its pieces [start:end) of the flattened parameter and their state."""
    flat = WHOLE.flatten()
    return {"trainer": {"model": {"pieces": {f"w[{a}:{b}]": flat[a:b].clone() for a, b in cuts}},
                        "optimizer": {f"w[{a}:{b}]": {"exp_avg": 10 * flat[a:b], "step": torch.tensor(3.0)}
                                      for a, b in cuts},
                        "step": 7}}


def test_pieces_load_into_whole_tensors_and_into_other_ranges(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, _pieces([(0, 4), (4, 6)]))  # zero2 on 2 ranks wrote it
    whole = {"trainer": {"model": {"w": torch.zeros(2, 3)}, "step": 0,
                         "optimizer": {"state": {"w": {"exp_avg": torch.zeros(2, 3), "step": torch.tensor(0.0)}}}}}
    assert load_checkpoint(tmp_path, whole)  # a replicating sync reads it
    trainer = whole["trainer"]
    assert torch.equal(trainer["model"]["w"], WHOLE) and torch.equal(trainer["optimizer"]["state"]["w"]["exp_avg"],
                                                                     10 * WHOLE)
    assert trainer["optimizer"]["state"]["w"]["step"] == 3 and trainer["step"] == 7
    other = {"trainer": {"model": {"pieces": {"w[3:5]": torch.zeros(2)}}, "step": 0,
                         "optimizer": {"w[3:5]": {"exp_avg": torch.zeros(2), "step": torch.tensor(0.0)}}}}
    assert load_checkpoint(tmp_path, other)  # a rank of another world size, whose piece spans both stored ones
    assert other["trainer"]["model"]["pieces"]["w[3:5]"].tolist() == [3.0, 4.0]
    assert other["trainer"]["optimizer"]["w[3:5]"]["exp_avg"].tolist() == [30.0, 40.0]


def test_a_checkpoint_that_misses_part_of_a_tensor_is_one_line(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, _pieces([(0, 4)]))  # the piece [4:6) is lost
    whole = {"trainer": {"model": {"w": torch.zeros(2, 3)}, "step": 0,
                         "optimizer": {"state": {"w": {"exp_avg": torch.zeros(2, 3), "step": torch.tensor(0.0)}}}}}
    with pytest.raises(GptparError) as exc:
        load_checkpoint(tmp_path, whole)
    assert str(exc.value) == (f"cannot load checkpoint {tmp_path / 'checkpoint'} into this layout: it holds 4 of the "
                              "6 values of trainer.model.w")
