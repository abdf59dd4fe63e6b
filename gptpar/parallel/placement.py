"""Where a rank's model runs when nothing cuts it (parallel.pp = 1, parallel.tp = 1, parallel.pp_mode=single): the
plain path, whole on one device, with no one-process pipeline (gptpar.parallel.pipeline.one_process) around it.
`parallel.devices` is resolved here for every layout that reads it, so a listed GPU that is not there fails the same
way in each."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from gptpar.errors import GptparError
from gptpar.models import packed_attention


def resolve_devices(spec: str) -> list[torch.device]:
    """`parallel.devices` as torch devices; empty means every visible GPU, else one CPU."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if not names:
        return [torch.device("cuda", i) for i in range(visible)] or [torch.device("cpu")]
    devices = []
    for name in names:
        try:
            dev = torch.device(name)
        except RuntimeError:
            raise GptparError(f"parallel.devices={spec!r}: {name!r} is not a device; "
                              "use cpu or cuda:N") from None
        if dev.type == "cpu":
            devices.append(torch.device("cpu"))
        elif dev.type == "cuda":
            index = dev.index or 0
            if index >= visible:
                raise GptparError(f"parallel.devices={spec!r}: cuda:{index} is not visible "
                                  f"({visible} GPU{'s' if visible != 1 else ''} visible)")
            devices.append(torch.device("cuda", index))
        else:
            raise GptparError(f"parallel.devices={spec!r}: {name!r} is not supported; use cpu or cuda:N")
    return devices


def whole_device(devices: str, rank_device: torch.device) -> torch.device:
    """The device a whole model runs on: the first that parallel.devices lists, else the rank's own (the list is
    checked even so: a missing GPU is an error)."""
    listed = resolve_devices(devices)
    return listed[0] if devices.strip() else rank_device


def place(model: PreTrainedModel, device: torch.device) -> PreTrainedModel:
    """`model` on `device`; one still on the meta device (model.init_device=meta under fsdp) stays there, for its
    data-parallel strategy to materialise."""
    return model if next(model.parameters()).is_meta else model.to(device)


def logits(model: PreTrainedModel, device: torch.device, input_ids: torch.Tensor,
           positions: torch.Tensor | None = None) -> torch.Tensor:
    """The whole model's logits of `input_ids` moved to `device`; `positions`: the position ids of packed rows
    (data.packing), which also mask attention between their examples."""
    if positions is None:
        return model(input_ids.to(device)).logits
    positions = positions.to(device)
    return model(input_ids.to(device), position_ids=positions, attention_mask=packed_attention(positions)).logits


class WholeModel(nn.Module):
    """`forward(input_ids, positions=None) -> logits` of the whole model on one device (`whole_device`).
    Parameters are named `model.<the model's name>`, as every wrapper of the trainer names them."""

    def __init__(self, model: PreTrainedModel, devices: str, rank_device: torch.device):
        super().__init__()
        device = whole_device(devices, rank_device)
        self.model = place(model, device)
        self.input_device = self.output_device = device
        self.stage_devices = [device]
        self.bubble = None

    def original_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters under the model's own names (the gradient dump's names)."""
        return dict(self.model.named_parameters())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return logits(self.model, self.input_device, input_ids, positions)
