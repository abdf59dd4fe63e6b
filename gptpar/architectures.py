"""The one registry of architectures, importable without torch: each row names an architecture (transformers'
`model_type`), its family, what a torch-free reader needs of it (traits, whether it is a mixture of experts), and
the code that serves it, as "module:Object" strings that the torch side loads by name: its description
(gptpar/models, read by `gptpar.models.architecture`) and its tensor-parallel plans, ours and PyTorch's
(gptpar/parallel/tensor_parallel, read by `shard_model`). The config's choices (presets.py, config/), the planner and
the FLOPs read the rest of the row.

An image classifier (ViT) is a row of kind "classifier": no token table, LM head or tensor-parallel plan.
A decoder of an existing family: a row here, its description beside its family's (models/llama.py) and a preset. A new
family: a row, its description file (models/) and its plan file (parallel/tensor_parallel/).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchTraits:
    """What a torch-free reader needs to know of an architecture."""

    learned_positions: bool  # a position table (gpt2) rather than rotary embeddings
    norm_biases: bool  # LayerNorm with a bias (gpt2) rather than RMSNorm (weight only)
    gated_mlp: bool  # gate and up projections, then down (Llama) rather than fc and proj (gpt2)
    qkv_bias: bool
    out_bias: bool  # on the attention's output projection
    mlp_bias: bool


@dataclass(frozen=True)
class ArchitectureRow:
    """One architecture: `name` is transformers' config.model_type."""

    name: str
    family: str  # the row whose layers it shares, so whose tensor-parallel plan shards it
    traits: ArchTraits
    mixture: bool  # a mixture of experts (parallel.ep, the router's loss)
    description: str  # "module:Object" of its `gptpar.models.Architecture`
    tp_shard: str  # "module:function" that shards it by our tensor-parallel plan (parallel.tp_impl=gptpar)
    torch_tp_shard: str = ""  # PyTorch's (parallel.tp_impl=torch); "" where none is built
    # The modules train.lora_rank adapts when train.lora_targets is empty, as peft matches them (a module's name or
    # its dotted tail): the attention's projections (peft's own defaults name none for some architectures).
    lora_targets: tuple[str, ...] = ()
    # Modules that train whole beside the adapters under train.lora_rank (a classifier's new head)
    lora_trained: tuple[str, ...] = ()
    kind: str = "decoder"  # decoder: a language model (token ids to next-token logits); classifier: images to classes

    @property
    def classifier(self) -> bool:
        """An image classifier (ViT): data.task=classify, data parallelism only, no token table or LM head."""
        return self.kind == "classifier"


GPT2_TRAITS = ArchTraits(learned_positions=True, norm_biases=True, gated_mlp=False, qkv_bias=True, out_bias=True,
                         mlp_bias=True)
LLAMA_TRAITS = ArchTraits(learned_positions=False, norm_biases=False, gated_mlp=True, qkv_bias=False, out_bias=False,
                          mlp_bias=False)
QWEN2_TRAITS = ArchTraits(learned_positions=False, norm_biases=False, gated_mlp=True, qkv_bias=True, out_bias=False,
                          mlp_bias=False)
VIT_TRAITS = ArchTraits(learned_positions=True, norm_biases=True, gated_mlp=False, qkv_bias=True, out_bias=True,
                        mlp_bias=True)
GPT2_TP = "gptpar.parallel.tensor_parallel.gpt2:shard_gpt2"
LLAMA_TP = "gptpar.parallel.tensor_parallel.llama:shard_llama"
GPT2_LORA = ("attn.c_attn", "attn.c_proj")  # q, k and v fused in one Conv1D, then the output projection
LLAMA_LORA = ("q_proj", "k_proj", "v_proj", "o_proj")  # a mixture's too: its experts are fused tensors, not layers
ROWS = (
    ArchitectureRow("gpt2", "gpt2", GPT2_TRAITS, False, "gptpar.models.gpt2:GPT2", GPT2_TP,
                    "gptpar.parallel.tensor_parallel.torch_plan:parallelize_gpt2", GPT2_LORA),
    ArchitectureRow("llama", "llama", LLAMA_TRAITS, False, "gptpar.models.llama:LLAMA", LLAMA_TP,
                    "gptpar.parallel.tensor_parallel.torch_plan:parallelize_llama", LLAMA_LORA),
    ArchitectureRow("qwen2", "llama", QWEN2_TRAITS, False, "gptpar.models.llama:QWEN2", LLAMA_TP,
                    "gptpar.parallel.tensor_parallel.torch_plan:parallelize_llama", LLAMA_LORA),
    # the mixtures: our plan only, each mixture's MLP kept whole (tensor_parallel/llama.py)
    ArchitectureRow("mixtral", "llama", LLAMA_TRAITS, True, "gptpar.models.moe:MIXTRAL", LLAMA_TP,
                    lora_targets=LLAMA_LORA),
    ArchitectureRow("qwen2_moe", "llama", QWEN2_TRAITS, True, "gptpar.models.moe:QWEN2_MOE", LLAMA_TP,
                    lora_targets=LLAMA_LORA),
    # an image classifier: GPT-2's block (LayerNorm with biases, biased q/k/v/o, a 4x GELU MLP), no tensor parallelism;
    # transformers names its attention's projections as Llama's, and its head (classifier) trains whole under LoRA
    ArchitectureRow("vit", "vit", VIT_TRAITS, False, "gptpar.models.vit:VIT", "", lora_targets=LLAMA_LORA,
                    lora_trained=("classifier",), kind="classifier"),
)
ARCHITECTURES: dict[str, ArchitectureRow] = {row.name: row for row in ROWS}
ARCHS = tuple(ARCHITECTURES)
MOE_ARCHS = tuple(name for name, row in ARCHITECTURES.items() if row.mixture)
CLASSIFIER_ARCHS = tuple(name for name, row in ARCHITECTURES.items() if row.classifier)
LANGUAGE_ARCHS = tuple(name for name in ARCHS if name not in CLASSIFIER_ARCHS)
