"""Named model shapes of every architecture, importable without torch: the config checks them, the analysis
computes FLOPs from them, and gptpar/models builds the model of one.

An architecture is one decoder family: `gpt2` (learned positions, LayerNorm, a 4x GELU MLP, fused q/k/v with
biases, a tied head) and the Llama family (rotary positions, RMSNorm, grouped-query attention, a gated SiLU MLP):
`llama` (no biases) and `qwen2` (biases on q, k and v), and its mixtures of experts, whose MLP is E experts of which
a router picks the top k per token: `mixtral` (Llama's attention) and `qwen2_moe` (Qwen2's, and a shared expert every
token goes through, gated). What differs between them that the FLOPs, the parameter counts and the tensor-parallel
checks need is in the registry's traits (gptpar/architectures.py); the rest is in gptpar/models. `vit` is an image
classifier (transformers' ViTForImageClassification) with GPT-2's block shape: its presets add an image and patch size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gptpar.architectures import ARCHITECTURES, MOE_ARCHS, ArchTraits


@dataclass(frozen=True)
class ModelShape:
    """One model's shape. n_kv_head 0 means n_head (no grouping), n_inner 0 means 4 * n_embd (GPT-2's MLP). A
    mixture of experts has n_experts experts of width n_inner, top_k of them per token, and a shared expert of width
    shared_inner (0: none)."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_positions: int
    n_kv_head: int = 0
    n_inner: int = 0
    tied: bool = True  # the LM head is the token table itself
    rope_theta: float = 10_000.0
    n_experts: int = 0
    top_k: int = 0
    shared_inner: int = 0
    image_size: int = 0  # an image classifier (vit): square images of this many pixels a side ...
    patch_size: int = 0  # ... cut into patches of this many; n_positions is the patches and the class token

    @property
    def patches(self) -> int:
        """An image's patches (its tokens, the class token aside); 0 for a language model."""
        return (self.image_size // self.patch_size) ** 2 if self.patch_size else 0

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def mlp_width(self) -> int:
        return self.n_inner or 4 * self.n_embd

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def traits(self) -> ArchTraits:
        return ARCHITECTURES[self.arch].traits

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    def block_parameters(self, experts: int | None = None) -> int:
        """One block: q, k, v and output projections, the MLP, two norms (with their biases where they have them). A
        mixture's MLP is its router, `experts` gated experts (all by default) and the shared expert with its gate."""
        t, d = self.traits, self.n_embd
        attention = self.attention_parameters()
        if self.moe:
            experts = self.n_experts if experts is None else experts
            shared = 3 * d * self.shared_inner + d if self.shared_inner else 0
            mlp = self.n_experts * d + experts * 3 * d * self.mlp_width + shared
        else:
            mlp = (3 if t.gated_mlp else 2) * d * self.mlp_width
            if t.mlp_bias:
                mlp += (2 if t.gated_mlp else 1) * self.mlp_width + d
        return attention + mlp + 2 * self.norm_parameters()

    def attention_parameters(self) -> int:
        """One block's q, k, v and output projections with their biases."""
        t, d, kv = self.traits, self.n_embd, self.kv_heads * self.head_dim
        return 2 * d * d + 2 * d * kv + (d + 2 * kv if t.qkv_bias else 0) + (d if t.out_bias else 0)

    def active_block_parameters(self) -> int:
        """The parameters one token goes through in a block: a mixture's top_k experts, not all of them."""
        return self.block_parameters(self.top_k if self.moe else None)

    def norm_parameters(self) -> int:
        return (2 if self.traits.norm_biases else 1) * self.n_embd

    def parameters(self, vocab: int) -> int:
        """Every parameter: token table, positions, blocks, final norm, and the head where it is not the table. An
        image classifier's `vocab` is its classes: patch projection, class token, positions, blocks, final norm and
        the classifier (with biases)."""
        if self.patch_size:
            patch = 3 * self.patch_size ** 2 * self.n_embd + self.n_embd
            embeddings = patch + self.n_embd + (self.patches + 1) * self.n_embd
            head = vocab * (self.n_embd + 1)
            return embeddings + self.n_layer * self.block_parameters() + self.norm_parameters() + head
        positions = self.n_positions * self.n_embd if self.traits.learned_positions else 0
        tables = (1 if self.tied else 2) * vocab * self.n_embd
        return tables + positions + self.n_layer * self.block_parameters() + self.norm_parameters()

    def active_parameters(self, vocab: int) -> int:
        """The parameters one token goes through: all of them but the experts a mixture's router does not pick."""
        return self.parameters(vocab) - self.n_layer * (self.block_parameters() - self.active_block_parameters())

    def overridden(self, arch: str = "auto", n_layer: int = 0, n_embd: int = 0, n_head: int = 0,
                   n_positions: int = 0, n_kv_head: int = 0, n_experts: int = 0, top_k: int = 0,
                   image_size: int = 0) -> ModelShape:
        """The shape with the config's overrides (0 and auto keep this shape's). Another architecture keeps the
        sizes; GPT-2 has no grouped-query attention and its MLP is 4x wide; a dense one has no experts; an image
        classifier's positions follow its image size."""
        arch = self.arch if arch == "auto" else arch
        shape = replace(self, arch=arch, n_layer=n_layer or self.n_layer, n_embd=n_embd or self.n_embd,
                        n_head=n_head or self.n_head, n_positions=n_positions or self.n_positions,
                        n_experts=n_experts or self.n_experts, top_k=top_k or self.top_k,
                        image_size=image_size or self.image_size)
        if shape.patch_size:
            shape = replace(shape, n_positions=shape.patches + 1)
        if arch not in MOE_ARCHS:
            shape = replace(shape, n_experts=0, top_k=0, shared_inner=0)
        elif arch != "qwen2_moe":
            shape = replace(shape, shared_inner=0)
        if n_kv_head:
            shape = replace(shape, n_kv_head=n_kv_head)
        if arch == "gpt2":
            shape = replace(shape, n_kv_head=0, n_inner=0, tied=True)
        elif self.arch == "gpt2":  # a GPT-2 shape as a Llama-family model: the gated MLP's usual 8/3 d, rounded
            shape = replace(shape, n_inner=shape.n_inner or -(-8 * shape.n_embd // 3 // 64) * 64)
        return shape


def _gpt2(n_layer: int, n_embd: int, n_head: int, n_positions: int) -> ModelShape:
    return ModelShape("gpt2", n_layer, n_embd, n_head, n_positions)


def _vit(n_layer: int, n_embd: int, n_head: int, image_size: int, patch_size: int) -> ModelShape:
    """transformers' ViT: GPT-2's block shape (a 4x MLP, biases everywhere), an untied classifier head."""
    return ModelShape("vit", n_layer, n_embd, n_head, (image_size // patch_size) ** 2 + 1, tied=False,
                      image_size=image_size, patch_size=patch_size)


# The small ones exist so CPUs can train and test: the tiny Llama-family shapes have 4 query heads over 2 KV heads,
# so parallel.tp=2 splits both, and llama-tiny keeps an untied head where qwen2-tiny ties it (both kinds tested).
PRESETS: dict[str, ModelShape] = {
    "gpt2-tiny": _gpt2(4, 128, 4, 256),
    "gpt2-mini": _gpt2(6, 256, 8, 512),
    "gpt2-wide": _gpt2(4, 768, 12, 1024),  # GPT-2 width, few layers: compute-bound pipeline benchmarks
    "gpt2": _gpt2(12, 768, 12, 1024),
    "gpt2-medium": _gpt2(24, 1024, 16, 1024),
    "gpt2-large": _gpt2(36, 1280, 20, 1024),
    "gpt2-xl": _gpt2(48, 1600, 25, 1024),
    "llama-tiny": ModelShape("llama", 4, 128, 4, 256, n_kv_head=2, n_inner=352, tied=False),
    "qwen2-tiny": ModelShape("qwen2", 4, 128, 4, 256, n_kv_head=2, n_inner=352, tied=True),
    "llama-3.2-1b": ModelShape("llama", 16, 2048, 32, 131_072, n_kv_head=8, n_inner=8192, rope_theta=500_000.0),
    "qwen2.5-0.5b": ModelShape("qwen2", 24, 896, 14, 32_768, n_kv_head=2, n_inner=4864, rope_theta=1_000_000.0),
    "qwen2.5-3b": ModelShape("qwen2", 36, 2048, 16, 32_768, n_kv_head=2, n_inner=11_008, rope_theta=1_000_000.0),
    # Mixtures of experts: the tiny ones have 8 (qwen2_moe, with a shared expert) and 4 (mixtral) experts of width 64,
    # top-2, so an expert's load and the router's balance show on a CPU.
    "qwen2-moe-tiny": ModelShape("qwen2_moe", 4, 128, 4, 256, n_kv_head=2, n_inner=64, tied=False, n_experts=8,
                                 top_k=2, shared_inner=128),
    "mixtral-tiny": ModelShape("mixtral", 4, 128, 4, 256, n_kv_head=2, n_inner=96, tied=False, n_experts=4, top_k=2),
    "qwen1.5-moe-a2.7b": ModelShape("qwen2_moe", 24, 2048, 16, 8192, n_kv_head=16, n_inner=1408, tied=False,
                                    rope_theta=1_000_000.0, n_experts=60, top_k=4, shared_inner=5632),
    "mixtral-8x7b": ModelShape("mixtral", 32, 4096, 32, 32_768, n_kv_head=8, n_inner=14_336, tied=False,
                               rope_theta=1_000_000.0, n_experts=8, top_k=2),
    # Image classifiers (data.task=classify): vit-tiny trains on a CPU (32 px images, 16 patches of 8 px); vit-base is
    # ViT-B/16 (~86M parameters with 1000 classes), vit-huge ViT-H/14 (~632M).
    "vit-tiny": _vit(2, 64, 4, 32, 8),
    "vit-base": _vit(12, 768, 12, 224, 16),
    "vit-huge": _vit(32, 1280, 16, 224, 14),
}
