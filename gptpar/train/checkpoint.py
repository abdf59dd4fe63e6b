"""Checkpoints for every parallelism, written with torch.distributed.checkpoint (DCP).

DCP lets each rank write only what it owns (replicated tensors once, shards of FSDP/ZeRO, pipeline stages or
tensor-parallel slices each by their owner) and reshards on load, so one format serves every layout. A save is
atomic at the folder level: DCP writes into `checkpoint.tmp`, then rank 0 renames it into place, so a job killed
at any moment leaves a loadable checkpoint (the previous one or the new one). The run folder must be on a
filesystem that every rank sees. A checkpoint is read without running code from it (gptpar.train.checkpoint_reader):
a file that names anything but DCP's own types and tensors is refused in one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.optim import Optimizer
from transformers.utils import logging as transformers_logging

from gptpar.atomic import atomic_write, os_error, probe_space, write_error
from gptpar.config import load_config
from gptpar.errors import GptparError, first_sentence
from gptpar.models import architecture
from gptpar.models.build import build_model
from gptpar.models.lora import adapter_config, adapter_part, base_name
from gptpar.parallel.data_parallel.base import GradSync
from gptpar.parallel.data_parallel.fsdp import join_pieces
from gptpar.parallel.pipeline.names import plain_state
from gptpar.paths import check_path
from gptpar.run.folder import CHECKPOINT_DIR, CONFIG_FILE, EXPORT_FILE, OLD_SUFFIX, TMP_SUFFIX, run_entry
from gptpar.train.checkpoint_reader import CheckedLoadPlanner, CheckedReader, CheckedWholeLoadPlanner
from gptpar.train.reshard import load_resharded, needs_reshard

# Optimizer state keyed by parameter name throughout (param_groups too, not by group index): pipeline stages
# hold different parameters, and a group's index would name different parameters on each stage's rank.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
METADATA_FILE = ".metadata"  # DCP's index of the checkpoint, written last by the coordinator rank


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _is_main() -> bool:
    return not _distributed() or dist.get_rank() == 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns on every single-process save/load, even with no_dist=True; that is the intended use here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _fsync_dir(path: Path) -> None:
    """Make a rename durable: it lives in the directory entry, which the files' own fsync does not cover."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: str | Path, state: dict[str, Any]) -> Path:
    """Save `state` (Stateful objects or plain values) as the run's checkpoint, replacing the previous one.

    Collective: every rank calls it when a process group is initialised.
    """
    final = checkpoint_dir(run_dir)
    tmp, old = final.with_name(final.name + TMP_SUFFIX), final.with_name(final.name + OLD_SUFFIX)
    if _is_main():
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a save killed midway; DCP would mix its files with ours
    _barrier()
    try:
        with _quiet():
            dcp.save(state, checkpoint_id=tmp, no_dist=not _distributed())
    except (Exception, CheckpointException) as exc:  # DCP gathers every rank's error: all ranks get here
        cause = _cause(exc)
        if not isinstance(cause, OSError):  # an error from another rank arrives without its cause
            cause = probe_space(final.parent) or cause
        if _distributed():
            with contextlib.suppress(Exception):
                dist.barrier()  # every rank has probed before the space of `tmp` is given back
        if _is_main():
            shutil.rmtree(tmp, ignore_errors=True)  # give the space back; `final` was never touched
        if isinstance(cause, OSError):
            raise _save_error(final, tmp, cause) from exc
        if isinstance(exc, CheckpointException):
            raise GptparError(f"cannot write checkpoint {tmp} ({_reason(exc)})") from exc
        raise
    _barrier()
    if _is_main():
        _fsync_dir(tmp)
        if final.exists():  # otherwise `old` may be the only complete checkpoint (swap killed): keep it until the end
            shutil.rmtree(old, ignore_errors=True)  # remains of a swap killed while deleting it
            final.rename(old)
        tmp.rename(final)
        _fsync_dir(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _save_error(final: Path, tmp: Path, cause: OSError) -> GptparError:
    """A failed save in one line: a full disk says so, and says which checkpoint the run resumes from."""
    previous = next((p for p in (final, final.with_name(final.name + OLD_SUFFIX)) if p.exists()), None)
    kept = f"the last good checkpoint {previous} is kept" if previous is not None else "no earlier checkpoint exists"
    return write_error(tmp, cause, kept)


def _cause(exc: BaseException) -> BaseException:
    """The error under DCP's wrapping: a CheckpointException holds each rank's (error, traceback), and
    torch's file writer reports a full disk as a RuntimeError raised while handling the OSError."""
    if isinstance(exc, CheckpointException) and exc.failures:
        exc = next(iter(exc.failures.values()))[0]
    return os_error(exc) or exc


def _existing(run_dir: str | Path) -> Path | None:
    """The checkpoint folder to read: `checkpoint`, or `checkpoint.old` when a swap was killed between renames."""
    final = checkpoint_dir(run_dir)
    return next((p for p in (final, final.with_name(final.name + OLD_SUFFIX)) if p.exists()), None)


def _reason(exc: BaseException) -> str:
    """The first sentence of the underlying error: DCP wraps each rank's error in a multi-line CheckpointException."""
    if isinstance(exc, CheckpointException) and exc.failures:
        exc = next(iter(exc.failures.values()))[0]
    return first_sentence(exc)


def _raise_refusal(exc: BaseException) -> None:
    """Raise the checkpoint reader's one-line refusal of a value where DCP wrapped it into its error (on every rank).
    The index is refused before DCP reads it (_check_metadata), since DCP folds that error into a message of its own."""
    cause = _cause(exc)
    if isinstance(cause, GptparError):
        raise cause from None


def _check_metadata(path: Path) -> Metadata:
    """The checkpoint's index; one line on an unreadable one before DCP reads it, since DCP logs a traceback on the
    way."""
    meta = path / METADATA_FILE
    if not meta.is_file():
        raise GptparError(f"checkpoint {path} is incomplete (it has no {METADATA_FILE}); "
                          f"delete {path} to start the run over")
    try:
        metadata = CheckedReader(path).read_metadata()
    except GptparError:  # refused: it names what a checkpoint never holds
        raise
    except Exception as exc:  # unpickling arbitrary bytes can raise nearly any exception type
        raise GptparError(f"checkpoint file {meta} is corrupt ({_reason(exc)}); delete {path} to start the run over"
                          ) from exc
    if not isinstance(metadata, Metadata):
        raise GptparError(f"checkpoint file {meta} is corrupt (it holds a {type(metadata).__name__}); "
                          f"delete {path} to start the run over")
    return metadata


def load_checkpoint(run_dir: str | Path, state: dict[str, Any], names: Callable[[str], str] = str) -> bool:
    """Load the run's checkpoint into `state` in place; False when the run has none yet.

    Stateful values get load_state_dict, tensors are filled in place and other plain values are replaced in the
    dict. A checkpoint of another layout is resharded (gptpar.train.reshard), its parameters matched by `names`.
    Collective, like save_checkpoint.
    """
    path = _existing(run_dir)
    if path is None:
        return False
    metadata = _check_metadata(path)
    try:
        with _quiet():
            if needs_reshard(state, metadata):  # written by another layout (--reshape)
                load_resharded(path, state, metadata, _distributed(), names)
            else:
                dcp.load(state, storage_reader=CheckedReader(path), planner=CheckedLoadPlanner(path),
                         no_dist=not _distributed())
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        _raise_refusal(exc)
        raise GptparError(f"cannot load checkpoint {path} ({_reason(exc)}); it is damaged or from a different "
                          f"model/optimizer; delete {path} to start the run over") from exc
    return True


def trained_lora(run_dir: str | Path) -> bool:
    """Whether the run trained LoRA adapters (train.lora_rank > 0 in its config)."""
    config = Path(run_dir) / CONFIG_FILE
    return config.is_file() and load_config(config).train.lora_rank > 0


def export_lora(run_dir: str | Path, out: str | Path, merge: bool = False) -> Path:
    """A LoRA run's (train.lora_rank > 0) trained adapters as peft writes them, a folder that
    `peft.PeftModel.from_pretrained(base, out)` loads onto the base model (adapter_config.json,
    adapter_model.safetensors; a classifier's trained head in it as peft's modules_to_save); with `merge` the model
    with the adapters merged into its weights, a folder that transformers' `from_pretrained` loads (config.json,
    model.safetensors). The vocabulary's padding is cut off. Single process; an existing `out` is replaced once the
    new one is complete."""
    from peft import get_peft_model  # only here (gptpar.models.lora says why)

    run_dir = Path(run_dir)
    path, out = _export_paths(run_dir, out)
    cfg = load_config(run_dir / CONFIG_FILE)
    if not cfg.train.lora_rank:
        raise GptparError(f"--merge: run {run_dir} trained no LoRA adapters (train.lora_rank=0), so there is nothing "
                          "to merge; export it without --merge")
    try:
        trainer = _read_whole(path)["trainer"]
    except (Exception, CheckpointException) as exc:
        _raise_refusal(exc)
        raise GptparError(f"cannot export checkpoint {path} ({_reason(exc)}); it is damaged") from exc
    arch = architecture(cfg.model.shape().arch)
    weights = plain_state(trainer["model"], arch, trainer["vocab_size"])
    model = build_model(dataclasses.replace(cfg.model, pad_vocab=1), trainer["vocab_size"], cfg.train.seed)
    model.load_state_dict({base_name(k): v for k, v in weights.items() if adapter_part(k) is None})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's note that it sets fan_in_fan_out for GPT-2's Conv1D
        adapted = get_peft_model(model, adapter_config(model, cfg.train))
    missing, unexpected = adapted.load_state_dict({f"base_model.model.{k}": v for k, v in weights.items()
                                                   if adapter_part(k) is not None}, strict=False)
    if unexpected or any(adapter_part(k) for k in missing):
        raise GptparError(f"cannot export checkpoint {path}: its adapters do not fit train.lora_* of {run_dir} "
                          f"({(unexpected or missing)[0]}); it is damaged or its config was edited")
    tmp = out.with_name(out.name + TMP_SUFFIX)
    shutil.rmtree(tmp, ignore_errors=True)
    transformers_logging.disable_progress_bar()  # a bar for one shard says nothing
    try:
        (adapted.merge_and_unload() if merge else adapted).save_pretrained(tmp)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_error(tmp, exc, f"the checkpoint {path} is unchanged") from None
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _export_paths(run_dir: str | Path, out: str | Path) -> tuple[Path, Path]:
    """The run's checkpoint to export and where to, checked: one line where the run has none, or `out` would write
    over a run folder's files."""
    path = _existing(run_dir)
    if path is None:
        raise GptparError(f"{run_dir} has no checkpoint to export ({checkpoint_dir(run_dir)} does not exist)")
    if (entry := run_entry(out)) is not None:
        raise GptparError(f"--out {str(out)!r} would write over {entry}, which run folder {entry.parent} keeps for its "
                          f"run; write the export outside it, or as {Path(run_dir) / EXPORT_FILE} (the default)")
    _check_metadata(path)
    return path, Path(out)


def export_checkpoint(run_dir: str | Path, out: str | Path) -> Path:
    """Write the whole checkpoint as one plain torch.save file (for users who want one file), shards made whole
    (fsdp's pieces joined into parameters), with the model also under its architecture's name (`gpt2`, `llama`,
    `qwen2`: the run's model.arch) in its transformers class's own names, whatever parallelism wrote it
    (`GPT2LMHeadModel(config).load_state_dict(torch.load(out)["gpt2"])`). Single process."""
    path, out = _export_paths(run_dir, check_path(out, "file", "--out", "name a file to write", must_exist=False))
    config = Path(run_dir) / CONFIG_FILE
    arch = architecture(load_config(config).model.shape().arch if config.is_file() else "gpt2")
    try:
        state = _read_whole(path)
        if isinstance(state.get("trainer"), dict) and "model" in state["trainer"]:  # a training run's checkpoint
            if "pieces" in state["trainer"]["model"]:  # fsdp's: every rank's pieces of the parameters
                state["trainer"]["model"] = join_pieces(state["trainer"]["model"])
            state[arch.name] = plain_state(state["trainer"]["model"], arch, state["trainer"].get("vocab_size"))
    except (Exception, CheckpointException) as exc:
        _raise_refusal(exc)
        raise GptparError(f"cannot export checkpoint {path} ({_reason(exc)}); it is damaged") from exc
    # Through a file object: torch.save to a path loses the OSError of a full disk ("basic_ios::clear").
    atomic_write(out, lambda f: torch.save(state, f), kept=f"the checkpoint {path} is unchanged")
    return out


def _read_whole(path: Path) -> dict[str, Any]:
    """A DCP checkpoint as one plain state dict in memory, as dcp_to_torch_save reads it before it writes (that
    function writes to a path itself, so its read and write failures could not be told apart)."""
    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=CheckedReader(path), planner=CheckedWholeLoadPlanner(path), no_dist=True)
    return state


def model_state(model: nn.Module, optimizer: Optimizer, sync: GradSync | None = None
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Model and optimizer state keyed by fully-qualified parameter names.

    The keys are the same whether the module is plain, DDP-wrapped (no `module.` prefix) or sharded, so a
    checkpoint written under one layout loads under another. An optimizer that has not stepped yet gets its state
    created (a zero-lr step on zero gradients), so that a fresh optimizer can be loaded into in place. A sync that
    shards the optimizer (ZeRO) names its shards' state itself (`GradSync.optimizer_state`), and one that shards
    the parameters too (fsdp) its pieces of them (`GradSync.parameter_state`): each rank writes its own.
    """
    if sync is not None and sync.engine_state:  # the engine's own checkpoint holds both (GradSync.save_engine)
        return {}, {}
    _create_state(optimizer)
    if sync is not None and sync.shards_optimizer:
        params = sync.parameter_state() if sync.shards_parameters else get_model_state_dict(model)
        return params, sync.optimizer_state(optimizer)
    return get_state_dict(model, optimizer, options=FLAT)


def _create_state(optimizer: Optimizer) -> None:
    """AdamW creates its state on the first step; a checkpoint loads in place, so a fresh optimizer needs it first.
    The parameters' own gradients (which may be views of a reducer's buckets) are set aside meanwhile."""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads, rates = [p.grad for p in params], [group["lr"] for group in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        optimizer.step()
    finally:
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        for group, lr in zip(optimizer.param_groups, rates, strict=True):
            group["lr"] = lr


def load_model_state(model: nn.Module, optimizer: Optimizer, model_sd: dict[str, Any],
                     optim_sd: dict[str, Any], sync: GradSync | None = None) -> None:
    """Inverse of model_state."""
    if sync is not None and sync.engine_state:
        return
    if sync is not None and sync.shards_optimizer:
        if sync.shards_parameters:
            sync.load_parameter_state(model_sd)
        else:
            set_model_state_dict(model, model_sd)
        sync.load_optimizer_state(optimizer, optim_sd)
        return
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=FLAT)
