"""GPT-2 cut into stages on devices, run whole (`single`), layer-split (`model_parallel`) or as a
GPipe pipeline (`pipeline_parallel`).

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
import statistics
import time

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.modeling_outputs import CausalLMOutput

from gptpar.config import ParallelConfig
from gptpar.errors import GptparError
from gptpar.parallel.pipeline.one_process.pipe import ModelParallel, Pipe, micro_batch_size

# Attention implementations that apply the causal mask themselves when given no mask.
_IMPLICIT_CAUSAL = ("sdpa", "flash_attention_2", "flash_attention_3")


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


def stage_sizes(weights: list[int], n_stages: int, first: int = 0, last: int = 0) -> list[int]:
    """Contiguous blocks per stage (at least one each) minimising the heaviest stage's load.

    `first` and `last` are fixed loads of the first and last stage (embeddings, head).
    Among equally good cuts, earlier stages get more blocks: the last stage carries the LM head.
    """
    n_blocks = len(weights)
    prefix = [0, *itertools.accumulate(weights)]
    inf = float("inf")
    # best[s][k]: lowest possible heaviest load when the first s stages hold the first k blocks.
    best = [[inf] * (n_blocks + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n_blocks + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for s in range(1, n_stages + 1):
        fixed = (first if s == 1 else 0) + (last if s == n_stages else 0)
        for k in range(s, n_blocks - (n_stages - s) + 1):
            for a in range(k - 1, s - 2, -1):
                load = max(best[s - 1][a], prefix[k] - prefix[a] + fixed)
                if load < best[s][k]:
                    best[s][k], cut[s][k] = load, a
    sizes, k = [], n_blocks
    for s in range(n_stages, 0, -1):
        sizes.append(k - cut[s][k])
        k = cut[s][k]
    return sizes[::-1]


def _even_sizes(n_blocks: int, n_stages: int) -> list[int]:
    base, extra = divmod(n_blocks, n_stages)
    return [base + (i < extra) for i in range(n_stages)]


class Embedding(nn.Module):
    """Token plus position embeddings, then dropout, as GPT2Model does it."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.size(1), device=input_ids.device)
        return self.drop(self.wte(input_ids) + self.wpe(positions))


def causal_mask(hidden: torch.Tensor) -> torch.Tensor:
    """Additive (1, 1, T, T) mask hiding future positions, for attention that needs it explicit."""
    t = hidden.size(1)
    future = torch.ones(t, t, dtype=torch.bool, device=hidden.device).triu(1)
    mask = torch.zeros(t, t, dtype=hidden.dtype, device=hidden.device)
    return mask.masked_fill(future, torch.finfo(hidden.dtype).min)[None, None]


class Block(nn.Module):
    """A GPT2Block that carries hidden states only, whatever the transformers version returns."""

    def __init__(self, block: nn.Module, implicit_causal: bool) -> None:
        super().__init__()
        self.block, self.implicit_causal = block, implicit_causal

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        mask = None if self.implicit_causal else causal_mask(hidden)
        out = self.block(hidden, attention_mask=mask)
        return out[0] if isinstance(out, tuple) else out


class Head(nn.Module):
    """Final layer norm and LM head."""

    def __init__(self, ln_f: nn.Module, lm_head: nn.Linear) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))


def untie_lm_head(model: GPT2LMHeadModel) -> None:
    """Give the LM head its own copy of the embedding matrix (see the module docstring)."""
    wte = model.transformer.wte.weight
    head = nn.Parameter(wte.detach().clone())
    head.__dict__.update(wte.__dict__)  # what describes the tensor (a tensor-parallel piece's layout) holds for both
    model.lm_head.weight = head
    model.config.tie_word_embeddings = False


def _timed(fn) -> float:
    """Median seconds of a few calls (the first, which may allocate, left out)."""
    times = []
    for _ in range(4):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def measured_loads(model: GPT2LMHeadModel, sample: tuple[int, int], device: torch.device
                   ) -> tuple[float, float, float]:
    """Forward+backward seconds of the embeddings, one block and the final norm with LM head on a
    (micro-batch, seq_len) sample: GPT-2's blocks are all alike, so one block stands for each."""
    tr = model.transformer
    implicit = model.config._attn_implementation in _IMPLICIT_CAUSAL
    embed = Embedding(tr.wte, tr.wpe, tr.drop).to(device)
    block, head = Block(tr.h[0], implicit).to(device), Head(tr.ln_f, model.lm_head).to(device)
    ids = torch.zeros(sample, dtype=torch.long, device=device)
    hidden = torch.zeros(*sample, model.config.n_embd, device=device, requires_grad=True)

    def run(module: nn.Module, x: torch.Tensor) -> None:
        module(x).float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    loads = tuple(_timed(lambda m=m, x=x: run(m, x)) for m, x in ((embed, ids), (block, hidden), (head, hidden)))
    model.zero_grad(set_to_none=True)
    return loads


def balanced_sizes(model: GPT2LMHeadModel, n_stages: int, balance: str, separate_head: bool,
                   sample: tuple[int, int] = (1, 64), device: torch.device | None = None) -> list[int]:
    """Blocks per stage under parallel.balance: equal counts (`layers`), equal parameter counts
    (`params`, the head counted on the last stage when it is a copy of its own) or equal measured
    time (`time`, on `device` with a `sample` of (micro-batch, seq_len) tokens)."""
    tr = model.transformer
    blocks = list(tr.h)
    if balance == "params":
        numel = [sum(p.numel() for p in b.parameters()) for b in blocks]
        first = sum(p.numel() for p in (*tr.wte.parameters(), *tr.wpe.parameters()))
        last = sum(p.numel() for p in tr.ln_f.parameters()) + (model.lm_head.weight.numel() if separate_head else 0)
        return stage_sizes(numel, n_stages, first, last)
    if balance == "time":
        first, block, last = measured_loads(model, sample, device or torch.device("cpu"))
        return stage_sizes([block] * len(blocks), n_stages, first, last)
    return _even_sizes(len(blocks), n_stages)


def gpt2_stages(model: GPT2LMHeadModel, devices: list[torch.device], balance: str
                ) -> tuple[nn.Sequential, list[int]]:
    """The model as [Embedding, Block..., Head] placed on `devices`, and children per stage."""
    tr = model.transformer
    blocks, n = list(tr.h), len(devices)
    if n > len(blocks):
        raise GptparError(f"parallel.devices lists {n} stages but the model has only {len(blocks)} "
                          "transformer blocks; list at most that many devices")
    # A model staged before (the assignment's parallelize() then _prepare_pipeline_parallel()) is untied already.
    untie = devices[0] != devices[-1] and model.lm_head.weight is tr.wte.weight
    sizes = balanced_sizes(model, n, balance, untie, device=devices[0])
    implicit = model.config._attn_implementation in _IMPLICIT_CAUSAL
    children: list[nn.Module] = [Embedding(tr.wte, tr.wpe, tr.drop).to(devices[0])]
    starts = [0, *itertools.accumulate(sizes)]
    for dev, (a, b) in zip(devices, itertools.pairwise(starts), strict=True):
        children += [Block(block.to(dev), implicit) for block in blocks[a:b]]
    if untie:  # before moving the head, which would otherwise move wte's shared Parameter too
        untie_lm_head(model)
    children.append(Head(tr.ln_f, model.lm_head).to(devices[-1]))
    per_stage = list(sizes)
    per_stage[0] += 1
    per_stage[-1] += 1
    return nn.Sequential(*children), per_stage


class PipelineStage(nn.Module):
    """One stage of the multi-process pipeline: contiguous blocks, with the embeddings on the first
    stage and the final norm and LM head on the last. Blocks keep their model index in their names
    (`blocks.5.block...`), so checkpoint keys say which block a tensor belongs to."""

    def __init__(self, model: GPT2LMHeadModel, index: int, n_stages: int, first_block: int, n_blocks: int) -> None:
        super().__init__()
        tr = model.transformer
        implicit = model.config._attn_implementation in _IMPLICIT_CAUSAL
        self.index, self.is_first, self.is_last = index, index == 0, index == n_stages - 1
        self.embed = Embedding(tr.wte, tr.wpe, tr.drop) if self.is_first else None
        self.blocks = nn.ModuleDict({str(i): Block(tr.h[i], implicit)
                                     for i in range(first_block, first_block + n_blocks)})
        self.head = Head(tr.ln_f, model.lm_head) if self.is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x) if self.embed is not None else x
        for block in self.blocks.values():
            hidden = block(hidden)
        return self.head(hidden) if self.head is not None else hidden


def original_name(name: str) -> str:
    """The GPT2LMHeadModel name of a PipelineStage parameter (`blocks.5.block.attn.c_attn.weight` is
    `transformer.h.5.attn.c_attn.weight`), so a pipeline's stages can be compared with one model."""
    part, _, rest = name.partition(".")
    if part == "blocks":
        index, _, inner = rest.partition(".")
        return f"transformer.h.{index}.{inner.removeprefix('block.')}"
    return rest if rest.startswith("lm_head.") else f"transformer.{rest}"


def plain_gpt2_state(model_state: dict[str, torch.Tensor], vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """A checkpoint's model state under GPT2LMHeadModel's own names and shapes, whichever wrapper wrote it: the
    one-process `ParallelGPT2` (`model.` prefix) or the pipeline engine's stages (`stages.<s>.` and stage names);
    tensor parallelism's fused q, k, v columns stored as (in, 3, out) are flattened back and its padded vocabulary
    rows cut to `vocab_size`. The tied LM head appears as `lm_head.weight` beside `transformer.wte.weight`, as
    GPT2LMHeadModel.state_dict() has it."""
    plain = {}
    for key, value in model_state.items():
        name = original_name(key.split(".", 2)[2]) if key.startswith("stages.") else key.removeprefix("model.")
        if name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")) and value.dim() == 2 + name.endswith("weight"):
            value = value.flatten(-2)
        if vocab_size is not None and name in ("transformer.wte.weight", "lm_head.weight"):
            value = value[:vocab_size]
        plain[name] = value
    if "lm_head.weight" not in plain and "transformer.wte.weight" in plain:
        plain["lm_head.weight"] = plain["transformer.wte.weight"]
    return plain


def pipeline_stages(model: GPT2LMHeadModel, stage_ids: list[int], sizes: list[int]) -> list[PipelineStage]:
    """The listed stages of the model cut into len(sizes) stages of sizes[s] blocks. The LM head gets
    its own copy of the embedding matrix (the first and last stage live on different ranks; the
    engine sums the two copies' gradients every step, which keeps them equal)."""
    untie_lm_head(model)
    starts = [0, *itertools.accumulate(sizes)]
    return [PipelineStage(model, s, len(sizes), starts[s], sizes[s]) for s in stage_ids]


class ParallelGPT2(nn.Module):
    """`forward(input_ids) -> logits` in the configured `parallel.pp_mode`.

    Inputs go to `input_device`; logits come back on `output_device`. `single` runs on the first
    listed device, or on the rank's own device when none is listed. A pipeline cuts a batch into
    `parallel.chunks` micro-batches, or into micro-batches of `split_size` rows when one is given.
    """

    def __init__(self, model: GPT2LMHeadModel, pcfg: ParallelConfig, rank_device: torch.device,
                 split_size: int | None = None) -> None:
        super().__init__()
        devices = resolve_devices(pcfg.devices)  # checked even in single mode: a missing GPU is an error
        self.mode, self.chunks, self.split_size = pcfg.pp_mode, pcfg.chunks, split_size
        # Kept out of the module tree: the stages wrap its modules, which state_dict() would otherwise list twice.
        self.__dict__["gpt2"] = model
        if self.mode == "single":
            device = devices[0] if pcfg.devices.strip() else rank_device
            # A model still on the meta device (model.init_device=meta under fsdp) is materialised by its sync.
            self.model = model if next(model.parameters()).is_meta else model.to(device)
            self.input_device = self.output_device = device
            self.stage_devices = [device]
            return
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

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.mode == "single":
            return self.model(input_ids.to(self.input_device)).logits
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


def build_parallel_model(model: GPT2LMHeadModel, pcfg: ParallelConfig,
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
