"""The config's schema: one frozen dataclass per section, every field with its help text, allowed values and
range in its metadata, so validation, error messages and docs/config_reference.md all come from here.
Choices that name strategies or launchers are their tables themselves (gptpar/strategies, gptpar/launchers.py),
read live."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from gptpar.architectures import ARCHS
from gptpar.launchers import CLUSTERS, DEFAULT_LAUNCHER, LAUNCHERS
from gptpar.presets import PRESETS, ModelShape
from gptpar.pretrained import folder_of, folder_shape
from gptpar.strategies.data_parallel import DP_STRATEGIES, GRAD_COMMS, OFFLOADS, PARAM_COMMS, either, strategies_where
from gptpar.strategies.pipeline import SCHEDULES
from gptpar.strategies.tensor_parallel import TP_IMPLS

PRECISIONS = ("auto", "fp32", "bf16", "fp16", "tf32")
COMPILE_MODES = ("auto", "false", "true", "blocks", "model")
LOSS_KERNELS = ("auto", "compiled", "chunked", "plain")
# A run folder's name: file names have at most 255 bytes, and a folder set aside by --start-over or --rerun gets
# `.replaced-<YYYYmmdd-HHMMSS>[.N]` appended (run ids are ASCII, gptpar.run.names: a character is a byte).
RUN_ID_MAX = 200
TASKS = ("lm", "translation", "sft", "classify")
PAIR_TASKS = ("translation", "sft")  # prompt and response pairs, the loss on the response only


def opt(default: Any, help: str, choices: typing.Collection[str] | None = None, min: float | None = None,
        max: float | None = None) -> Any:
    """A dataclass field with its documentation and constraints attached."""
    meta = {"help": help, "choices": choices, "min": min, "max": max}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ModelConfig:
    preset: str = opt("gpt2-tiny", "Named model shape (gptpar/presets.py): GPT-2's, and the Llama family's "
                      "(llama-tiny, qwen2-tiny for CPUs; llama-3.2-1b, qwen2.5-0.5b, qwen2.5-3b), and ViT's for "
                      "data.task=classify (vit-tiny for CPUs; vit-base, vit-huge).",
                      choices=tuple(PRESETS))
    arch: str = opt("auto", "Architecture (gptpar/models): auto is the preset's; gpt2 (transformers' "
                    "GPT2LMHeadModel), llama (LlamaForCausalLM), qwen2 (Qwen2ForCausalLM: q/k/v biases), vit "
                    "(ViTForImageClassification, data.task=classify). Another "
                    "architecture than the preset's keeps its sizes.", choices=("auto", *ARCHS))
    n_layer: int = opt(0, "Transformer blocks; 0 keeps the preset's.", min=0, max=4096)
    n_embd: int = opt(0, "Hidden width; 0 keeps the preset's.", min=0, max=65_536)
    n_head: int = opt(0, "Attention heads; 0 keeps the preset's.", min=0, max=4096)
    n_kv_head: int = opt(0, "Key/value heads of grouped-query attention (llama, qwen2; a divisor of model.n_head); "
                         "0 keeps the preset's.", min=0, max=4096)
    n_positions: int = opt(0, "Context length of the position table; 0 keeps the preset's.", min=0,
                           max=1_048_576)
    image_size: int = opt(0, "An image classifier (vit): pixels of an image's side, a multiple of the preset's patch "
                          "size (the data is resized to it); 0 keeps the preset's.", min=0, max=65_536)
    n_experts: int = opt(0, "A mixture of experts (mixtral, qwen2_moe): experts per block; 0 keeps the preset's.",
                         min=0, max=65_536)
    moe_top_k: int = opt(0, "A mixture of experts: experts each token goes to (at most model.n_experts); 0 keeps the "
                         "preset's.", min=0, max=65_536)
    moe_aux_loss_coef: float = opt(0.01, "A mixture of experts: weight of the router's load-balancing loss "
                                   "(Switch Transformer's, as transformers computes it, over the routing statistics of "
                                   "the whole micro-step on every replica; under parallel.pp > 1 a pipeline chunk is "
                                   "the micro-step) in the training loss; logged alone as aux_loss. 0: not trained on, "
                                   "still logged.", min=0.0)
    moe_capacity_factor: float = opt(0.0, "A mixture of experts: 0 routes every token to its experts (none is "
                                     "dropped: training equals one process's). A positive factor c gives each expert "
                                     "room for ceil(c * tokens * top_k / n_experts) of the tokens a rank runs per "
                                     "forward (a micro-batch, a pipeline chunk or a sequence shard) per block, first "
                                     "come first served; the rest skip that expert (the step record's "
                                     "moe.dropped counts them).", min=0.0)
    dropout: float = opt(0.0, "Dropout on embeddings, attention and residuals.", min=0.0, max=1.0)
    pad_vocab: int = opt(64, "Pad the token table (embedding and tied LM head) to a multiple of N rows (50,257 -> "
                         "50,304 at 64; with parallel.tp > 1 a multiple of tp too), for matmul shapes that run fast: "
                         "the padded rows start at zero, their logits are -inf (never predicted, never in the loss, "
                         "no gradient), so losses equal the unpadded model's; exports cut the padding off. 1: no "
                         "padding beyond tp's.", min=1, max=65_536)
    init: str = opt("random", "random: seeded random weights; pretrained: GPT-2's hub weights (model.preset a GPT-2 "
                    "size; needs the hub or its cache); pretrained:PATH: a local folder written by transformers' "
                    "save_pretrained (config.json, safetensors or pytorch_model.bin weights, its tokenizer), whose "
                    "config fixes the shape (model.preset and the size keys then stay unset) and whose tokenizer "
                    "data.tokenizer=auto reads.")
    init_device: str = opt("cpu", "Where the model is built: cpu builds it whole; meta builds it without memory and "
                           "lets each rank materialise only what it holds (its shard under parallel.dp_sync=fsdp), "
                           "seeded per parameter so the values equal a cpu build.", choices=("cpu", "meta"))

    def shape(self) -> ModelShape:
        """The model's shape: a pretrained folder's, else the preset's with this section's overrides (the one place
        they are applied)."""
        folder = folder_of(self.init)
        if folder is not None:
            return folder_shape(folder)
        return PRESETS[self.preset].overridden(self.arch, self.n_layer, self.n_embd, self.n_head, self.n_positions,
                                               self.n_kv_head, self.n_experts, self.moe_top_k, self.image_size)


@dataclass(frozen=True)
class DataConfig:
    task: str = opt("lm", "lm: next-token prediction on blocks of text; translation: German-to-English pairs as "
                    "`source <sep> target <eos>`, the loss on target tokens only, BLEU at each epoch end "
                    "(data.source jsonl:, tsv: or hf:); sft: instruction tuning on question/response pairs in the "
                    "same plain template (`prompt <sep> response <eos>`), the loss on response tokens only, the final "
                    "answer's accuracy at each epoch end (data.source metamath_sample, jsonl: or hf:, e.g. "
                    "hf:meta-math/MetaMathQA); classify: image classification (model.arch=vit) by cross-entropy over "
                    "the classes, top-1 accuracy (and top-5 with 100 classes or more) at each evaluation "
                    "(data.source synthetic: the embedded image set).", choices=TASKS)
    source: str = opt("stdlib", "stdlib | tinyshakespeare | synthetic | text:PATH[,PATH...] | "
                      "hf:NAME[:CONFIG]; with data.task=translation jsonl:TRAIN[,VALID[,TEST]] (objects with de and "
                      "en, or {\"translation\": {...}}) | tsv:TRAIN[,VALID[,TEST]] (de, a tab, en) | "
                      "hf:NAME[:CONFIG] (e.g. hf:bbaaaa/iwslt14-de-en-preprocess; its test split when it has one); "
                      "a TEST split is only decoded and scored (test_bleu). Image classification: cifar100 | food101 "
                      "| hf:NAME[:CONFIG] (with data.task=classify), kept in the data folder's images/ by `gptpar data "
                      "fetch` and read from there with no network (docs/vision.md).")
    tokenizer: str = opt("auto", "auto: the model folder's under model.init=pretrained:PATH, else GPT-2 BPE from the "
                         "hub, else a BPE trained on the corpus; gpt2; bpe; bytes (256 symbols); pretrained:PATH: the "
                         "tokenizer of a save_pretrained folder (its chat template frames data.task=sft's pairs).")
    vocab_size: int = opt(4096, "Vocabulary of a trained BPE (and of synthetic data).", min=257,
                          max=16_777_216)
    seq_len: int = opt(128, "Tokens per example; a block holds seq_len + 1 tokens.", min=2,
                       max=1_048_576)
    prompt_field: str = opt("query", "data.task=sft: the field of a jsonl line (or hub row) holding the prompt "
                            "(MetaMathQA's name by default).")
    response_field: str = opt("response", "data.task=sft: the field holding the response (MetaMathQA's ends with "
                              "`The answer is: X`).")
    max_source_len: int = opt(64, "data.task=translation or sft: source (prompt) tokens kept per pair (longer "
                              "sources are cut); an "
                              "example has at most max_source_len + max_target_len + 1 positions, the width every "
                              "batch is padded to under parallel.pp > 1 or sequence parallelism (rounded up to a "
                              "multiple of parallel.tp there).", min=1,
                              max=1_048_576)
    max_target_len: int = opt(64, "data.task=translation: target tokens kept per pair (then the end token), and the "
                              "most tokens greedy decoding generates before it.", min=1, max=1_048_576)
    packing: bool = opt(False, "data.task=translation or sft: pack several examples into each row of the longest "
                        "example's width, none attending to another (position ids restart per example, a "
                        "block-diagonal causal mask), so rows carry less padding; the loss is the unpacked examples'. "
                        "For layouts that run the model whole (one process and every parallel.dp_sync), not "
                        "parallel.pp > 1, parallel.tp > 1 or the one-process pipelines.")
    val_fraction: float = opt(0.1, "Share of the corpus held out for validation.", min=0.0, max=0.5)
    max_chars: int = opt(2_000_000, "Characters of text read from the corpus; 0 reads all.", min=0)
    synthetic_tokens: int = opt(1_000_000, "Corpus length of the synthetic source.", min=1000,
                                max=4_294_967_296)
    synthetic_images: int = opt(2048, "data.task=classify with data.source=synthetic: images generated (offline), "
                                "data.val_fraction of them held out for validation.", min=2, max=16_777_216)
    synthetic_classes: int = opt(10, "data.task=classify with data.source=synthetic: its classes, each a fixed "
                                 "smooth colour pattern under per-image noise.", min=2, max=100_000)
    dir: str = opt("", "Data and cache directory; empty uses $GPTPAR_DATA_DIR or ~/.cache/gptpar.")
    streaming: bool = opt(False, "Stream hf: datasets instead of downloading them whole.")
    augment: bool = opt(False, "Image sets (cifar100, food101, hf: with data.task=classify): crop each training image "
                        "at random (8-100 % of its area, width / height 3/4 to 4/3) and flip half of them, drawn from "
                        "train.seed, the epoch and the image's index (the same on any number of ranks); the validation "
                        "split never.")
    hub_timeout_s: float = opt(3.0, "Seconds to wait when probing the Hugging Face hub.", min=0.1,
                               max=600.0)


@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = opt(16, "Global batch (sequences per optimizer step, over all DP ranks).", min=1,
                          max=16_777_216)
    grad_accum: int = opt(1, "Micro-steps per optimizer step.", min=1, max=65_536)
    epochs: int = opt(1, "Passes over the training split.", min=1, max=1_000_000)
    max_steps: int = opt(0, "Stop after this many optimizer steps; 0 runs all epochs.", min=0)
    lr: float = opt(6e-4, "Peak learning rate.", min=0.0)
    min_lr: float = opt(6e-5, "Learning rate at the end of the cosine decay.", min=0.0)
    warmup_steps: int = opt(10, "Linear warm-up steps.", min=0)
    weight_decay: float = opt(0.1, "AdamW weight decay (matrices only).", min=0.0)
    beta1: float = opt(0.9, "AdamW beta1.", min=0.0, max=1.0)
    beta2: float = opt(0.95, "AdamW beta2.", min=0.0, max=1.0)
    grad_clip: float = opt(1.0, "Gradient-norm clip; 0 disables it.", min=0.0)
    loss_kernel: str = opt("auto", "How the cross-entropy runs: compiled (torch.compile fuses it into one pass over "
                           "the logits each way, never an fp32 copy of them), chunked (a chunk of rows at a time in "
                           "fp32: forward keeps one log-sum-exp per row, backward recomputes each chunk's softmax), "
                           "plain (F.cross_entropy on an fp32 copy of the logits); auto: compiled where this rank "
                           "compiles (train.compile resolves to blocks or model), chunked elsewhere. The same "
                           "gradients up to fp32 rounding. parallel.loss_parallel's vocabulary-parallel loss "
                           "replaces any.",
                           choices=LOSS_KERNELS)
    fused_optimizer: bool = opt(True, "AdamW as one fused kernel (CPUs and GPUs), or foreach where a device or dtype "
                                "has no fused kernel (the log header's fast_path says which ran); false: torch's "
                                "default (foreach on GPUs, a loop over the tensors on CPUs). The same updates up to "
                                "fp32 rounding.")
    eval_every: int = opt(50, "Evaluate every N steps (and at each epoch end); 0 only at epoch end.",
                          min=0)
    eval_batches: int = opt(8, "Validation batches per evaluation.", min=1, max=1_000_000)
    # 16: an untrained qwen2-tiny decodes a sample of the bundled metamath_sample (every response running to
    # max_target_len=120) in 1.15 s on a shared 2-core CPU, 0.62 of a 1.85 s training step at batch 16, so 16
    # samples cost about half of its 18-step epoch (33 s) where 200 cost 230 s, seven epochs.
    answer_samples: int = opt(16, "data.task=sft: validation pairs whose prompts are greedily decoded at each epoch "
                              "end, scored by exact match of the final answer (`The answer is: X`, else the last "
                              "line) against the reference's (answer_accuracy), sharded as BLEU is; 0 disables it. "
                              "Decoding has no KV cache: on a CPU a sample costs about half a training step of "
                              "the bundled sample's. Rank 0 writes the answers to answers/epoch<N>.jsonl.",
                              min=0, max=1_000_000_000)
    bleu_samples: int = opt(200, "data.task=translation: validation (and test, where the source has a test split) "
                            "pairs greedily decoded and scored with sacrebleu "
                            "(corpus BLEU) at each epoch end, sharded over the data-parallel replicas (with "
                            "parallel.pp > 1 on the model gathered whole onto one rank per replica); 0 disables "
                            "BLEU.", min=0, max=1_000_000_000)
    seed: int = opt(1337, "Seed of weights, data order and dropout.")
    checkpoint_every: int = opt(0, "Save a checkpoint every N steps; 0 only at the end and on signal.",
                                min=0)
    threads: int = opt(0, "torch intra-op threads per rank; 0 leaves torch's default.", min=0,
                       max=4096)
    precision: str = opt("auto", "auto: bf16 on a CUDA GPU with bf16 (A100, H100), fp16 on older GPUs (V100), fp32 on "
                         "CPUs, chosen by each rank for its device (the log header records it); fp32; bf16 (autocast, "
                         "fp32 master weights and optimizer state; CPUs too); fp16 (autocast and a dynamic loss scale, "
                         "overflowing steps skipped and logged; GPUs only); tf32 (fp32 with TF32 matmuls, Ampere or "
                         "newer GPUs).", choices=PRECISIONS)
    activation_checkpointing: str = opt("none", "Recompute block activations in backward instead of keeping them: "
                                        "none, block (every block) or an integer k (every k-th block).")
    compile: str = opt("auto", "torch.compile (inductor needs a C++ compiler; minutes on a CPU): model compiles "
                       "the whole model as one graph (one process, or parallel.dp_sync other than fsdp, without tp, pp "
                       "or the one-process pipeline modes; a data-parallel sync then reduces after the whole backward "
                       "instead of overlapping it); blocks (true: the same) compiles each transformer block; false: "
                       "none; auto: false on CPUs, on a GPU model for one replica of one process, else blocks.",
                       choices=COMPILE_MODES)
    compile_backend: str = opt("inductor", "torch.compile's backend: inductor (generated kernels, the fast one); "
                               "aot_eager (traces forward and backward and runs them eagerly: no C++ compiler, for "
                               "checks).", choices=("inductor", "aot_eager"))
    profile_steps: str = opt("", "Profile steps A-B (e.g. 3-5) with torch.profiler into runs/<id>/trace/rank<R>.json "
                             "(Chrome trace, viewable in Perfetto; `gptpar trace` analyses them); empty: none.")
    dump_grads: str = opt("", "Folder where each rank saves the gradients of the run's last step, synced and as the "
                          "optimizer applied them, as model<RANK>_gradients.pth ({GPT-2 parameter name: tensor}, the "
                          "assignment's check); empty: none. Not with sharded gradients "
                          f"({', '.join(strategies_where(lambda r: not r.whole_gradients))}) or tp.")
    # Flat keys (train.lora_rank, not train.lora.rank): a config is sections of scalar keys, which every reader of
    # it (overrides, sweeps, the reference, the report's parameter columns) walks as `section.key`.
    lora_rank: int = opt(0, "LoRA (through peft): the rank r of the low-rank adapters added beside the adapted layers "
                         "(train.lora_targets), which alone train: every other weight is frozen (no gradient, no "
                         "optimizer state). 0: off, the whole model trains. With parallel.dp_sync "
                         f"{either(strategies_where(lambda r: not r.without_lora), 'and')}; not with parallel.pp, tp "
                         "or ep > 1, or the one-process pipeline modes.", min=0, max=65_536)
    lora_alpha: float = opt(16.0, "LoRA: the adapters' scale is lora_alpha / lora_rank.", min=0.0)
    lora_dropout: float = opt(0.0, "LoRA: dropout on the adapters' input.", min=0.0, max=1.0)
    lora_targets: str = opt("", "LoRA: the layers adapted, comma-separated module names or their dotted tails "
                            "(q_proj, attn.c_attn), as peft matches them; empty: the architecture's attention "
                            "projections (gptpar/architectures.py: GPT-2's attn.c_attn and attn.c_proj, the Llama "
                            "family's q_proj, k_proj, v_proj and o_proj).")


@dataclass(frozen=True)
class ParallelConfig:
    dp: int = opt(1, "Data-parallel ranks (spawned locally when not under SLURM or torchrun).", min=1,
                  max=65_536)
    dp_sync: str = opt("bucketed", "Data-parallel strategy (the table in gptpar/strategies/data_parallel.py): " +
                       "; ".join(f"{name}: {row.help}" + (" (not with parallel.pp > 1)" if row.without_pipeline else "")
                                 for name, row in DP_STRATEGIES.items()) + ".",
                       choices=DP_STRATEGIES)
    pp: int = opt(1, "Pipeline stages, each its own rank (the multi-process engine); the job has "
                  "dp * pp ranks. 1 keeps the one-process modes of parallel.pp_mode.", min=1, max=4096)
    pp_schedule: str = opt("1f1b", "Schedule of the multi-process pipeline (parallel.pp > 1).",
                           choices=SCHEDULES)  # the table in gptpar/strategies/pipeline.py
    pp_virtual: int = opt(1, "Model chunks per pipeline rank (interleaved_1f1b needs >= 2).", min=1,
                          max=256)
    pp_split: str = opt("", "Blocks per pipeline stage, e.g. 3,3,2 (pp * pp_virtual numbers); empty "
                        "balances them by parallel.balance.")
    tp: int = opt(1, "Tensor-parallel ranks per model replica: attention heads, MLP columns and the vocabulary split "
                  "over them (neighbouring ranks, so one node); the job has pp * dp * tp ranks.", min=1, max=4096)
    ep: int = opt(1, "Expert parallelism, inside data parallelism (a mixture of experts): each block's experts are "
                  "split over groups of ep neighbouring data-parallel ranks (n_experts / ep each), tokens reach their "
                  "experts' ranks by all-to-all and come back; attention and the dense parts stay data-parallel "
                  f"({either(strategies_where(lambda r: r.expert_parallel and bool(r.sharded)), 'and')} shard what "
                  "they shard of it; the experts' state stays whole on their ranks). ep divides parallel.dp and "
                  "model.n_experts and adds no ranks; parallel.dp_sync "
                  f"{either(strategies_where(lambda r: r.expert_parallel))}.", min=1, max=65_536)
    cp: int = opt(1, "Context parallelism: each sequence split over cp ranks per model replica (attention's "
                  "memory falls as 1/cp); the job has pp * dp * cp * tp ranks, gradients averaged over dp * cp. "
                  "Composed with data parallelism (every parallel.dp_sync, its shards over dp * cp; not parallel.hpz), "
                  "expert parallelism, our tensor parallelism and the multi-process pipeline, on GPT-2, Llama, Qwen2 "
                  "and their mixtures, data.task=lm, sft or translation (packed or not; with tp or pp not packed), "
                  "bf16 and train.compile too.", min=1, max=4096)
    cp_impl: str = opt("ring", "parallel.cp > 1, whose ranks hold the sequence in 2 * cp chunks, rank r chunks r "
                       "and 2 * cp - 1 - r so every rank has an equal share of the causal work (data.seq_len divisible "
                       "by 2 * cp, pair rows padded to a multiple of it): ring (K/V passed around the cp ranks, "
                       "partial results merged by log-sum-exp) or all_to_all (Ulysses: heads exchanged for sequence "
                       "before attention and back after; model.n_head divisible by cp).",
                       choices=("ring", "all_to_all"))
    tp_impl: str = opt("gptpar", "Tensor parallelism: " + "; ".join(
        f"{name} ({impl.help}; with dp > 1 only dp_sync="
        f"{either([sync for sync, row in DP_STRATEGIES.items() if name in row.tensor_parallel])}"
        f"{'' if impl.with_pipeline else '; not with parallel.pp > 1'})" for name, impl in TP_IMPLS.items()) + ".",
                       choices=TP_IMPLS)
    sequence_parallel: bool = opt(False, "With parallel.tp > 1: layer norms, dropout and residuals on sequence shards, "
                                  "all-gather and reduce-scatter instead of all-reduce (Megatron-SP); data.seq_len "
                                  "must divide by tp (translation pads its batches to a multiple of tp).")
    loss_parallel: bool = opt(False, "With parallel.tp > 1: the cross-entropy on vocabulary shards, never gathering "
                              "the whole logits.")
    bucket_mb: float = opt(25.0, "Bucket size of the bucketed reducer, in MB.", min=0.001,
                           max=1_048_576.0)
    grad_comm: str = opt("fp32", "What gradients are sent in over the replicas: fp32; bf16 or fp16 (half the bytes: "
                         "each rank casts its gradient, divides it by the replica count and sums in that type, as "
                         "torch's bf16/fp16_compress_hook do; the average is copied back into fp32; every "
                         "parallel.dp_sync: ddp through torch's hooks, fsdp2 through its reduce_dtype); int8 (about a "
                         "quarter: blocks of parallel.quant_block values with one scale each, reduced by all-to-all, "
                         "summed in fp32 on each rank's shard (and all-gathered where every rank needs the average), "
                         f"ZeRO++'s qgZ; {either(strategies_where(lambda r: 'int8' in r.grad_comm), 'and')}); "
                         "powersgd (torch's low-rank PowerSGD hook, of rank parallel.powersgd_rank, with error "
                         "feedback saved in checkpoints; "
                         f"{either(strategies_where(lambda r: 'powersgd' in r.grad_comm))}, from its third step).",
                         choices=GRAD_COMMS)
    param_comm: str = opt("fp32", f"What {either(strategies_where(lambda r: len(r.param_comm) > 1))} gathers its "
                          "parameters in, forward and backward (the optimizer's shards "
                          "stay fp32, the master copy): fp32; bf16 (half the bytes: each shard cast for the wire and "
                          "back); int8 (about a quarter: each shard in blocks of parallel.quant_block values with one "
                          "fp32 scale each, ZeRO++'s qwZ). Every rank, its own shard included, computes with the "
                          "weights as they came over the wire, so replicas stay bitwise equal.", choices=PARAM_COMMS)
    hpz: bool = opt(False, f"ZeRO++'s hpZ ({either(strategies_where(lambda r: r.hpz))}):"
                    " the first all-gather of each unit in a step (over all of dp) also "
                    "keeps this node's share of it, a secondary copy of 1/parallel.hpz_node_size of the parameters "
                    "in parallel.param_comm's type, from which every later gather of the step (backward's, and the "
                    "forwards of further micro-steps) is made within the node; dropped at the optimizer step.")
    hpz_node_size: int = opt(0, "parallel.hpz: data-parallel ranks per hpZ group (a divisor of parallel.dp); 0: those "
                             "on one node, the launcher's ranks per node (LOCAL_WORLD_SIZE, SLURM's tasks per node) "
                             "over parallel.tp, at most parallel.dp.", min=0, max=65_536)
    offload: str = opt("none", "What lives on the host instead of the device (each strategy row's `offloads` says "
                       "which it moves): none; optimizer: the optimizer state and its step run on the host; params: "
                       "the parameters, gradients and optimizer state. On a CPU-only machine host and device are one "
                       "memory, and the memory record's host_bytes still counts what moved.", choices=OFFLOADS)
    zero_stage: int = opt(2, "parallel.dp_sync=deepspeed: DeepSpeed's ZeRO stage, what it shards over the replicas: 1 "
                          "the optimizer state; 2 the gradients too; 3 the parameters too. Read by no other "
                          "dp_sync (each of ours is one stage: zero1, zero2, fsdp), which refuses a value other than "
                          "2.", min=1, max=3)
    quant_block: int = opt(256, "parallel.grad_comm=int8 and parallel.param_comm=int8: values per quantisation block "
                           "(one fp32 scale each); each gradient or bucket is padded to a multiple of dp * "
                           "quant_block, each parameter shard to a multiple of quant_block.", min=1, max=2**24)
    powersgd_rank: int = opt(1, "parallel.grad_comm=powersgd: rank of PowerSGD's low-rank approximation of each "
                             "gradient matrix.", min=1, max=4096)
    backend: str = opt("auto", "auto: nccl when CUDA is visible, else gloo.",
                       choices=("auto", "gloo", "nccl"))
    timeout_s: float = opt(120.0, "Seconds before a dead or hung rank fails the job.", min=1.0,
                           max=2_592_000.0)
    stuck_after_s: float = opt(0.0, "Seconds the ranks may wait in one collective before `gptpar status` shows the "
                               "run stuck, naming the collective and who has not entered it (below "
                               "parallel.timeout_s, which then fails the job); 0: half of parallel.timeout_s.",
                               min=0.0, max=2_592_000.0)
    pp_mode: str = opt("single", "One-process modes (parallel.pp = 1): single | model_parallel (layers "
                       "split over devices) | pipeline_parallel (GPipe micro-batches over threads).",
                       choices=("single", "model_parallel", "pipeline_parallel"))
    chunks: int = opt(4, "Micro-batches per batch in pipeline_parallel mode and in the multi-process "
                      "pipeline (parallel.pp > 1).", min=1, max=65_536)
    devices: str = opt("", "Comma-separated devices of the model/pipeline stages, e.g. cuda:0,cuda:1 "
                       "or cpu,cpu; empty uses every visible GPU, else one CPU.")
    balance: str = opt("layers", "How blocks are spread over stages: equal block counts, equal parameter "
                       "counts, or equal measured forward+backward time (embeddings and head included).",
                       choices=("layers", "params", "time"))


@dataclass(frozen=True)
class LaunchConfig:
    profile: str = opt("local", "Cluster profile: a name in gptpar/cluster/profiles/ or a path to a .yaml file.")
    cluster: str = opt("auto", "auto: SLURM when reachable, else local processes.",
                       choices=("auto", *CLUSTERS))
    launcher: str = opt(DEFAULT_LAUNCHER, "How a job is handed over (the table in gptpar/launchers.py): " +
                        " or ".join(f"{name} ({row.help})" for name, row in LAUNCHERS.items()) + ".",
                        choices=LAUNCHERS)
    partition: str = opt("", "SLURM partition; empty uses the profile's default.")
    account: str = opt("", "SLURM account (-A).")
    qos: str = opt("", "SLURM QOS (-q).")
    constraint: str = opt("", "SLURM constraint (-C).")
    gpu_type: str = opt("", "GPU type, e.g. v100-32; empty uses the profile's.")
    gpus: int = opt(1, "GPUs per node (one task per GPU for DP).", min=0, max=256)
    nodes: int = opt(1, "Nodes.", min=1, max=65_536)
    cpus_per_task: int = opt(0, "CPUs per task; 0 uses the profile's default.", min=0, max=4096)
    time: str = opt("00:30:00", "Walltime, HH:MM:SS or D-HH:MM:SS.")
    signal_s: int = opt(120, "Seconds before the time limit at which USR2 asks for checkpoint+requeue.",
                        min=0, max=2_592_000)
    max_concurrent: int = opt(4, "Concurrent array tasks of a sweep.", min=1, max=65_536)
    venv: str = opt("", "Virtualenv activated in job scripts; empty uses this checkout's .venv.")
    repeat: int = opt(0, "Which repetition of a sweep point this run is (a sweep's `repeats`); it changes nothing "
                      "in training and lets the report measure run-to-run spread.", min=0, max=1000)


@dataclass(frozen=True)
class LogConfig:
    runs_dir: str = opt("runs", "Where run folders are written.")
    run_id: str = opt("", f"Run folder name, at most {RUN_ID_MAX} characters; empty derives NAME.N (the next number; "
                          "NAME is the job kind for gptpar submit), or NAME-<job id> in a SLURM job.")
    name: str = opt("run", "Human name of the run, the prefix of its run id.")
    every: int = opt(10, "Print progress every N steps (plain-line mode).", min=1)
    sync_every: int = opt(0, "Read the steps' loss, gradient norm and time back from the device every N steps, so "
                          "that no step waits for the GPU (the JSONL still gets every step's record; a stop signal "
                          "is acted on at these reads); 0: 1 on CPUs, 10 on GPUs.", min=0, max=1_000_000)
    progress: str = opt("auto", "auto: a bar on a terminal, lines otherwise.",
                        choices=("auto", "bar", "lines", "none"))
    tensorboard: bool = opt(False, "Also write step and evaluation scalars to runs/<id>/tb/ (needs the tensorboard "
                            "extra); the JSONL log stays the source of truth.")
    wandb: str = opt("off", "Also log to Weights & Biases (needs the wandb extra): offline writes runs/<id>/wandb/ "
                     "for a later `wandb sync`, online streams (needs internet).", choices=("off", "offline", "online"))
    wandb_project: str = opt("gptpar", "W&B project of log.wandb runs.")


@dataclass(frozen=True)
class ReportConfig:
    target_loss: float = opt(0.0, "Validation loss (train loss for a run without evaluation) whose first crossing "
                             "`gptpar report` times for every run of the sweep (time and tokens to target); 0: the "
                             "highest final loss any point of the sweep reached, so every point gets a value. "
                             "`gptpar report --target-loss` overrides it.", min=0.0)
    target_accuracy: float = opt(0.0, "data.task=classify: validation top-1 accuracy (0-1) whose first reaching (at or "
                                 "above) `gptpar report` times for every run of the sweep that logs accuracy; 0: the "
                                 "lowest final accuracy any of them reached, so every one gets a value.", min=0.0,
                                 max=1.0)
    plan_calibration: str = opt("", "Plan the run: a calibration file (`gptpar plan calibrate`), or shipped (the "
                                "shipped calibration of the job's device). Its folder gets plan.json, the prediction "
                                "of `gptpar plan predict` made before any rank starts, and `gptpar report` sets it "
                                "beside the measured step time, tokens/s and memory. Empty: not planned.")
    straggler_ratio: float = opt(1.2, "`gptpar report` and `gptpar status` flag a straggler: a rank whose compute time "
                                 "(the step record's compute_s) is above this many times the median of its peers' (the "
                                 "other ranks of its pipeline stage) on at least half of the steps, with its host and "
                                 "the time the job lost waiting for it.", min=1.0, max=100.0)


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    log: LogConfig = field(default_factory=LogConfig)
    report: ReportConfig = field(default_factory=ReportConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}


def section_class(name: str) -> type:
    """The dataclass of a config section by its name (the reference walks every section's fields)."""
    return typing.get_type_hints(Config)[name]

