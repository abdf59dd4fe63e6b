"""Reading a checkpoint without running code from it.

torch.distributed.checkpoint unpickles two things without restriction: the index (`.metadata`, by
FileSystemReader.read_metadata) and every non-tensor value (by DefaultLoadPlanner.load_bytes, with
torch.load(weights_only=False)). A run folder may come from someone else (a copied run, a shared filesystem), and a
pickle there can call any function it names (`os.system`) before the file is found to be no checkpoint. Here the
index is read by an unpickler that admits only the types DCP writes into it (listed below, as `pickletools.dis`
of real gptpar checkpoints shows them), and values by torch.load(weights_only=True), as DCP already reads tensors.
A file that names anything else is refused in one line, before anything it names is called.
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem
from torch.serialization import _get_layout, get_unsafe_globals_in_checkpoint

from gptpar.errors import GptparError

# Everything a `.metadata` refers to by name: DCP's dataclasses, the file reader's storage record, the tensor
# properties' encodings (torch.Size, a dtype, a layout by name, a memory-format enum), and the path DCP records the
# checkpoint was saved to. Each is a plain record or a value lookup: calling it with any arguments runs nothing else.
_METADATA_TYPES = (Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, TensorProperties,
                   MetadataIndex, StorageMeta, _MEM_FORMAT_ENCODING, _StorageInfo, torch.Size, _get_layout,
                   pathlib.PosixPath, collections.OrderedDict)
_METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **{(t.__module__, t.__qualname__): t for t in _METADATA_TYPES},
    **{("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
}


def refused(file: Path, names: list[str], value: str = "") -> GptparError:
    """The one-line refusal of a file (or of one `value` in it) that names something a checkpoint never holds."""
    what = f" the value of {value}" if value else ""
    return GptparError(f"{file}: refused to load{what}: it names {', '.join(names)}, which a checkpoint never holds; "
                       "gptpar did not write this file as it is (loading it could run code): do not use this folder")


class _MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only _METADATA_GLOBALS: every other global is refused before it is called (a
    pickle runs code only through the globals it names)."""

    def __init__(self, stream: IO[bytes], file: Path) -> None:
        super().__init__(stream)
        self.file = file

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _METADATA_GLOBALS[module, name]
        except KeyError:
            raise refused(self.file, [f"{module}.{name}"]) from None


class CheckedReader(FileSystemReader):
    """FileSystemReader whose read_metadata admits only the index's own types."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream, path).load()
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader: DCP's load id goes there
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _CheckedValues:
    """A load planner whose non-tensor values are read with torch.load(weights_only=True); `folder` names the
    checkpoint in a refusal. DefaultLoadPlanner.load_bytes, whose body this is, passes weights_only=False."""

    def __init__(self, folder: Path, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.folder = folder

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            value.seek(0)
            names = get_unsafe_globals_in_checkpoint(value)
            if not names:
                raise  # damaged, not foreign: the caller's "cannot load" says so
            file = self.folder / self.metadata.storage_data[read_item.storage_index].relative_path
            raise refused(file, names, fqn) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


class CheckedLoadPlanner(_CheckedValues, DefaultLoadPlanner):
    """dcp.load's default planner, values read with weights_only=True."""


class CheckedWholeLoadPlanner(_CheckedValues, _EmptyStateDictLoadPlanner):
    """The planner that reads a whole checkpoint into an empty dict (as dcp_to_torch_save), values read with
    weights_only=True."""
