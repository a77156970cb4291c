"""Two-stage checkpoint saving: a short blocking copy to host memory, then writing in a background thread.

Stage 1 (in the training loop, every rank): copy the slices this rank writes (checkpoint/sharded.py: its
tensor-parallel shards, pipeline stage, ZeRO segments; no collective, nothing gathered) into host buffers that
are reused across saves (pinned when the state lives on a GPU, so the copy is a fast DMA), write this rank's
RNG file. Stage 2 (a thread on every rank): DCP-write the host copy, every rank its own slices in parallel,
then rank 0 commits exactly like the blocking save (state.json, checksummed manifest, fsync, atomic rename,
`latest`, prune).

State that already lives in host memory (training on CPU) is not copied: a copy would only double the rank's
weights and optimizer state in the same memory. Its slices are written where they are, which is consistent
because nothing but the optimizer's update changes them (forward and backward read the weights and write
gradients, which a checkpoint does not hold): a step pre-hook on the optimizer makes the next update wait until
this rank's tensors are written (``SaveRecord.update_wait_s``). Buffers and step counters, small, are copied.

DCP's save is collective (it plans who writes which replicated slice, and rank 0 writes the metadata). From a
second thread it runs on a process group of its own, a gloo group created once, so its messages can never
interleave with the training loop's NCCL/gloo collectives on the default group. Each rank's host memory holds
its own share of the state only.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from megaloom import accelerator
from megaloom.checkpoint.group import CheckpointGroup
from megaloom.checkpoint.sharded import Slices, SlicesSavePlanner, sharded_state
from megaloom.checkpoint.store import (
    OPTIMIZER_FLAG,
    begin_save,
    commit_save,
    gather_own_checksums,
    remove_failed_save,
    rng_state,
    save_failed,
    save_failure_reason,
    step_name,
    write_rng,
    write_tensors,
)
from megaloom.parallel.mesh import Mesh


@dataclass
class SaveRecord:
    """Timings of one asynchronous save. write_s is None until stage 2 has finished."""

    step: int
    path: Path
    stall_s: float  # stage 1: time the training loop was blocked (includes waiting for the previous write)
    wait_s: float  # the part of stall_s spent waiting for the previous save's write to finish
    write_s: float | None = None  # stage 2: DCP write (+ on rank 0 checksums and commit), in the background
    error: BaseException | None = None
    failure: str = ""  # error's cause in words (store.save_failure_reason)
    in_place: bool = False  # host-resident slices written where they live, not copied (module doc)
    update_wait_s: float = 0.0  # in place: how long the next optimizer update waited for the tensors' write


class _HostBuffers:
    """Host copies of state tensors, allocated once and reused by every save (pinning memory is slow)."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def copy(self, tree: dict, prefix: str = "", in_place: bool = False) -> dict:
        """Same nesting as `tree`, every tensor copied into its host buffer (async for CUDA sources).
        ``in_place``: the `Slices` (weights, optimizer state) stay the live tensors; only plain tensors are copied."""
        seen: dict[tuple, torch.Tensor] = {}  # tied weights appear under two names: copy (and hold) them once
        return self._copy(tree, prefix, seen, in_place)

    def _copy(self, tree: dict, prefix: str, seen: dict, in_place: bool = False) -> dict:
        out: dict = {}
        for key, value in tree.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                out[key] = self._copy(value, name + ".", seen, in_place)
            elif isinstance(value, Slices) and in_place:
                out[key] = value
            elif isinstance(value, Slices):
                out[key] = Slices(value.shape, [(off, self._copy_once(f"{name}@{tuple(off)}", t, seen))
                                                for off, t in value.pieces])
            elif torch.is_tensor(value):
                out[key] = self._copy_once(name, value, seen)
            else:
                out[key] = value
        return out

    def _copy_once(self, name: str, value: torch.Tensor, seen: dict) -> torch.Tensor:
        same = (value.device, value.data_ptr(), value.shape, value.stride(), value.dtype)
        if same not in seen:
            seen[same] = self._buffer(name, value).copy_(value.detach(),
                                                          non_blocking=accelerator.pin_memory(value.device))
        return seen[same]

    def _buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        buf = self._bufs.get(name)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = torch.empty(like.shape, dtype=like.dtype, device="cpu",
                              pin_memory=accelerator.pin_memory(like.device))
            self._bufs[name] = buf
        return buf

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


def _updater(optimizer) -> torch.optim.Optimizer | None:
    """The optimizer whose step changes the saved state (a ZeRO ShardedOptimizer's inner one; a 1-bit optimizer
    itself, whose compressed steps do not run its inner one), or None."""
    if hasattr(optimizer, "error_buffers"):
        return optimizer
    inner = getattr(optimizer, "inner", optimizer)
    return inner if isinstance(inner, torch.optim.Optimizer) else None


def _on_host(tree: dict) -> bool:
    """Every tensor of the state (the `Slices`' pieces included) lives in host memory."""
    for value in tree.values():
        if isinstance(value, dict):
            if not _on_host(value):
                return False
        elif isinstance(value, Slices):
            if any(t.device.type != "cpu" for _, t in value.pieces):
                return False
        elif torch.is_tensor(value) and value.device.type != "cpu":
            return False
    return True


class _WaitForWrite:
    """Optimizer step pre-hook of an in-place save: the update waits until this rank's tensors are written."""

    def __init__(self, record: SaveRecord, tensors_written: threading.Event) -> None:
        self.record, self.tensors_written = record, tensors_written

    def __call__(self, optimizer, args, kwargs) -> None:
        if not self.tensors_written.is_set():
            t0 = time.perf_counter()
            self.tensors_written.wait()
            self.record.update_wait_s += time.perf_counter() - t0


class AsyncCheckpointer:
    """Saves overlap training: `save` blocks only for the host copy; call `wait()` before the process ends.

    At most one save is in flight: the next `save` first waits for the previous one (that wait counts as
    stall). Errors of the background write are raised by the next `save` or `wait` of the rank that hit them.
    `on_written(record)` runs in the writer thread after each commit (e.g. to print the write time)."""

    def __init__(self, on_written: Callable[[SaveRecord], None] | None = None,
                 group: CheckpointGroup | None = None) -> None:
        # The writer threads' own process group (module doc): the trainer's checkpoint group, or one made here
        # (collective over the world when distributed).
        self._ckpt = group if group is not None else CheckpointGroup()
        self._buffers = _HostBuffers()
        self._thread: threading.Thread | None = None
        self._written = threading.Event()  # set by the writer thread in flight when it ends
        self._pending: SaveRecord | None = None
        self._on_written = on_written
        self._update_guard = None  # the step pre-hook of an in-place save (module doc)
        self.history: list[SaveRecord] = []

    def save(self, ckpt_root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
             run_state: dict, keep: int, rank: int = 0, barrier: Callable[[], None] = lambda: None,
             mesh: Mesh | None = None) -> SaveRecord:
        """Stage 1 now, stage 2 in the background. Every rank calls this. Returns this save's record
        (stall_s filled in; write_s once the writer has finished, see `wait`)."""
        mesh = mesh or Mesh.single()
        t0 = time.perf_counter()
        self._finish_previous()
        wait_s = time.perf_counter() - t0
        tmp = begin_save(ckpt_root, step, rank)
        barrier()  # tmp exists (and no stale save is being removed) before any rank writes into it
        state = sharded_state(model, optimizer, mesh, save=True)
        updater = _updater(optimizer)
        in_place = updater is not None and _on_host(state)
        snapshot = self._buffers.copy(state, in_place=in_place)
        if (kind := accelerator.started()) is not None:
            accelerator.synchronize(kind)  # the non-blocking device-to-host copies must land before the thread reads
        if optimizer is not None:
            write_rng(tmp, rank, rng_state())
        barrier()  # every rank's RNG file is in tmp before rank 0's manifest lists them
        record = SaveRecord(step=step, path=ckpt_root / step_name(step), stall_s=0.0, wait_s=wait_s,
                            in_place=in_place)
        run_state = {**run_state, OPTIMIZER_FLAG: optimizer is not None}
        self._pending = record
        self._written = threading.Event()
        tensors_written = threading.Event()  # this rank's tensors are on disk (or their write failed)
        if in_place:
            self._update_guard = updater.register_step_pre_hook(_WaitForWrite(record, tensors_written))
        self._thread = threading.Thread(target=self._write, name=f"megaloom-ckpt-{step}", daemon=False,
                                        args=(record, ckpt_root, tmp, snapshot, run_state, keep, rank == 0,
                                              self._written, tensors_written))
        # DCP warns on a no-collective save that it "assumes a single process": intended with one process. Set
        # once from this thread: warnings.catch_warnings() inside the writer would not be thread-safe.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        self._thread.start()
        record.stall_s = time.perf_counter() - t0
        self.history.append(record)
        return record

    def wait(self, barrier: Callable[[], None] = lambda: None) -> SaveRecord | None:
        """Block until this rank's write (and on rank 0 the commit) is done, then barrier so every rank knows.
        Returns the last save's record (None if nothing was saved); raises if its write failed."""
        self._finish_previous()
        barrier()
        return self.history[-1] if self.history else None

    def join_write(self) -> None:
        """Block until this rank's write in flight (if any) has ended, without a barrier and without raising its
        error: for a process that is stopping anyway (Ctrl-C), so it can name the checkpoint that is on disk."""
        # An Event, not Thread.join: a join that Ctrl-C interrupted (in `save` or `wait`) can leave the thread
        # looking finished to a later join on Python 3.11 while it still writes.
        if self._thread is not None:
            while not self._written.wait(0.1):
                pass

    @property
    def host_buffer_bytes(self) -> int:
        """Host memory this rank holds for its snapshot: the price of the short stall (on CPU only the buffers and
        step counters: the weights and optimizer state are written in place)."""
        return self._buffers.nbytes

    def _finish_previous(self) -> None:
        if self._thread is None:
            return
        self._thread.join()
        if self._update_guard is not None:  # its write is over: the next update has nothing to wait for
            self._update_guard.remove()
            self._update_guard = None
        record, self._thread, self._pending = self._pending, None, None
        if record is not None and record.error is not None:
            raise save_failed(f"{record.failure} (written in the background)", record.path.parent,
                              record.step) from record.error

    def _write(self, record: SaveRecord, ckpt_root: Path, tmp: Path, snapshot: dict, run_state: dict,
               keep: int, commit: bool, written: threading.Event, tensors_written: threading.Event) -> None:
        try:
            self._write_and_commit(record, ckpt_root, tmp, snapshot, run_state, keep, commit, tensors_written)
        finally:
            tensors_written.set()
            written.set()

    def _write_and_commit(self, record: SaveRecord, ckpt_root: Path, tmp: Path, snapshot: dict, run_state: dict,
                          keep: int, commit: bool, tensors_written: threading.Event) -> None:
        t0 = time.perf_counter()
        try:
            if self._ckpt.group is None:
                write_tensors(tmp, snapshot, no_dist=True)
            else:  # every rank its slices; returns once all have written (DCP's finish step is collective)
                dcp.save(snapshot, checkpoint_id=str(tmp), process_group=self._ckpt.group,
                         planner=SlicesSavePlanner())
            tensors_written.set()  # the live tensors of an in-place save are no longer read: updates may go on
            hashed = gather_own_checksums(tmp, self._ckpt)  # each writer hashes its own files
            if commit:
                commit_save(ckpt_root, tmp, record.step, run_state, keep, hashed)
        except BaseException as e:  # reported to the training loop by the next save()/wait()
            record.failure = save_failure_reason(e, ckpt_root)  # before the partial files go (free space)
            remove_failed_save(tmp)
            record.error = e
            return
        record.write_s = time.perf_counter() - t0
        if self._on_written is not None:
            self._on_written(record)
