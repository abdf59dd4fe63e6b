"""The plain path (ISSUE 47.3): a run without pp or tp builds its architecture's model and runs it whole on the
rank's device, with no one-process pipeline wrapper (`ParallelGPT2`, gptpar.parallel.pipeline.one_process) around
it; only parallel.pp_mode=model_parallel or pipeline_parallel builds that wrapper. One process, tiny models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rank_training import make_config, make_trainer, train_steps

from gptpar.errors import GptparError
from gptpar.parallel.pipeline.one_process.gpt2 import ParallelGPT2
from gptpar.parallel.placement import WholeModel
from gptpar.parallel.process_group import RankInfo

SINGLE = RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="", master_port=0,
                  launcher="single", backend="gloo", device=torch.device("cpu"))


@pytest.fixture
def wrappers_made(monkeypatch: pytest.MonkeyPatch) -> list[ParallelGPT2]:
    """Every ParallelGPT2 constructed while the test runs (its own __init__ still runs)."""
    made: list[ParallelGPT2] = []
    init = ParallelGPT2.__init__

    def counted(self: ParallelGPT2, *args: object, **kwargs: object) -> None:
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(ParallelGPT2, "__init__", counted)
    return made


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny", "qwen2-tiny"])
def test_a_run_without_pp_or_tp_never_builds_the_one_process_pipeline(
        tmp_path: Path, wrappers_made: list[ParallelGPT2], preset: str) -> None:
    trainer = make_trainer(make_config([f"model.preset={preset}", "model.n_layer=2"], tmp_path, preset), SINGLE)
    assert type(trainer.net) is WholeModel and trainer.sync.module is trainer.net
    assert all(name.startswith("model.") for name, _ in trainer.net.named_parameters())  # the checkpoint's names
    train_steps(trainer, 1)
    assert wrappers_made == []


def test_model_parallel_still_runs_in_the_one_process_wrapper(
        tmp_path: Path, wrappers_made: list[ParallelGPT2]) -> None:
    trainer = make_trainer(make_config(["parallel.pp_mode=model_parallel", "parallel.devices=cpu,cpu"], tmp_path,
                                       "mp"), SINGLE)
    assert type(trainer.net) is ParallelGPT2 and wrappers_made == [trainer.net]


def test_the_plain_path_still_checks_the_devices_it_is_given(tmp_path: Path) -> None:
    """parallel.devices is resolved on the plain path as in the one-process modes: a GPU that is not there is one
    line, not a model silently left on the CPU."""
    visible = torch.cuda.device_count()
    with pytest.raises(GptparError) as error:
        make_trainer(make_config([f"parallel.devices=cuda:{visible}"], tmp_path, "gpu"), SINGLE)
    assert str(error.value).startswith(f"parallel.devices='cuda:{visible}': cuda:{visible} is not visible")
