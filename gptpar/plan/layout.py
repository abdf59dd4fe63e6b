"""A resolved config as the cost model reads it: the grid, the tokens of one micro-batch, the blocks of each
pipeline stage, each rank's parameters and the FLOPs of each piece. Everything here is counted from the model's
shape (gptpar.presets) and the config's own rules (padding, stage split, checkpointed blocks), never measured."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gptpar.adapters import Trainable, lora_targets, lora_trainable
from gptpar.config import Config, checkpoint_interval, checkpointed_indices, example_width
from gptpar.data.image_store import image_classes
from gptpar.presets import ModelShape
from gptpar.strategies.context_parallel import AttentionShape
from gptpar.strategies.data_parallel import hpz_node_size
from gptpar.strategies.pipeline import even_sizes, pp_split_counts, stage_sizes

GPT2_VOCAB = 50_257


def vocabulary(cfg: Config) -> int:
    """The head's rows as a job would resolve them: an image classifier's classes (gptpar.data.image_store), else the
    tokenizer's vocabulary: data.vocab_size for a trained BPE or synthetic data, 256 for bytes, else GPT-2's (what
    `auto` picks where the hub answers, as on a cluster's login node)."""
    d = cfg.data
    if d.task == "classify":
        return image_classes(d)
    if d.source == "synthetic" or d.tokenizer == "bpe":
        return d.vocab_size
    return 256 if d.tokenizer == "bytes" else GPT2_VOCAB


def block_flops(shape: ModelShape, tokens: int, seq: int, tp: int = 1, adapters: float | None = None
                ) -> tuple[float, float, float]:
    """FLOPs of one block's F, B and W on `tokens` tokens of sequences of `seq`, on one of `tp` ranks: the matmuls
    2N per token forward, B the input gradients 2N plus attention's backward (twice its forward), W the weight
    gradients 2N; attention 4·seq·width per token forward (the README's MFU count, 6N + 12·seq·width in all). Under
    LoRA the block's `adapters` parameters add 2 each to F and B, and W is theirs alone (frozen weights get none)."""
    n = shape.active_block_parameters() / tp
    attention = 4 * seq * shape.n_embd / tp
    if adapters is None:
        return tokens * (2 * n + attention), tokens * (2 * n + 2 * attention), tokens * 2 * n
    a = adapters / tp
    return tokens * (2 * (n + a) + attention), tokens * (2 * (n + a) + 2 * attention), tokens * 2 * a


def head_flops(width: int, vocab: int, tokens: int, tp: int = 1) -> float:
    """Forward FLOPs of the head's projection on `tokens` rows (its backward is twice this)."""
    return 2.0 * tokens * width * vocab / tp


@dataclass(frozen=True)
class Layout:
    """One layout of one model, in the numbers the cost model needs."""

    shape: ModelShape
    vocab: int  # the token table's rows, padded by model.pad_vocab and tp; an image classifier's classes
    dp: int
    tp: int
    pp: int
    virtual: int
    chunks: int  # micro-batches per micro-step of the multi-process pipeline (1 without it)
    grad_accum: int
    seqs: int  # sequences per micro-batch on one rank
    seq_len: int
    dp_sync: str
    schedule: str
    sequence_parallel: bool
    loss_parallel: bool
    tp_impl: str  # parallel.tp_impl: our tensor-parallel pieces, or torch's DTensor plan
    grad_comm: str
    bucket_mb: float
    param_comm: str  # a parameter-sharding sync's gathers
    quant_block: int
    hpz_node: int  # parallel.hpz's node group of data-parallel ranks (0: no hpZ)
    ep: int  # parallel.ep: each block's experts split over ep data-parallel ranks
    precision: str
    checkpoint_every: int  # recompute every k-th block (0: none)
    stage_blocks: tuple[int, ...]  # blocks of each of the pp * virtual stages
    offload: str = "none"  # parallel.offload
    cp: int = 1  # parallel.cp: each sequence split over cp ranks of one replica
    cp_impl: str = "ring"  # parallel.cp_impl
    lora_rank: int = 0  # train.lora_rank
    lora: Trainable | None = None  # what trains under train.lora_rank (gptpar.adapters); None: every parameter
    lora_unknown: tuple[str, ...] = ()  # train.lora_targets the closed form cannot count: priced as full training

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def replicas(self) -> int:
        """The ranks gradients are averaged over: dp x cp (each cp rank holds a share of the rows' tokens)."""
        return self.dp * self.cp

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one rank (its seq_len / cp of each sequence)."""
        return self.seqs * self.seq_len // self.cp

    @property
    def head_rows(self) -> int:
        """Rows one micro-batch puts through the head: every token of a language model, an image classifier's class
        token alone."""
        return self.seqs if self.shape.patch_size else self.tokens

    @property
    def patch_flops(self) -> float:
        """Forward FLOPs of an image classifier's patch projection on one micro-batch (a P x P convolution of 3
        channels over each patch, a matmul); 0 for a language model, whose token table is a lookup. Its backward is
        the weight gradient alone (the pixels need none): as many FLOPs again."""
        s = self.shape
        return 2.0 * self.seqs * s.patches * 3 * s.patch_size ** 2 * s.n_embd

    @property
    def step_tokens(self) -> int:
        """Tokens the whole job trains on per optimizer step."""
        return self.tokens * self.chunks * self.grad_accum * self.replicas

    def attention(self, element: int) -> AttentionShape:
        """One micro-batch's attention on one rank, as cp's closed forms read it (heads on one tp rank)."""
        s = self.shape
        return AttentionShape(s.n_layer, s.n_head // self.tp, max(s.kv_heads // self.tp, 1), s.head_dim,
                              self.seqs, self.seq_len, element)

    def stages_of(self, rank: int) -> list[int]:
        """The stages pipeline rank `rank` holds (Megatron's interleaving: rank r holds r, r + P, ...)."""
        return list(range(rank, self.pp * self.virtual, self.pp))

    def blocks_of(self, rank: int) -> int:
        return sum(self.stage_blocks[s] for s in self.stages_of(rank))

    def recomputed_in_stage(self, stage: int) -> int:
        """Blocks of `stage` that recompute their forward in backward (train.activation_checkpointing)."""
        start = sum(self.stage_blocks[:stage])
        blocks = set(range(start, start + self.stage_blocks[stage]))
        return len(blocks & set(checkpointed_indices(self.shape.n_layer, self.checkpoint_every)))

    def holds_embedding(self, rank: int) -> bool:
        return rank == 0

    @property
    def last_stage(self) -> int:
        """The stage with the final norm, the head and the loss."""
        return self.pp * self.virtual - 1

    def holds_head(self, rank: int) -> bool:
        return self.last_stage % self.pp == rank

    @property
    def block_parameters(self) -> int:
        """One block's parameters on one tensor-parallel rank: matrices and their split biases over tp, the norms and
        the row-parallel layers' output biases whole; a mixture whole (its experts over ep)."""
        s, d = self.shape, self.shape.n_embd
        block = s.block_parameters(s.n_experts // self.ep if s.moe else None)
        whole = 2 * s.norm_parameters() + (d if s.traits.out_bias else 0) + (d if s.traits.mlp_bias else 0)
        if s.moe:  # our tensor parallelism keeps each mixture whole on every rank of the group
            whole += block - s.attention_parameters() - 2 * s.norm_parameters()
        return (block - whole) // self.tp + whole

    def trainable(self, rank: int) -> int:
        """Parameters pipeline rank `rank` trains: under LoRA the adapters and the `lora_trained` modules (LoRA runs
        on one pipeline rank), else all it holds."""
        return self.lora.total if self.lora else self.rank_parameters(rank)

    @property
    def block_trainable(self) -> float:
        """One block's trained parameters: its adapters under LoRA (the blocks' mean, where a target names one
        block's layer), else `block_parameters`."""
        return self.lora.blocks / self.shape.n_layer if self.lora else self.block_parameters

    def end_trainable(self, rank: int) -> float:
        """Parameters pipeline rank `rank` trains outside its blocks."""
        return self.lora.first + self.lora.last if self.lora else self.end_parameters(rank)

    def end_parameters(self, rank: int) -> int:
        """The model's parameters of pipeline rank `rank` outside its blocks (tables, final norm, an untied head)."""
        return self.model_parameters(rank) - self.blocks_of(rank) * self.block_parameters

    def rank_parameters(self, rank: int) -> int:
        """Parameters pipeline rank `rank` holds on one tensor-parallel rank, as the memory record counts them: the
        model's (`model_parameters`) and, under LoRA (one pipeline rank), the adapters peft adds."""
        return self.model_parameters(rank) + (self.lora.adapters if self.lora else 0)

    def model_parameters(self, rank: int) -> int:
        """The model's own parameters pipeline rank `rank` holds on one tensor-parallel rank: its blocks' (matrices
        and their split biases over tp, norms and the row-parallel layers' biases whole), the token table's rows over
        tp and the positions on the first stage, the final norm and, where the pipeline unties it, a copy of the table
        as the LM head on the last. An image classifier runs whole on one rank: its own count (patch projection,
        class token, positions, blocks, final norm and classifier)."""
        s, d = self.shape, self.shape.n_embd
        if s.patch_size:
            return s.parameters(self.vocab)
        table = self.vocab // self.tp * d
        n = self.blocks_of(rank) * self.block_parameters
        if self.holds_embedding(rank):
            n += table + (s.n_positions * d if s.traits.learned_positions else 0)
        if self.holds_head(rank):
            n += s.norm_parameters() + (table if (self.pp > 1 or not s.tied) else 0)
        return n


def layout_of(cfg: Config) -> Layout:
    """The layout of a validated config (one `gptpar train` would run)."""
    t, p, shape = cfg.train, cfg.parallel, cfg.model.shape()
    pipeline = p.pp > 1 or p.pp_mode == "pipeline_parallel"
    chunks = p.chunks if pipeline else 1
    stages = p.pp * p.pp_virtual
    counts = pp_split_counts(p.pp_split, stages) if p.pp > 1 else None
    if counts is None and p.balance == "params" and p.pp > 1:
        table = vocabulary(cfg) * shape.n_embd
        counts = stage_sizes([shape.block_parameters()] * shape.n_layer, stages, table, table)
    shards = p.tp if p.tp > 1 else 1
    multiple = 1 if shape.patch_size else math.lcm(cfg.model.pad_vocab, shards)  # a classifier's classes unpadded
    rows = vocabulary(cfg)
    vocab = -(-rows // multiple) * multiple
    # a padded table's LM head is gptpar's PaddedHead, which peft cannot adapt
    targets = lora_targets(shape.arch, t.lora_targets)
    lora = lora_trainable(shape, vocab, t.lora_rank, targets, head=vocab == rows) if t.lora_rank else None
    return Layout(
        shape=shape, vocab=vocab, dp=p.dp, tp=p.tp, pp=p.pp,
        virtual=p.pp_virtual, chunks=chunks, grad_accum=t.grad_accum,
        seqs=t.batch_size // (p.dp * t.grad_accum * chunks), seq_len=example_width(cfg), dp_sync=p.dp_sync,
        schedule=p.pp_schedule, sequence_parallel=p.sequence_parallel, loss_parallel=p.loss_parallel,
        tp_impl=p.tp_impl, grad_comm=p.grad_comm, bucket_mb=p.bucket_mb, param_comm=p.param_comm,
        quant_block=p.quant_block,
        hpz_node=hpz_node_size(p.hpz_node_size, p.dp, p.tp, cfg.launch.gpus or p.dp * p.tp) if p.hpz else 0,
        ep=p.ep, precision=t.precision,
        checkpoint_every=checkpoint_interval(t.activation_checkpointing),
        stage_blocks=tuple(counts or even_sizes(shape.n_layer, stages)), offload=p.offload, cp=p.cp,
        cp_impl=p.cp_impl, lora_rank=t.lora_rank, lora=lora if isinstance(lora, Trainable) else None,
        lora_unknown=tuple(lora) if isinstance(lora, list) else ())
