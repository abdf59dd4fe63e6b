"""GPT-2 in one process: cut into stages on devices, run whole (`single`), layer-split (`model_parallel`) or
as a GPipe pipeline (`pipeline_parallel`).

The stages wrap the original model's submodules, so its parameters stay the same objects and
`model.state_dict()` of the original GPT2LMHeadModel remains the checkpoint format.

Tied LM head: GPT-2 shares one matrix between `wte` (first device) and `lm_head` (last device).
When both land on the same device (one device, or e.g. `cpu,cpu`) the head keeps that very
Parameter and the tie holds exactly. When the devices differ the head is *untied on purpose*:
it gets its own Parameter, a copy of `wte` on the last device, and `config.tie_word_embeddings`
is set to False so transformers never re-ties it. Logits are unchanged at that moment; from then
on the two matrices train separately (each gets only its own gradient). Copying the matrix
across devices on every step to keep the tie would cost a vocab x width transfer each way.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from gptpar.config import ParallelConfig
from gptpar.errors import GptparError
from gptpar.models import architecture
from gptpar.parallel.pipeline.cuts import balanced_sizes, untie_lm_head
from gptpar.parallel.pipeline.one_process.pipe import ModelParallel, Pipe, micro_batch_size
from gptpar.parallel.placement import logits, place, resolve_devices, whole_device


def gpt2_stages(model: PreTrainedModel, devices: list[torch.device], balance: str
                ) -> tuple[nn.Sequential, list[int]]:
    """The model as the architecture's [embedding, block..., head] pieces placed on `devices`, and children per
    stage."""
    arch = architecture(model)
    blocks, n = list(arch.blocks(model)), len(devices)
    if n > len(blocks):
        raise GptparError(f"parallel.devices lists {n} stages but the model has only {len(blocks)} "
                          "transformer blocks; list at most that many devices")
    # A model staged before (the assignment's parallelize() then _prepare_pipeline_parallel()) is untied already.
    untie = devices[0] != devices[-1] and model.lm_head.weight is arch.token_embedding(model).weight
    sizes = balanced_sizes(model, n, balance, untie, device=devices[0])
    children: list[nn.Module] = [arch.embed_piece(model).to(devices[0])]
    starts = [0, *itertools.accumulate(sizes)]
    for dev, (a, b) in zip(devices, itertools.pairwise(starts), strict=True):
        children += [arch.block_piece(model, i).to(dev) for i in range(a, b)]
    if untie:  # before moving the head, which would otherwise move the token table's shared Parameter too
        untie_lm_head(model)
    children.append(arch.head_piece(model).to(devices[-1]))
    per_stage = list(sizes)
    per_stage[0] += 1
    per_stage[-1] += 1
    return nn.Sequential(*children), per_stage


class ParallelGPT2(nn.Module):
    """`forward(input_ids) -> logits` in the configured `parallel.pp_mode`.

    Inputs go to `input_device`; logits come back on `output_device`. `single` runs on the first
    listed device, or on the rank's own device when none is listed. A pipeline cuts a batch into
    `parallel.chunks` micro-batches, or into micro-batches of `split_size` rows when one is given.
    """

    def __init__(self, model: PreTrainedModel, pcfg: ParallelConfig, rank_device: torch.device,
                 split_size: int | None = None) -> None:
        super().__init__()
        self.mode, self.chunks, self.split_size = pcfg.pp_mode, pcfg.chunks, split_size
        # Kept out of the module tree: the stages wrap its modules, which state_dict() would otherwise list twice.
        self.__dict__["gpt2"] = model
        if self.mode == "single":
            device = whole_device(pcfg.devices, rank_device)
            self.model = place(model, device)
            self.input_device = self.output_device = device
            self.stage_devices = [device]
            return
        devices = resolve_devices(pcfg.devices)
        seq, per_stage = gpt2_stages(model, devices, pcfg.balance)
        if self.mode == "pipeline_parallel":
            rows = 1 if split_size is None else split_size  # None: forward passes each batch's own
            self.runner: nn.Module = Pipe(seq, split_size=rows, balance=per_stage)
        else:
            self.runner = ModelParallel(seq, balance=per_stage)
        self.input_device, self.output_device = devices[0], devices[-1]
        self.stage_devices = devices

    @property
    def bubble(self) -> float | None:
        """Mean idle share of the pipeline workers in the last forward (None outside pipeline mode)."""
        stats = getattr(self.runner, "stats", None) if self.mode == "pipeline_parallel" else None
        return sum(stats.bubble) / len(stats.bubble) if stats else None

    def original_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters under their GPT2LMHeadModel names in every mode (an untied head's copy as lm_head.weight),
        as the multi-process engine's `original_parameters()` gives them."""
        return dict(self.gpt2.named_parameters())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """`positions`: the position ids of packed rows (data.packing, single mode only), which also mask attention
        between their examples."""
        if self.mode == "single":
            return logits(self.model, self.input_device, input_ids, positions)
        if self.mode == "pipeline_parallel":
            rows = micro_batch_size(input_ids.size(0), self.chunks) if self.split_size is None else None
            return self.runner(input_ids, split_size=rows)  # None: the Pipe's own split_size
        return self.runner(input_ids)


class GPT2LMHeadModelParallel(nn.Module):
    """The assignment's `GPT2LMHeadModelParallel` over transformers' GPT-2, for code written against it.

    The model runs whole on the first of `devices` (empty: every visible GPU, else the CPU) until
    `parallelize()` spreads its blocks over them (the whole batch visits the stages in turn) or
    `_prepare_pipeline_parallel(split_size)` runs them as a GPipe pipeline on micro-batches of
    `split_size` rows; both are `ParallelGPT2`'s modes. Unlike the assignment's, whose pipeline
    holds the blocks only, the stages hold the embeddings and the LM head too, so there is no
    headless twin: `GPT2ModelParallel` names this class, and forward returns the LM's output
    (`.logits`). The GPT2LMHeadModel is `self.model`, so state_dict() keeps GPT-2's own keys.
    """

    def __init__(self, config: GPT2Config | GPT2LMHeadModel, devices: str = "") -> None:
        super().__init__()
        self.model = config if isinstance(config, GPT2LMHeadModel) else GPT2LMHeadModel(config)
        self.devices = devices
        self._run_as("single")

    def _run_as(self, mode: str, split_size: int | None = None) -> None:
        net = ParallelGPT2(self.model, ParallelConfig(pp_mode=mode, devices=self.devices),
                           resolve_devices(self.devices)[0], split_size)
        self.__dict__["net"] = net  # out of the module tree: its stages are self.model's own modules

    @property
    def pipeline_parallel(self) -> bool:
        return self.net.mode == "pipeline_parallel"

    def parallelize(self) -> None:
        """Model parallelism: the blocks spread over the devices, the whole batch visiting them in turn."""
        self._run_as("model_parallel")

    def _prepare_pipeline_parallel(self, split_size: int = 1) -> None:
        """Pipeline parallelism: the same stages, fed micro-batches of `split_size` rows."""
        self._run_as("pipeline_parallel", split_size)

    def forward(self, input_ids: torch.Tensor) -> CausalLMOutput:
        return CausalLMOutput(logits=self.net(input_ids))


GPT2ModelParallel = GPT2LMHeadModelParallel  # the assignment's name (see the class docstring)


def build_parallel_model(model: PreTrainedModel, pcfg: ParallelConfig,
                         rank_device: torch.device | None = None) -> ParallelGPT2:
    return ParallelGPT2(model, pcfg, rank_device or torch.device("cpu"))


def _unwrap(module: nn.Module) -> nn.Module:
    """Look through wrappers such as DistributedDataParallel."""
    while not hasattr(module, "input_device") and hasattr(module, "module"):
        module = module.module
    return module


def input_device(module: nn.Module) -> torch.device:
    return _unwrap(module).input_device


def output_device(module: nn.Module) -> torch.device:
    return _unwrap(module).output_device
