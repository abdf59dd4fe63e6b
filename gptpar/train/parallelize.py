"""How one rank's model is wrapped by every parallelism, in the order they apply (picotron's visible wrapping,
torchtitan's `parallelize`): each step reads the grid (ParallelDims) and the config, and none reaches into
another's files.

1. materialise a model built on the meta device, unless its data-parallel strategy materialises only its shards;
2. tensor parallelism cuts this rank's pieces of every layer; expert parallelism (or a capacity) its experts;
   context parallelism routes attention through its cp group (parallel.cp: each rank holds a shard of the sequence);
3. recompute and compile, block by block, before any wrapper or stage split sees the blocks;
4. the loss for this layout (on vocabulary shards under loss parallelism);
5. the multi-process pipeline keeps this rank's stages, tensor parallelism or the one-process modes of
   parallel.pp_mode (gptpar.parallel.pipeline.one_process) place their pieces, and otherwise the model goes whole
   on the rank's device;
6. data parallelism wraps the result with the strategy parallel.dp_sync names, over dp (dp x cp under context
   parallelism: ParallelDims.replica_group) (at dp=1 only where the row
   builds it over a group of one: DataParallelStrategy.group_of_one, or runs alone).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from gptpar.config import Config, checkpoint_interval
from gptpar.models import architecture
from gptpar.models.build import initial_value, materialize
from gptpar.parallel import make_grad_sync
from gptpar.parallel.context_parallel import ContextParallel
from gptpar.parallel.data_parallel.base import GradSync
from gptpar.parallel.dims import ParallelDims
from gptpar.parallel.expert_parallel import ExpertParallel
from gptpar.parallel.pipeline.engine.executor import Loss, PipelineEngine, Routing
from gptpar.parallel.pipeline.one_process.gpt2 import build_parallel_model
from gptpar.parallel.placement import WholeModel
from gptpar.parallel.tensor_parallel import TensorParallelModel, loss_context, loss_function, shard_model, whole_logits
from gptpar.parallel.tensor_parallel.mixture import ShardedMixtureGradients
from gptpar.parallel.tensor_parallel.state import CheckpointLayout
from gptpar.strategies.data_parallel import DP_STRATEGIES, hpz_node_size
from gptpar.train.recompute import compile_mode, prepare_blocks, whole_logits_loss


@dataclass
class Parallelized:
    """The model as this rank runs it, and what the step needs from the parallelisms that wrapped it."""

    net: nn.Module  # token ids to logits on this rank; the pipeline engine runs whole steps of its stages
    sync: GradSync  # data parallelism around `net`: sync.module is what a forward calls
    loss_fn: Loss
    loss_context: Callable[[], AbstractContextManager[Any]]  # what every loss computation runs under
    whole_logits: Callable[[torch.Tensor], torch.Tensor]  # the whole vocabulary's logits, for decoding
    # Our tensor parallelism leaves plain tensors that are pieces (torch's are DTensors that know it themselves):
    # checkpoints and the gradient norm are told which through this layout; None where nothing is such a piece.
    checkpoint_layout: CheckpointLayout | None
    pipeline: bool  # net is the multi-process pipeline's engine
    experts: ExpertParallel | None  # parallel.ep > 1 or model.moe_capacity_factor > 0: the experts as dispatched
    # A mixture under sequence parallelism: its parameters' gradients, summed over the tp group after the sync.
    mixture_grads: ShardedMixtureGradients | None = None
    context: ContextParallel | None = None  # parallel.cp > 1: shards the step's rows, holds attention's cp group


def counts_saved_attention(cfg: Config, device: torch.device) -> bool:
    """Whether cp's attention counts what it saves for backward (the memory record's attention_bytes): only where no
    other saved-tensor hooks would be shadowed by its counter (recompute's, the pipeline's) and nothing compiles."""
    return (checkpoint_interval(cfg.train.activation_checkpointing) == 0 and cfg.parallel.pp == 1
            and compile_mode(cfg, device) == "false")


def parallelize(model: PreTrainedModel, cfg: Config, dims: ParallelDims, vocab_size: int,
                routing: Routing | None = None) -> Parallelized:
    """`model` whole (or on the meta device) as every rank built it, wrapped for this rank in the module's order;
    `routing` (a mixture's router statistics) travels through the multi-process pipeline with each micro-batch."""
    p, seed, device = cfg.parallel, cfg.train.seed, dims.device
    alone = DP_STRATEGIES[p.dp_sync].group_of_one(p.offload)
    dp_group, tp_group = dims.replica_group(alone), dims.group("tp")
    shards_only = (cfg.model.init_device == "meta" and DP_STRATEGIES[p.dp_sync].materialises_shards
                   and dp_group is not None and tp_group is None)
    if cfg.model.init_device == "meta" and not shards_only:  # 1
        materialize(model, seed, device)
    elif shards_only:  # the strategy fills in the parameters; the buffers (rotary tables) are made here
        architecture(model).restore_buffers(model, device)
    if tp_group is not None:  # 2
        model = shard_model(model, p, dims, device)
    context = (ContextParallel(dims.group("cp"), p.cp_impl, count_saved=counts_saved_attention(cfg, device))
               if dims.size("cp") > 1 else None)
    if context is not None:  # 2, the sequence: attention meets the other shards through the cp group
        context.attach(model)
    experts = (ExpertParallel(model, dims, cfg.model.moe_capacity_factor)
               if dims.size("ep") > 1 or cfg.model.moe_capacity_factor else None)
    prepare_blocks(model, cfg, device)  # 3, in place
    loss_fn = loss_function(p, dims, vocab_size, whole_logits_loss(cfg, device))  # 4
    pipeline = dims.size("pp") > 1
    if pipeline:  # 5
        net: nn.Module = PipelineEngine(model, cfg, dims, device, loss_fn, routing, cfg.model.moe_aux_loss_coef)
        if experts is not None:
            experts.held_by(net)
    elif tp_group is not None:
        net = TensorParallelModel(model, device)
    elif p.pp_mode != "single":  # the one-process model or pipeline parallelism over parallel.devices
        net = build_parallel_model(model, p, device)
    else:  # the plain path
        net = WholeModel(model, p.devices, device)
    config = model.config
    initial = ((lambda name, shape: initial_value(name.removeprefix("model."), shape, config, seed))
               if shards_only else None)
    mesh = dims.replica_mesh(alone)
    local = experts.name_in(net) if experts is not None and dims.size("ep") > 1 else frozenset()
    node_group = (dims.block_group("dp", hpz_node_size(p.hpz_node_size, p.dp, p.tp, dims.local_world_size))
                  if p.hpz and dp_group is not None else None)
    sync = make_grad_sync(net, p, dp_group, device, initial, mesh, local, node_group, cfg.train)  # 6
    pieces = tp_group is not None and p.tp_impl == "gptpar"
    sharded_mixture = (ShardedMixtureGradients(model, net, tp_group)
                       if pieces and p.sequence_parallel and cfg.model.shape().moe else None)
    return Parallelized(net, sync, loss_fn, loss_context(p, dims), whole_logits(p, dims, vocab_size),
                        CheckpointLayout(net, sync, dims) if pieces else None, pipeline, experts, sharded_mixture,
                        context)
