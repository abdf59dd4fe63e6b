"""The parameters a LoRA model trains (train.lora_rank > 0), counted from its shape alone, without torch: what the
planner prices a LoRA run by. The torch side (gptpar/models/lora.py) builds the adapters through peft; a test builds
every family's model on the meta device and holds this count to its `trainable_count`.

peft adapts a layer of (in, out) with A (r x in) and B (out x r): r (in + out) parameters in two tensors, for a linear
layer, GPT-2's Conv1D, an embedding (in: its rows) and a convolution (in: its fan-in, B a 1 x 1 convolution). The
layers adapted are those whose module name matches a target by peft's rule (`matches`); each layer once, however many
targets match it. The architecture's `lora_trained` modules (ViT's classifier) train whole beside them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gptpar.architectures import ARCHITECTURES
from gptpar.presets import ModelShape


def lora_targets(arch: str, named: str) -> list[str]:
    """train.lora_targets (`named`, comma-separated), or the defaults of architecture `arch` (its registry row) where it
    is empty."""
    targets = [name.strip() for name in named.split(",") if name.strip()]
    return targets or list(ARCHITECTURES[arch].lora_targets)


def matches(module_name: str, target: str) -> bool:
    """peft's rule: a module is a target where its name is the target or ends with `.target`."""
    return module_name == target or module_name.endswith(f".{target}")


@dataclass(frozen=True)
class Layer:
    """One layer peft can adapt: its module's name (in a block: after the block's own prefix), fan-in and fan-out."""

    name: str
    fan_in: int
    fan_out: int
    bias: bool = False

    @property
    def parameters(self) -> int:
        """Its own weight and bias (what it trains whole where it is a `lora_trained` module)."""
        return self.fan_in * self.fan_out + (self.fan_out if self.bias else 0)


@dataclass(frozen=True)
class Family:
    """The adaptable layers of one family's model of a shape: before the blocks, in each block (named under
    `blocks`.i), after them."""

    blocks: str
    first: list[Layer]
    block: list[Layer]
    last: list[Layer]


def _gpt2(s: ModelShape, vocab: int, head: bool) -> Family:
    """transformers' GPT2LMHeadModel: fused q, k, v (Conv1D, in x out), its projection and the MLP's two; the token and
    position tables; the head (tied or not, its own Linear module)."""
    d, w = s.n_embd, s.mlp_width
    block = [Layer("attn.c_attn", d, 3 * d), Layer("attn.c_proj", d, d), Layer("mlp.c_fc", d, w),
             Layer("mlp.c_proj", w, d)]
    first = [Layer("transformer.wte", vocab, d), Layer("transformer.wpe", s.n_positions, d)]
    return Family("transformer.h", first, block, [Layer("lm_head", d, vocab)] if head else [])


def _llama(s: ModelShape, vocab: int, head: bool) -> Family:
    """The Llama family's: q, k, v and o; a dense gated MLP, or a mixture's shared expert and its gate (a mixture's
    experts are fused tensors and its router no Linear: not counted here)."""
    d, kv = s.n_embd, s.kv_heads * s.head_dim
    block = [Layer("self_attn.q_proj", d, d), Layer("self_attn.k_proj", d, kv), Layer("self_attn.v_proj", d, kv),
             Layer("self_attn.o_proj", d, d)]
    if not s.moe:
        block += _gated("mlp", d, s.mlp_width)
    elif s.shared_inner:
        block += [*_gated("mlp.shared_expert", d, s.shared_inner), Layer("mlp.shared_expert_gate", d, 1)]
    return Family("model.layers", [Layer("model.embed_tokens", vocab, d)], block,
                  [Layer("lm_head", d, vocab)] if head else [])


def _gated(prefix: str, d: int, width: int) -> list[Layer]:
    return [Layer(f"{prefix}.gate_proj", d, width), Layer(f"{prefix}.up_proj", d, width),
            Layer(f"{prefix}.down_proj", width, d)]


def _vit(s: ModelShape, classes: int, head: bool) -> Family:
    """transformers' ViTForImageClassification: the patch projection (a convolution of 3 P x P channels), q, k, v
    and o, the MLP's fc1 and fc2, the classifier."""
    d, w = s.n_embd, s.mlp_width
    block = [*(Layer(f"attention.{p}_proj", d, d) for p in "qkvo"), Layer("mlp.fc1", d, w), Layer("mlp.fc2", w, d)]
    patch = Layer("vit.embeddings.patch_embeddings.projection", 3 * s.patch_size ** 2, d, bias=True)
    return Family("vit.layers", [patch], block, [Layer("classifier", d, classes, bias=True)])


FAMILIES: dict[str, Callable[[ModelShape, int, bool], Family]] = {"gpt2": _gpt2, "llama": _llama, "vit": _vit}


@dataclass(frozen=True)
class Trainable:
    """What trains under LoRA, in the pieces the planner prices apart: the parameters before the blocks (the tables'
    or the patch projection's adapters), in the blocks (all of them: a target may name one block's layer), after them
    (the head's adapters, the `lora_trained` modules whole), and the tensors they are (a per-tensor sync reduces each
    alone)."""

    first: int
    blocks: int
    last: int
    tensors: int
    head_whole: bool  # the head trains whole (a `lora_trained` classifier): its weight gradient is computed
    whole: int  # of them, the `lora_trained` modules' own parameters (the model's; the rest are new)

    @property
    def total(self) -> int:
        return self.first + self.blocks + self.last

    @property
    def adapters(self) -> int:
        """The parameters peft adds to the model (A and B of every adapted layer)."""
        return self.total - self.whole


def lora_trainable(shape: ModelShape, vocab: int, rank: int, targets: list[str], head: bool = True
                   ) -> Trainable | list[str]:
    """The parameters that train with adapters of `rank` on `targets` (train.lora_targets resolved), `vocab` the token
    table's rows (a classifier's classes), `head` whether the LM head is a layer peft can adapt (a padded table's is
    gptpar's PaddedHead, which it cannot). Where some targets match no layer this closed form knows (an unknown name,
    a mixture's experts or router, a norm), those targets: the caller cannot count that run."""
    family = FAMILIES.get(ARCHITECTURES[shape.arch].family)
    if family is None:
        return list(targets)
    f = family(shape, vocab, head)
    layers = [*f.first, *(Layer(f"{f.blocks}.{i}.{layer.name}", layer.fan_in, layer.fan_out, layer.bias)
                          for i in range(shape.n_layer) for layer in f.block), *f.last]
    unknown = [t for t in targets if not any(matches(layer.name, t) for layer in layers)]
    if unknown:
        return unknown
    trained = ARCHITECTURES[shape.arch].lora_trained

    def count(part: list[Layer]) -> tuple[int, int]:
        """(parameters, tensors) of the adapters on `part`'s layers and of the `lora_trained` ones among them whole."""
        n = tensors = 0
        for layer in part:
            if any(matches(layer.name, t) for t in targets):
                n, tensors = n + rank * (layer.fan_in + layer.fan_out), tensors + 2
            if layer.name in trained:
                n, tensors = n + layer.parameters, tensors + 1 + layer.bias
        return n, tensors

    first, blocks, last = count(f.first), count(layers[len(f.first):len(layers) - len(f.last)]), count(f.last)
    return Trainable(first[0], blocks[0], last[0], first[1] + blocks[1] + last[1],
                     any(layer.name in trained for layer in f.last),
                     sum(layer.parameters for layer in layers if layer.name in trained))
