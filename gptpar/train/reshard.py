"""A checkpoint loaded into another layout's state (`gptpar train --reshape`), each rank reading only what it holds.

DCP reshards a tensor saved under one key into any sharding of that key (a whole tensor, FSDP2's DTensor rows). The
sharding syncs (zero1, zero2, our fsdp) key their flat shards' pieces by parameter and range instead,
`<name>[<start>:<end>]` (gptpar.parallel.data_parallel.sharded), which names other tensors under another world size
or another sync. Here every tensor of either kind is read as what it is: a range [lo, hi) of a parameter's flattened
value (or of one of its optimizer fields'); a rank asks DCP for the stored tensors that overlap its own ranges and
copies the overlaps. A stored piece is read whole, and so is a stored whole tensor: a rank holding a piece of a
parameter reads all of that parameter's stored value, all such at once (a zero rank of W reads about 1/W of the
model's state, its boundary parameters whole); reading ranges of rows is DCP's own business only under equal keys.

What maps: the model's parameters and AdamW's fields (exp_avg, exp_avg_sq, step) between plain tensors, DTensors
sharded by rows (Shard(0): FSDP2's, parallel.ep's experts) and pieces, under the names the trainer gives them in the
one-process model (`names`: a pipeline's `stages.<s>.` names, a tied head's copy on the last stage as the token
table); our tensor-parallel pieces (DTensors along other dimensions) are cut from their parameter's whole value,
read into a buffer. Not: a sharding sync's pieces under parallel.tp > 1, which cut across a tp rank's own pieces and
are stored per tp rank under `tp<r>/`: they match only a sharding sync's pieces under the same tp.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from gptpar.errors import GptparError
from gptpar.train.checkpoint_reader import CheckedLoadPlanner, CheckedReader

_PIECE = re.compile(r"^trainer\.(?:optimizer|model\.pieces)\.(?P<name>.+)\[(?P<start>\d+):(?P<end>\d+)\]"
                    r"(?:\.(?P<field>\w+))?$")
_STATE = "trainer.optimizer.state."
_MODEL = "trainer.model."
STEP = "step"  # AdamW's step count: one value per parameter, whatever range a piece holds
Names = Callable[[str], str]  # a parameter's name in a checkpoint of any layout -> the model's own
Finish = Callable[[], Any]  # what is left to do once a wanted tensor's values are in


@dataclass(frozen=True)
class Span:
    """A stored or wanted tensor as a range of one flattened value: `field` is "param" for the parameter itself."""

    name: str
    field: str
    lo: int
    hi: int


def _flat(key: str, shape: torch.Size, names: Names, lo: int = 0) -> Span | None:
    """The span a key names, the tensor of `shape` starting at element `lo` of its whole value, its parameter under
    the model's own name (`names`); None where the key is none of the model's or the optimizer's (a step count, a
    tensor-parallel piece)."""
    if match := _PIECE.match(key):
        return Span(names(match["name"]), match["field"] or "param", int(match["start"]), int(match["end"]))
    if key.startswith(_STATE):
        name, _, field = key.removeprefix(_STATE).rpartition(".")
        return Span(names(name), field, lo, lo + math.prod(shape))
    if key.startswith(_MODEL) and not key.startswith((_MODEL + "pieces.", _MODEL + "shapes.")) and "/" not in key:
        return Span(names(key.removeprefix(_MODEL)), "param", lo, lo + math.prod(shape))
    return None


def _wanted(key: str, value: torch.Tensor, names: Names) -> tuple[Span, torch.Tensor, Finish | None] | None:
    """What a tensor of this rank's state asks for, the flat view it is filled through, and what then remains to do:
    a DTensor's local rows are a range of its whole value (Shard(0)); a DTensor sharded along another dimension (our
    tensor-parallel pieces) is cut from its whole value, read into a buffer of its own."""
    if isinstance(value, DTensor):
        chunks = value.__create_chunk_list__()
        local = value.to_local()
        if len(chunks) != 1 or not local.is_contiguous():
            return None
        offsets = chunks[0].offsets
        if any(offsets[1:]) or local.shape[1:] != value.shape[1:]:
            return _region(key, value.shape, offsets, local, names)
        row = math.prod(value.shape[1:])
        span = _flat(key, local.shape, names, offsets[0] * row if value.dim() else 0)
        return (span, local.view(-1), None) if span is not None else None
    span = _flat(key, value.shape, names)
    return (span, value.view(-1), None) if span is not None and value.is_contiguous() else None


def _region(key: str, shape: torch.Size, offsets: torch.Size, local: torch.Tensor, names: Names
            ) -> tuple[Span, torch.Tensor, Finish] | None:
    """A piece of a tensor that is no range of its flattened value: the whole value is read into a buffer, and the
    piece cut from it (viewed in the piece's layout: GPT-2's fused q, k, v columns as (in, 3, out/3))."""
    span = _flat(key, shape, names)
    if span is None:
        return None
    whole = torch.empty(span.hi - span.lo, dtype=local.dtype)
    cut = tuple(slice(o, o + n) for o, n in zip(offsets, local.shape, strict=True))
    return span, whole, lambda: local.copy_(whole.view(shape)[cut])


def _stored(metadata: Metadata, names: Names) -> dict[tuple[str, str], list[tuple[str, Span, TensorStorageMetadata]]]:
    """The checkpoint's tensors by (parameter, field), each as the span it holds (once: a tied parameter's copies, as
    a pipeline's first and last stages hold the token table, hold the same span)."""
    found: dict[tuple[str, str], list[tuple[str, Span, TensorStorageMetadata]]] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata) and (span := _flat(key, meta.size, names)) is not None:
            held = found.setdefault((span.name, span.field), [])
            if all(have != span for _, have, _ in held):
                held.append((key, span, meta))
    return found


def needs_reshard(state: dict[str, Any], metadata: Metadata) -> bool:
    """Whether a tensor of `state` (Stateful values' state dicts) is not in the checkpoint under its key and shape."""
    flat, _ = flatten_state_dict(_plain(state))
    stored = metadata.state_dict_metadata
    return any(isinstance(v, torch.Tensor) and (k not in stored or getattr(stored[k], "size", None) != v.shape)
               for k, v in flat.items())


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    return {key: value.state_dict() if hasattr(value, "state_dict") else value for key, value in state.items()}


def load_resharded(path: Path, state: dict[str, Any], metadata: Metadata, distributed: bool,
                   names: Names = str) -> None:
    """Load the checkpoint at `path` into `state` whatever layout wrote it (see the module doc); `names` gives a
    parameter's name in any layout as the model's own (the trainer's checkpoint_name). Collective."""
    nested = _plain(state)
    flat, mapping = flatten_state_dict(nested)
    stored_meta, stored = metadata.state_dict_metadata, _stored(metadata, names)
    direct: dict[str, Any] = {}
    fills: list[tuple[str, Span, torch.Tensor]] = []
    finishes: list[Finish] = []
    for key, value in flat.items():
        meta = stored_meta.get(key)
        if not isinstance(value, torch.Tensor):
            if meta is not None:
                direct[key] = value  # a step count, a learning rate: kept as this layout has it when not stored
        elif meta is not None and getattr(meta, "size", None) == value.shape:
            direct[key] = value
        elif (wanted := _wanted(key, value, names)) is None:
            raise GptparError(f"cannot load checkpoint {path} into this layout: {key} has no counterpart in it")
        else:
            fills.append((key, *wanted[:2]))
            finishes += wanted[2:] if wanted[2] is not None else []
    fills = _untied(fills, stored, [v for v in direct.values() if isinstance(v, torch.Tensor)])
    requests = _requests(path, fills, stored)
    loaded = {**direct, **requests}  # DCP fills tensors in place and puts other values into this dict
    dcp.load(loaded, storage_reader=CheckedReader(path), planner=CheckedLoadPlanner(path), no_dist=not distributed)
    for key, span, view in fills:
        _fill(path, key, span, view, [(s, loaded[k]) for k, s, _ in stored[span.name, span.field] if k in requests])
    with torch.no_grad():
        for finish in finishes:
            finish()
    for key, value in unflatten_state_dict({**flat, **{k: loaded[k] for k in direct}}, mapping).items():
        if hasattr(state[key], "load_state_dict"):
            state[key].load_state_dict(value)
        else:
            state[key] = value


def _untied(fills: list[tuple[str, Span, torch.Tensor]],
            stored: dict[tuple[str, str], list[tuple[str, Span, TensorStorageMetadata]]],
            loaded: list[torch.Tensor]) -> list[tuple[str, Span, torch.Tensor]]:
    """`fills` less a tied parameter's second name (GPT-2's LM head) where the checkpoint holds only the first: the
    same tensor is filled through the name it has."""
    def where(t: torch.Tensor) -> tuple[int, int]:
        return t.data_ptr(), t.numel()
    held = {where(view) for _, span, view in fills if (span.name, span.field) in stored} | {where(t) for t in loaded}
    return [fill for fill in fills if (fill[1].name, fill[1].field) in stored or where(fill[2]) not in held]


def _requests(path: Path, fills: list[tuple[str, Span, torch.Tensor]],
              stored: dict[tuple[str, str], list[tuple[str, Span, TensorStorageMetadata]]]) -> dict[str, torch.Tensor]:
    """An empty tensor for each stored tensor that overlaps a wanted span (a step count: the first one stored)."""
    requests: dict[str, torch.Tensor] = {}
    for key, span, _ in fills:
        found = stored.get((span.name, span.field), [])
        if not found:
            raise GptparError(f"cannot load checkpoint {path} into this layout: it holds no {span.field} of "
                              f"{span.name} (for {key})")
        for skey, have, meta in found[:1] if span.field == STEP else found:
            if have.lo < span.hi and span.lo < have.hi or span.field == STEP:
                requests[skey] = torch.empty(meta.size, dtype=meta.properties.dtype)
    return requests


def _fill(path: Path, key: str, span: Span, view: torch.Tensor, have: list[tuple[Span, torch.Tensor]]) -> None:
    """Copy into `view` (span's elements) the overlaps of the stored tensors read; all of it must be covered."""
    if span.field == STEP:  # one count for the whole parameter, stored with each piece
        view.copy_(have[0][1].reshape(-1))
        return
    covered = 0
    with torch.no_grad():
        for part, value in have:
            lo, hi = max(span.lo, part.lo), min(span.hi, part.hi)
            if lo < hi:
                view[lo - span.lo:hi - span.lo] = value.reshape(-1)[lo - part.lo:hi - part.lo].to(view.dtype)
                covered += hi - lo
    if covered != span.hi - span.lo:
        raise GptparError(f"cannot load checkpoint {path} into this layout: it holds {covered} of the "
                          f"{span.hi - span.lo} values of {key}")
