"""GPT-2 tensor-parallel with PyTorch's own API (`parallel.tp_impl=torch`): the reference for gptpar's layers.

The same plan as gptpar/parallel/tensor_parallel/gpt2.py, written the way torchtitan writes its llama plan
(`parallelize_module` with `ColwiseParallel`, `RowwiseParallel`, `SequenceParallel`, `PrepareModuleInput`), so
the two implementations can be checked against each other and timed side by side. torch's styles accept only
nn.Linear and nn.Embedding, so `parallelize_gpt2` first rewrites GPT-2's modules, under names close to its own:

    Conv1D (weight in x out)  -> nn.Linear (weight out x in, transposed);
    attn.c_attn (fused q,k,v) -> `QKV` with three nn.Linear children q, k, v (`attn.c_attn.q.weight`), each
                                 column-parallel, so every rank holds the same heads of q, k and v;
    GPT2Attention            -> `TorchAttention`: causal sdpa on this rank's n_head / T heads, c_proj row-parallel;
    GPT2Block                -> `TorchBlock`: hidden in, hidden out, so `tensor_parallel_forward` runs it unchanged.

The residual stream between blocks is a plain local tensor (whole, or this rank's sequence shard with sequence
parallelism); each attention and MLP turns it into a replicated DTensor once (`PrepareModuleInput`), so the
backward sums q's, k's and v's input gradients before the one all-reduce (reduce-scatter with SP) instead of
three. Every parameter ends up a DTensor (sharded, or replicated via `distribute_module`): `clip_grad_norm_`
(gptpar.train.optim.clip_gradients without a group) rejects DTensors and plain tensors mixed ("aten._foreach_norm
got mixed torch.Tensor and DTensor"), and with one kind it returns the global norm. Every gradient ends up with
its parameter's placements (`_grad_like_param`).

Vocabulary: the token table, built padded to a multiple of T (gptpar.models.build.build_model), is split by rows
(`RowwiseParallel` on the Embedding: out-of-range tokens masked, partial sums all-reduced, or reduce-scattered
into sequence shards with SP). The LM head is the same DTensor Parameter (the tie is restored after
`parallelize_module`, which wraps every parameter anew), column-parallel on the vocabulary; its output is the whole
logits trimmed to the real vocabulary, or with loss parallelism a DTensor sharded on the vocabulary whose padded
columns are -inf, for `torch.distributed.tensor.parallel.loss_parallel` (which must wrap forward and backward).

Positions (SP): GPT-2 adds a learned position table to the token embeddings. The token embedding is
reduce-scattered straight into sequence shards (as gptpar does, half an all-reduce), and the replicated position
table returns the rows of this rank's sequence shard (Replicate -> Shard(0) of its (seq, hidden) output, a local
slice forward, an all-gather of its gradient backward), so their sum is already this rank's shard.

Dropout draws from torch's default generator: replicated activations get the same mask on every rank (as they
must); sharded ones (attention heads, and the sequence shards with SP) get masks correlated across ranks (the same
stream, different elements). torch's DTensor RNG tracker, which would decorrelate them, covers only random ops on
DTensors, on CUDA-like devices; this reference keeps the default, and the equality tests run without dropout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from transformers import GPT2LMHeadModel, PreTrainedModel

from gptpar.errors import GptparError
from gptpar.models.build import tokenizer_vocab
from gptpar.models.loss import lm_loss
from gptpar.parallel.tensor_parallel.layers import check_vocab_split


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear holding a Conv1D's weight (in x out) transposed; built on meta, so no init draws the RNG."""
    with torch.device("meta"):
        linear = nn.Linear(weight.size(0), weight.size(1), bias=bias is not None)
    linear.weight = nn.Parameter(weight.detach().t().contiguous())
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach().clone())
    return linear


class QKV(nn.Module):
    """GPT-2's fused c_attn as three Linear layers q, k, v (columns [0, n), [n, 2n), [2n, 3n) of the Conv1D)."""

    def __init__(self, conv: nn.Module):
        super().__init__()
        n = conv.weight.size(1) // 3
        self.q, self.k, self.v = (_linear(conv.weight[:, i * n:(i + 1) * n], conv.bias[i * n:(i + 1) * n])
                                  for i in range(3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.q(x), self.k(x), self.v(x)


class TorchAttention(nn.Module):
    """Causal self-attention on `heads` heads (this rank's, once parallelized), then c_proj and residual dropout."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.c_attn = QKV(attn.c_attn)
        self.c_proj = _linear(attn.c_proj.weight, attn.c_proj.bias)
        self.heads, self.head_dim = attn.num_heads, attn.head_dim
        self.attn_p = attn.attn_dropout.p
        self.resid_dropout = attn.resid_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x)
        b, s = q.shape[:2]
        q, k, v = (t.view(b, s, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_p if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)))


class TorchBlock(nn.Module):
    """A GPT2Block that takes and returns hidden states only (the residual stream as plain local tensors)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.ln_1 = block.ln_1  # GPT2Block's order, so parameters list in GPT-2's order
        self.attn = TorchAttention(block.attn)
        self.ln_2 = block.ln_2
        self.mlp = block.mlp  # GPT2MLP calls c_fc, act, c_proj, dropout as modules: Linear in place of Conv1D
        self.mlp.c_fc = _linear(block.mlp.c_fc.weight, block.mlp.c_fc.bias)
        self.mlp.c_proj = _linear(block.mlp.c_proj.weight, block.mlp.c_proj.bias)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden))
        return hidden + self.mlp(self.ln_2(hidden))


def _replicate(module: nn.Module, mesh: DeviceMesh, output: Placement = Replicate()) -> None:
    """Make `module`'s parameters replicated DTensors; its tensor inputs are taken as replicated and its output
    is returned as a local tensor after redistributing it to `output` (Shard(d): this rank's slice)."""
    def inputs(_mod: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                     if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a for a in args)

    def outputs(_mod: nn.Module, out: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        return out.redistribute(placements=[output]).to_local()

    distribute_module(module, mesh, None, inputs, outputs)


def _trim_vocab(vocab: int) -> Callable[[nn.Module, tuple, torch.Tensor], torch.Tensor]:
    """A forward hook keeping the real vocabulary's columns of the whole logits."""
    return lambda _mod, _args, logits: logits[..., :vocab]


def _mask_padding(vocab: int, mesh: DeviceMesh) -> Callable[[nn.Module, tuple, DTensor], DTensor]:
    """A forward hook adding -inf to the padded columns of vocabulary-sharded logits (a DTensor with the same
    sharding), so that loss_parallel's softmax gives them no mass."""
    def hook(mod: nn.Module, _args: tuple, logits: DTensor) -> DTensor:
        mask = torch.zeros(mod.out_features, dtype=logits.dtype, device=logits.device)
        mask[vocab:] = float("-inf")
        return logits + distribute_tensor(mask, mesh, [Shard(0)], src_data_rank=None)
    return hook


def parallelize_gpt2(model: GPT2LMHeadModel, mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool
                     ) -> GPT2LMHeadModel:
    """Convert `model` in place to this rank's tensor-parallel pieces over the 1-D `mesh` (see the module
    docstring); `tensor_parallel_forward` runs it. The model must be whole and equal on every rank of the mesh."""
    size = mesh.size()
    tr, cfg = model.transformer, model.config
    if cfg.n_head % size:
        raise GptparError(f"model.n_head={cfg.n_head} must divide by parallel.tp={size}")
    residual = Shard(1) if sequence_parallel else Replicate()

    check_vocab_split(tr.wte.num_embeddings, size)
    vocab = tokenizer_vocab(cfg)
    with torch.device("meta"):  # a plain Linear (not gptpar's PaddedHead): the hooks below mask or trim the padding
        model.lm_head = nn.Linear(cfg.n_embd, tr.wte.num_embeddings, bias=False)
    model.lm_head.weight = tr.wte.weight
    for i, block in enumerate(tr.h):
        tr.h[i] = TorchBlock(block)
        tr.h[i].attn.heads //= size

    block_plan = {
        "attn": PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),)),
        "attn.c_attn.q": ColwiseParallel(),
        "attn.c_attn.k": ColwiseParallel(),
        "attn.c_attn.v": ColwiseParallel(),
        "attn.c_proj": RowwiseParallel(output_layouts=residual),
        "mlp": PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),)),
        "mlp.c_fc": ColwiseParallel(),
        "mlp.c_proj": RowwiseParallel(output_layouts=residual),
    }
    if sequence_parallel:
        block_plan |= {"ln_1": SequenceParallel(), "ln_2": SequenceParallel()}
    for block in tr.h:
        parallelize_module(block, mesh, block_plan)

    head = ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                           use_local_output=not loss_parallel)
    parallelize_module(model, mesh, {
        "transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "lm_head": head,
        **({"transformer.ln_f": SequenceParallel()} if sequence_parallel else {}),
    })
    model.lm_head.weight = tr.wte.weight  # parallelize_module wrapped each in a Parameter of its own: re-tie
    model.lm_head.register_forward_hook(_mask_padding(vocab, mesh) if loss_parallel else _trim_vocab(vocab))

    # What the plan leaves whole: the position table (with SP returning this rank's sequence rows) and, without
    # SP, the layer norms. Replicated DTensors, so that every parameter is one.
    _replicate(tr.wpe, mesh, Shard(0) if sequence_parallel else Replicate())
    if not sequence_parallel:
        for norm in [tr.ln_f, *(m for block in tr.h for m in (block.ln_1, block.ln_2))]:
            _replicate(norm, mesh)
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(_grad_like_param)
    return model


def parallelize_llama(model: PreTrainedModel, mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool
                      ) -> PreTrainedModel:
    """The Llama family's plan as torchtitan writes it, on transformers' own modules (nn.Linear already): q/k/v and
    gate/up column-parallel, o/down row-parallel, each layer's attention viewing its local output as this rank's
    heads (its key/value heads split as its query heads are), the token table and the head vocabulary-parallel.
    With sequence parallelism the RMSNorms run on sequence shards and each layer's rotary tables cover the whole
    sequence (`sequence_shards`, read by the architecture's block piece)."""
    size, cfg, body = mesh.size(), model.config, model.model
    residual = Shard(1) if sequence_parallel else Replicate()
    check_vocab_split(body.embed_tokens.num_embeddings, size)
    vocab, head_weight = tokenizer_vocab(cfg), model.lm_head.weight
    with torch.device("meta"):  # a plain Linear (not gptpar's PaddedHead): the hooks below mask or trim the padding
        model.lm_head = nn.Linear(cfg.hidden_size, head_weight.size(0), bias=False)
    model.lm_head.weight = head_weight
    layer_plan = {
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": residual},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        **{f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
        "self_attn.o_proj": RowwiseParallel(output_layouts=residual),
        "mlp": PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=residual),
    }
    if sequence_parallel:
        layer_plan |= {"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel()}
    for layer in body.layers:
        parallelize_module(layer, mesh, layer_plan)
        layer.sequence_shards = size if sequence_parallel else 1
    head = ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                           use_local_output=not loss_parallel)
    parallelize_module(model, mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "lm_head": head,
        **({"model.norm": SequenceParallel()} if sequence_parallel else {}),
    })
    if cfg.tie_word_embeddings:
        model.lm_head.weight = body.embed_tokens.weight  # parallelize_module wrapped each anew: re-tie
    model.lm_head.register_forward_hook(_mask_padding(vocab, mesh) if loss_parallel else _trim_vocab(vocab))
    if not sequence_parallel:
        for norm in [body.norm, *(m for layer in body.layers for m in (layer.input_layernorm,
                                                                      layer.post_attention_layernorm))]:
            _replicate(norm, mesh)
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(_grad_like_param)
    return model


def _grad_like_param(param: nn.Parameter) -> None:
    """Give the gradient its parameter's placements. With SP a replicated layer norm sees only its sequence shard
    and DTensor leaves its gradient Partial (a pending sum over the group): summed here, once per backward (as
    gptpar's SequenceParallelLayerNorm does), so the optimizer, clipping and any hook reading `.grad.to_local()`
    see whole gradients, not pending sums that each DTensor op would all-reduce again."""
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(placements=param.placements)


def loss_context(enabled: bool) -> contextlib.AbstractContextManager:
    """What must wrap forward AND backward of a model parallelized with loss_parallel=True."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def torch_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, a plain scalar: of vocabulary-sharded DTensor logits (inside
    `loss_context(True)`; padded columns are -inf) or of whole local logits (gptpar.models.loss.lm_loss)."""
    if isinstance(logits, DTensor):
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).to_local()
    return lm_loss(logits, targets)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()


@torch.no_grad()
def _whole(model: nn.Module, prefix: str, of: Callable[[nn.Parameter], torch.Tensor | None]
           ) -> dict[str, torch.Tensor]:
    """`of(p)` of every parameter whole, under the model's names and layouts (GPT-2's Linear layers back to Conv1D's
    in x out); a collective, same order on all ranks."""
    conv1d = isinstance(model, GPT2LMHeadModel)
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, module in model.named_modules(prefix=prefix):
        if isinstance(module, QKV):
            for field in ("weight", "bias"):
                parts = [getattr(module, c).get_parameter(field) for c in "qkv"]
                seen.update(id(p) for p in parts)
                tensors = [of(p) for p in parts]
                if any(t is None for t in tensors):
                    continue
                full = [_full(t) for t in tensors]
                out[f"{name}.{field}"] = torch.cat([t.t() for t in full], 1) if field == "weight" else torch.cat(full)
            continue
        for field, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # the tied LM head, or q, k, v already done
                continue
            seen.add(id(param))
            tensor = of(param)
            if tensor is None:
                continue
            full = _full(tensor)
            if conv1d and isinstance(module, nn.Linear) and field == "weight":
                full = full.t()  # back to Conv1D's in x out
            out[f"{name}.{field}" if name else field] = full.contiguous()
    return out


def whole_parameters(model: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every parameter of a `parallelize_gpt2` (or `parallelize_llama`) model whole, under its own names and layouts
    (GPT-2's c_attn
    (in, 3 * out) with q, k, v columns in order, Conv1D weights in x out, the token table as built (padded), the tied
    lm_head.weight omitted as GPT2LMHeadModel.named_parameters omits it), names prefixed with `prefix`.
    A collective over the mesh: call it on every rank."""
    return _whole(model, prefix, lambda p: p)


def whole_gradients(model: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """The gradients whole, as `whole_parameters` lays out the parameters (those without a gradient left out)."""
    return _whole(model, prefix, lambda p: p.grad)
