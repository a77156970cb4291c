"""Reading DCP checkpoints without unpickling arbitrary objects.

DCP stores a checkpoint's index (`.metadata`: tensor names, shapes, dtypes, which file and byte range holds each
chunk) as a plain pickle and reads it with `pickle.load`; non-tensor values (`BytesStorageMetadata` entries) are read
back with `torch.load(weights_only=False)`. A checkpoint directory is data from disk: whoever can write it (a
shared file system, a copied run directory) could otherwise run code in every rank at resume, and the manifest's
checksums do not help since a forger rehashes them. Here:

- `load_metadata` unpickles `.metadata` with an allow-list: DCP's own metadata classes, `torch.Size`, torch
  dtypes / layouts / memory formats, paths and plain containers. Any other global (``os.system``,
  ``builtins.eval``, ...) is refused with a `CheckpointError` naming it, before anything is called.
- `SafeFileSystemReader` is DCP's file reader with `read_metadata` through that loader, so DCP itself never calls
  `pickle.load` on the file; `check_metadata` runs the same pass up front for a clear one-line error.
- `SafeLoadPlanner` reads non-tensor values with `torch.load(weights_only=True)`.
- Every chunk's file must be a plain file name inside the checkpoint directory (no path leaves it).
`safe_load` puts these together for a DCP load of a checkpoint directory.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from megaloom.errors import CheckpointError

METADATA_FILE = ".metadata"

# (module, name) pairs the unpickler may resolve: the classes a DCP .metadata file is made of (torch 2.11-2.13),
# each a dataclass, enum or value type whose construction runs no user code.
_ALLOWED: set[tuple[str, str]] = {
    *(("torch.distributed.checkpoint.metadata", n) for n in (*dcp_metadata.__all__, "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.layout pickles as _get_layout("torch.strided"): a table lookup
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"),
}
# torch attributes that are values, not callables: torch.float32, torch.strided, torch.contiguous_format, ...
_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)


def _error(msg: str) -> Exception:
    return CheckpointError(msg)


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUE_TYPES):
            return getattr(torch, name)
        raise _error(f"{self.source}: refused to load: it names {module}.{name}, which is not part of DCP's "
                     "checkpoint metadata (a forged or foreign file; megaloom never unpickles arbitrary objects "
                     "from a checkpoint). Resume from another checkpoint or delete this one.")

    def persistent_load(self, pid: Any) -> Any:
        raise _error(f"{self.source}: refused to load: persistent id {pid!r} in checkpoint metadata.")


def load_metadata(stream: io.IOBase | io.BufferedIOBase, source: str = METADATA_FILE) -> Metadata:
    """A DCP `Metadata` from ``stream`` through the allow-list unpickler; CheckpointError for anything else."""
    try:
        md = _MetadataUnpickler(stream, source).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError, KeyError) as e:
        if type(e).__name__ == "CheckpointError":
            raise
        raise _error(f"{source}: unreadable checkpoint metadata ({type(e).__name__}: {e}).") from e
    if not isinstance(md, Metadata):
        raise _error(f"{source}: holds a {type(md).__name__}, not DCP checkpoint metadata.")
    for index, info in (md.storage_data or {}).items():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or not rel or Path(rel).name != rel or rel in (".", ".."):
            raise _error(f"{source}: chunk {getattr(index, 'fqn', index)} points at {rel!r}, outside the checkpoint "
                         "directory; refused.")
    return md


def check_metadata(path: Path) -> Metadata:
    """The checkpoint directory ``path``'s .metadata through the safe loader (CheckpointError if refused)."""
    f = path / METADATA_FILE
    if not f.is_file():
        raise _error(f"checkpoint {path}: no {METADATA_FILE} file.")
    with open(f, "rb") as stream:
        return load_metadata(stream, str(f))


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader with `read_metadata` through the allow-list unpickler (also for DCP's per-rank
    metadata fallback: the signature keeps DCP's ``rank`` keyword)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        path = self.fs.concat_path(self.path, name)
        with self.fs.create_stream(path, "rb") as stream:
            md = load_metadata(stream, str(path))
        if getattr(md, "storage_meta", None) is None:  # as DCP's own reader does
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values with ``torch.load(weights_only=True)`` (DCP's own
    uses weights_only=False)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:  # torch's message is a page long: keep the line naming the global
            why = next((line for line in str(e).splitlines() if "GLOBAL" in line), str(e).splitlines()[0])
            raise _error(f"checkpoint value {read_item.dest_index.fqn}: refused to unpickle ({why.strip()})") from e
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def safe_load(state_dict: dict, path: Path, planner: DefaultLoadPlanner, no_dist: bool = False,
              process_group: Any = None) -> None:
    """`dcp.load` of checkpoint directory ``path`` into ``state_dict`` with the safe reader; ``planner`` must be a
    SafeLoadPlanner. DCP's collectives run on ``process_group`` (the checkpoint group; None: the default group).
    A refusal is a CheckpointError (DCP wraps errors of its steps in its own exception)."""
    if not isinstance(planner, SafeLoadPlanner):
        raise TypeError("safe_load needs a SafeLoadPlanner (DCP's default one unpickles values unrestricted)")
    check_metadata(path)  # a forged .metadata is refused here, in one line, before DCP reads it
    try:
        dcp.load(state_dict, storage_reader=SafeFileSystemReader(path), planner=planner, no_dist=no_dist,
                 process_group=process_group)
    except CheckpointException as e:
        refused = next((exc for exc, _ in e.failures.values() if type(exc).__name__ == "CheckpointError"), None)
        if refused is not None:
            raise refused from e
        raise
