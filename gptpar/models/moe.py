"""Mixtures of experts of the Llama family (transformers' MixtralForCausalLM, Qwen2MoeForCausalLM): the attention,
norms and rotary positions of Llama (Mixtral) or Qwen2 (Qwen2-MoE), and in every block, in place of the gated MLP,
a router (`mlp.gate`, a linear map to one logit per expert) that sends each token to its top-k experts, whose outputs
it weighs by their routing probabilities. transformers stores a block's experts fused: `mlp.experts.gate_up_proj`
(E, 2I, d) and `mlp.experts.down_proj` (E, d, I), expert e being row e of both. Qwen2-MoE adds a shared expert every
token goes through (`mlp.shared_expert`, a gated MLP) scaled by a sigmoid gate (`mlp.shared_expert_gate`).

Every parameter starts N(0, initializer_range) as the family's `_init_weights` draws it (the router included), the
norms at ones, Qwen2's q/k/v biases at zeros. The router's load-balancing loss is gptpar.train.moe's.
"""

from __future__ import annotations

from transformers import MixtralConfig, MixtralForCausalLM, PretrainedConfig, Qwen2MoeConfig, Qwen2MoeForCausalLM

from gptpar.models.llama import common_config, family
from gptpar.presets import ModelShape

EXPERTS = {"mlp.gate.weight": "normal", "mlp.experts.gate_up_proj": "normal", "mlp.experts.down_proj": "normal"}
SHARED = {f"mlp.shared_expert.{p}_proj.weight": "normal" for p in ("gate", "up", "down")} | {
    "mlp.shared_expert_gate.weight": "normal"}


def mixtral_config(shape: ModelShape, vocab_size: int, dropout: float) -> PretrainedConfig:
    return MixtralConfig(**common_config(shape, vocab_size, dropout), rms_norm_eps=1e-5,
                         num_local_experts=shape.n_experts, num_experts_per_tok=shape.top_k, router_jitter_noise=0.0,
                         sliding_window=None)


def qwen2_moe_config(shape: ModelShape, vocab_size: int, dropout: float) -> PretrainedConfig:
    return Qwen2MoeConfig(**common_config(shape, vocab_size, dropout), rms_norm_eps=1e-6, use_sliding_window=False,
                          num_experts=shape.n_experts, num_experts_per_tok=shape.top_k,
                          moe_intermediate_size=shape.mlp_width, shared_expert_intermediate_size=shape.shared_inner,
                          decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False)


MIXTRAL = family("mixtral", "Mixtral", MixtralForCausalLM, mixtral_config, biases=False, mlp=EXPERTS,
                 router="mlp.gate")
QWEN2_MOE = family("qwen2_moe", "Qwen2-MoE", Qwen2MoeForCausalLM, qwen2_moe_config, biases=True,
                   mlp=EXPERTS | SHARED, router="mlp.gate")
