"""Each parallelism's check of its own keys, called by `validate` after the cross-key checks: the pipeline (its
one-process modes, the multi-process engine's schedule, batch and depth), the data-parallel strategy (what its row in
gptpar/strategies/data_parallel.py says it sends, shards and composes with) and tensor parallelism. They live here,
above the torch-free tables they read, so that the tables never import the config."""

from __future__ import annotations

from gptpar.config.schema import Config, ParallelConfig
from gptpar.errors import ConfigError, GptparError
from gptpar.strategies.data_parallel import DP_STRATEGIES, either, hpz_node_size
from gptpar.strategies.pipeline import pp_split_counts, schedule_shape
from gptpar.strategies.tensor_parallel import TP_IMPLS


def _one_process(cfg: Config) -> None:
    """The one-process modes (parallel.pp = 1) drive every stage from one rank."""
    t, p = cfg.train, cfg.parallel
    if p.pp_mode == "pipeline_parallel" and p.chunks > t.batch_size // (p.dp * t.grad_accum):
        raise ConfigError(
            f"parallel.chunks={p.chunks} exceeds the per-rank micro-batch of "
            f"{t.batch_size // (p.dp * t.grad_accum)} sequences")
    if p.pp_mode != "single" and p.dp > 1:
        raise ConfigError(f"parallel.pp_mode={p.pp_mode} drives its stages from one process and cannot be "
                          f"combined with parallel.dp={p.dp} yet; use parallel.dp=1 or parallel.pp_mode=single")
    if p.pp_mode == "single" and p.devices.strip() and p.dp > 1:
        raise ConfigError(f"parallel.devices={p.devices!r} places the stages of one process; with parallel.dp="
                          f"{p.dp} each rank uses its own device: leave parallel.devices empty")




def check_pipeline(cfg: Config) -> None:
    """The one-process modes, then the multi-process pipeline against them, the schedule's shape, the batch and
    the model's depth."""
    _one_process(cfg)
    t, p = cfg.train, cfg.parallel
    if p.pp == 1:
        for key, value, default in (("pp_virtual", p.pp_virtual, 1), ("pp_split", p.pp_split.strip(), "")):
            if value != default:
                raise ConfigError(f"parallel.{key}={value} applies to the multi-process pipeline only; set "
                                  "parallel.pp > 1 or leave it out")
        return
    if p.pp_mode != "single":
        raise ConfigError(f"parallel.pp={p.pp} runs each stage as its own rank; parallel.pp_mode={p.pp_mode} "
                          "drives stages from one process: use one of them (parallel.pp_mode=single with pp > 1)")
    if p.devices.strip():
        raise ConfigError(f"parallel.devices={p.devices!r} places stages inside one process; with parallel.pp="
                          f"{p.pp} each stage rank uses its own device: leave parallel.devices empty")
    replica_batch = t.batch_size // (p.dp * t.grad_accum)
    if replica_batch % p.chunks:
        raise ConfigError(f"train.batch_size={t.batch_size} gives {replica_batch} sequences per replica and "
                          f"micro-step (batch_size / (dp * grad_accum)), which do not divide into parallel.chunks="
                          f"{p.chunks} micro-batches; use a train.batch_size that is a multiple of "
                          f"{p.dp * t.grad_accum * p.chunks}")
    try:
        schedule_shape(p.pp_schedule, p.pp, p.chunks, p.pp_virtual)
    except GptparError as exc:
        raise ConfigError(str(exc)) from None
    counts = pp_split_counts(p.pp_split, p.pp * p.pp_virtual)
    n_layer = cfg.model.shape().n_layer
    stages = p.pp * p.pp_virtual
    if stages > n_layer:
        raise ConfigError(f"parallel.pp * parallel.pp_virtual = {stages} stages but the model has {n_layer} blocks; "
                          "every stage needs at least one block")
    if counts is not None and sum(counts) != n_layer:
        raise ConfigError(f"parallel.pp_split={p.pp_split!r} places {sum(counts)} blocks but the model has "
                          f"{n_layer}")


def check_data_parallel(cfg: Config) -> None:
    """train.dump_grads against what the strategy (and tensor parallelism) leaves each rank, parallel.grad_comm and
    parallel.param_comm against what it can send, parallel.hpz against the strategies that keep its copy (and its
    node size against dp), then parallel.dp_sync against the multi-process pipeline."""
    p = cfg.parallel
    row = DP_STRATEGIES[p.dp_sync]
    if cfg.train.dump_grads and (p.tp > 1 or (p.dp > 1 and not row.whole_gradients)):
        split = f"parallel.tp={p.tp}" if p.tp > 1 else f"parallel.dp_sync={p.dp_sync}"
        whole = [name for name, r in DP_STRATEGIES.items() if r.whole_gradients]
        raise ConfigError(f"train.dump_grads saves whole gradients, but {split} leaves each rank pieces of them; "
                          f"use parallel.dp_sync={either(whole)} with parallel.tp=1, or leave it empty")
    if p.grad_comm not in row.grad_comm:
        sending = [name for name, r in DP_STRATEGIES.items() if p.grad_comm in r.grad_comm]
        raise ConfigError(f"parallel.grad_comm={p.grad_comm} is not built for parallel.dp_sync={p.dp_sync} (it sends "
                          f"{either(list(row.grad_comm))}); use parallel.dp_sync={either(sending)}, or "
                          "parallel.grad_comm=fp32")
    if p.param_comm not in row.param_comm:
        gathering = [name for name, r in DP_STRATEGIES.items() if p.param_comm in r.param_comm]
        raise ConfigError(f"parallel.param_comm={p.param_comm} is not built for parallel.dp_sync={p.dp_sync} (it "
                          f"gathers {either(list(row.param_comm))}); use parallel.dp_sync={either(gathering)}, or "
                          "parallel.param_comm=fp32")
    if p.hpz and not row.hpz:
        keeping = [name for name, r in DP_STRATEGIES.items() if r.hpz]
        raise ConfigError(f"parallel.hpz=true is not built for parallel.dp_sync={p.dp_sync}; use "
                          f"parallel.dp_sync={either(keeping)}, or parallel.hpz=false")
    if p.offload != "none" and p.offload not in row.offloads:
        moving = [name for name, r in DP_STRATEGIES.items() if p.offload in r.offloads]
        use = f"use parallel.dp_sync={either(moving)}, or " if moving else ""
        raise ConfigError(f"parallel.offload={p.offload} is not built for parallel.dp_sync={p.dp_sync}; "
                          f"{use}parallel.offload=none")
    if p.offload != "none":
        check_offload(p.offload, p.tp, p.ep)
    if p.hpz and p.hpz_node_size:
        hpz_node_size(p.hpz_node_size, p.dp, p.tp, 0)
    _check_stage(cfg)
    if p.pp > 1 and row.without_pipeline:
        syncing = [name for name, r in DP_STRATEGIES.items() if not r.without_pipeline]
        raise ConfigError(f"parallel.dp_sync={p.dp_sync} {row.without_pipeline}; use parallel.dp_sync="
                          f"{either(syncing)} with parallel.pp > 1")


def check_offload(offload: str, tp: int, ep: int) -> None:
    """parallel.offload moves what the data-parallel sync holds of a whole model's shard (at parallel.dp=1 the sync
    runs over a group of one: DataParallelStrategy.group_of_one, or its own); it is built without tensor-parallel
    pieces or expert slices, which the syncs step on the device."""
    for key, size in (("tp", tp), ("ep", ep)):
        if size > 1:
            raise ConfigError(f"parallel.offload={offload} is not built with parallel.{key}={size}; use "
                              f"parallel.{key}=1, or parallel.offload=none")


def _check_stage(cfg: Config) -> None:
    """parallel.zero_stage against the strategy that reads it, and the offload its stage can take (DeepSpeed offloads
    parameters at stage 3 only)."""
    p = cfg.parallel
    row = DP_STRATEGIES[p.dp_sync]
    staged = [name for name, r in DP_STRATEGIES.items() if r.stages]
    if not row.stages and p.zero_stage != ParallelConfig.zero_stage:
        raise ConfigError(f"parallel.zero_stage={p.zero_stage} is read by parallel.dp_sync={either(staged)} only "
                          f"(parallel.dp_sync={p.dp_sync} is one stage); use parallel.dp_sync={either(staged)}, or "
                          "leave parallel.zero_stage out")
    if row.stages and p.offload == "params" and p.zero_stage != 3:
        raise ConfigError(f"parallel.offload=params needs parallel.zero_stage=3 with parallel.dp_sync={p.dp_sync} "
                          f"(DeepSpeed offloads parameters only where it shards them; this is stage {p.zero_stage}); "
                          "use parallel.zero_stage=3, or parallel.offload=optimizer or none")


def check_tensor_parallel(cfg: Config) -> None:
    """parallel.tp against the model's shape, the sequence, the one-process pipeline modes, the implementation's
    composition with the pipeline and the data-parallel row's with the implementation."""
    p, m = cfg.parallel, cfg.model
    if p.tp == 1:
        return
    shape = m.shape()
    mlp = "the MLP width 4 * model.n_embd" if shape.arch == "gpt2" else "the MLP width"
    for key, value in (("model.n_head", shape.n_head), ("model.n_kv_head", shape.kv_heads), (mlp, shape.mlp_width)):
        if value % p.tp:
            raise ConfigError(f"parallel.tp={p.tp} must divide {key}={value}; use a tp that divides it")
    if p.sequence_parallel and cfg.data.task == "lm" and cfg.data.seq_len % p.tp:
        raise ConfigError(f"parallel.sequence_parallel=true splits data.seq_len={cfg.data.seq_len} into parallel.tp="
                          f"{p.tp} shards; use a seq_len that is a multiple of {p.tp}")
    if p.pp_mode != "single":
        raise ConfigError(f"parallel.pp_mode={p.pp_mode} drives stages from one process and cannot be combined with "
                          f"parallel.tp={p.tp}; use parallel.pp (the multi-process pipeline) instead")
    if p.pp > 1 and not TP_IMPLS[p.tp_impl].with_pipeline:
        composing = [name for name, impl in TP_IMPLS.items() if impl.with_pipeline]
        raise ConfigError(f"parallel.tp_impl={p.tp_impl} does not compose with parallel.pp > 1; use parallel.tp_impl="
                          f"{either(composing)} for pipeline x tensor parallelism")
    row = DP_STRATEGIES[p.dp_sync]
    replicas = p.dp * p.cp  # the ranks a sync averages over; a row that runs alone syncs even over one
    if (replicas > 1 or row.alone) and p.tp_impl not in row.tensor_parallel:
        syncs = [name for name, r in DP_STRATEGIES.items() if p.tp_impl in r.tensor_parallel]
        same = [name for name in syncs if DP_STRATEGIES[name].sharded == row.sharded]
        others = [name for name in TP_IMPLS if name in row.tensor_parallel and p.cp == 1]  # cp takes ours only
        if same:  # the strategy that shards the same state the way this implementation's parameters need
            offer = f"use parallel.dp_sync={same[0]} ({DP_STRATEGIES[same[0]].help.split(',')[0]}) instead"
        else:
            offer = f"it needs parallel.dp_sync={either(syncs)}"
        alternative = f"; or use parallel.tp_impl={either(others)}" if others else ""
        over = f"parallel.dp={p.dp}" + (f" x parallel.cp={p.cp}" if p.cp > 1 else "")
        raise ConfigError(f"parallel.tp_impl={p.tp_impl} with {over} does not compose with "
                          f"parallel.dp_sync={p.dp_sync}: {offer}{alternative}")


def check_lora(cfg: Config) -> None:
    """train.lora_rank > 0 runs on layouts that keep the model whole on each rank (one process or data parallelism
    with a strategy whose row trains frozen weights): our pipeline and tensor-parallel plans and the expert slices
    cut layers by their names, which the adapters change."""
    t, p = cfg.train, cfg.parallel
    if not t.lora_rank:
        return
    lora = f"train.lora_rank={t.lora_rank}"
    layout = [f"parallel.{key}={value}" for key, value in (("pp", p.pp), ("tp", p.tp), ("ep", p.ep)) if value > 1]
    if p.pp_mode != "single":
        layout.append(f"parallel.pp_mode={p.pp_mode}")
    if layout:
        raise ConfigError(f"{lora} runs on one process or data parallelism only, not with {either(layout, 'and')}; "
                          "set parallel.pp, tp and ep to 1 and parallel.pp_mode=single, or train.lora_rank=0")
    if (p.dp > 1 or DP_STRATEGIES[p.dp_sync].alone) and (why := DP_STRATEGIES[p.dp_sync].without_lora):
        allowed = [name for name, row in DP_STRATEGIES.items() if not row.without_lora]
        raise ConfigError(f"{lora} does not run under parallel.dp_sync={p.dp_sync} ({why}); use {either(allowed)}")


# whose attention takes the context-parallel function and whose positions are ids
CP_ARCHS = ("gpt2", "llama", "qwen2", "mixtral", "qwen2_moe")


def check_context_parallel(cfg: Config) -> None:
    """parallel.cp against what it is built with (every data-parallel strategy, expert parallelism, our tensor
    parallelism, the multi-process pipeline; the decoders and their mixtures; blocks or pair rows, packed or not, the
    packed ones only where the model runs whole, as without cp: checks._check_packing) and the sequence and heads its
    implementation splits (a tensor-parallel rank's heads; with sequence parallelism each shard split again)."""
    p, shape, cp = cfg.parallel, cfg.model.shape(), f"parallel.cp={cfg.parallel.cp}"
    if p.cp == 1:
        return
    if shape.arch not in CP_ARCHS:
        raise ConfigError(f"{cp} is built for model.arch={either(list(CP_ARCHS))}, not {shape.arch}; "
                          "use one of them, or parallel.cp=1")
    if p.tp > 1 and p.tp_impl != "gptpar":  # torch's attention and DTensor gradients do not meet the cp group
        raise ConfigError(f"{cp} composes with parallel.tp_impl=gptpar only, not parallel.tp_impl={p.tp_impl} (its "
                          "DTensor gradients are averaged by fsdp2 over the dp mesh alone, and its attention does not "
                          "run the cp exchange); use parallel.tp_impl=gptpar, or parallel.cp=1")
    if p.pp_mode != "single":  # one process drives every stage: no ranks to split a sequence over
        raise ConfigError(f"{cp} composes with data, expert, tensor and pipeline parallelism, not with "
                          f"parallel.pp_mode={p.pp_mode}; set parallel.pp_mode=single, or parallel.cp=1")
    if p.hpz:  # every strategy shards and averages over dp * cp ranks; hpZ's node group lies along dp alone
        raise ConfigError(f"parallel.hpz=true keeps a copy of the shards within a node's data-parallel ranks, but "
                          f"under {cp} they are sharded over dp * cp ranks; use parallel.hpz=false, or parallel.cp=1")
    if cfg.model.dropout:  # the ring's blocks and the all-to-all's attention run without attention's dropout
        raise ConfigError(f"{cp} runs attention without dropout, so model.dropout={cfg.model.dropout:g} would not "
                          "reach it (the embeddings' and residuals' would); use model.dropout=0, or parallel.cp=1")
    seq_len = cfg.data.seq_len if cfg.data.task == "lm" else 0  # pair rows' width is rounded up (example_width)
    if seq_len % (2 * p.cp):  # both implementations shard rows by the load-balanced split (shard_positions)
        raise ConfigError(f"{cp} splits data.seq_len={seq_len} into 2 * parallel.cp = {2 * p.cp} chunks, two a rank "
                          f"(an equal share of the causal work); use a seq_len that is a multiple of {2 * p.cp}")
    if p.cp_impl == "all_to_all" and shape.n_head % p.cp:
        raise ConfigError(f"parallel.cp_impl=all_to_all needs model.n_head={shape.n_head} divisible by {cp}; use a "
                          f"multiple of {p.cp}, or parallel.cp_impl=ring")
    if p.cp_impl == "all_to_all" and (shape.n_head // p.tp) % p.cp:  # it trades a tensor-parallel rank's heads
        raise ConfigError(f"parallel.cp_impl=all_to_all trades each rank's model.n_head / parallel.tp = "
                          f"{shape.n_head // p.tp} heads over {cp}, which do not divide; use model.n_head a multiple "
                          f"of {p.tp * p.cp}, or parallel.cp_impl=ring")
    if p.tp > 1 and p.sequence_parallel and seq_len % (p.cp * p.tp):
        raise ConfigError(f"parallel.sequence_parallel=true splits each of {cp}'s shards of data.seq_len={seq_len} "
                          f"into parallel.tp={p.tp}; use a seq_len that is a multiple of {p.cp * p.tp}")


# In the order `validate` calls them.
PARALLEL_CHECKS = (check_pipeline, check_data_parallel, check_context_parallel, check_tensor_parallel, check_lora)
