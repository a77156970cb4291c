"""Atomic, verified checkpoints on top of PyTorch's distributed checkpoint (DCP).

Layout of run.dir/checkpoints/:
    step_00000200/          one finished checkpoint
        .metadata, *.distcp DCP shards: model weights and optimizer state under layout-free names
        rng_rank0.pt        per-rank RNG states (tensors only; loaded with weights_only=True)
        state.json          step, consumed samples, model shape, anything the loop needs to resume
        manifest.json       sha256 of every file above, written last inside the directory
    latest                  text file naming the newest good checkpoint, replaced atomically
    .tmp-step_00000300/     a save in progress (ignored and cleaned up on the next save)

A crash at any point leaves the previous checkpoint and `latest` intact: the directory is renamed into
place only after every byte is written and checksummed, and `latest` moves after the rename. Loading
verifies the checksums and falls back to the previous checkpoint if a newer one is damaged.
megaloom unpickles nothing arbitrary from a checkpoint: DCP tensors, JSON, `torch.load(weights_only=True)`,
and DCP's .metadata through an allow-list unpickler (checkpoint/safe_metadata.py).

The writing stages (begin_save, write_tensors, write_rng, commit_save) are shared with the asynchronous
two-stage saver in async_save.py; see docs/checkpoints.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from megaloom.checkpoint.group import CheckpointGroup
from megaloom.checkpoint.safe_metadata import safe_load
from megaloom.checkpoint.sharded import SlicesLoadPlanner, SlicesSavePlanner, after_load, sharded_state
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.state import ensure_optimizer_state

MANIFEST = "manifest.json"
STATE = "state.json"
OPTIMIZER_FLAG = "has_optimizer_state"  # in state.json; absent in older checkpoints, which always had it
PAUSE_ENV = "MEGALOOM_CHECKPOINT_TEST_PAUSE_S"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, partial, corrupt or incompatible."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it assumes a single process when torch.distributed is not initialised: that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def rng_state() -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(ckpt_root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    run_state: dict, keep: int, rank: int = 0,
                    barrier: Callable[[], None] = lambda: None, mesh: Mesh | None = None,
                    group: CheckpointGroup | None = None) -> Path:
    """Write checkpoint `step_<step>` atomically; every rank calls this. Returns the final directory.

    Each rank writes only the slices it holds, under the single model's names and full shapes
    (checkpoint/sharded.py), so the files do not depend on the parallel layout and nothing is gathered. With
    optimizer=None only the model is stored, without RNG states (e.g. weights imported from Hugging Face);
    loading such a checkpoint leaves the optimizer fresh. With ``group`` (the trainer's), each rank checksums the
    files it wrote and rank 0 merges them into the manifest; without, rank 0 checksums everything."""
    mesh = mesh or Mesh.single()
    if group is not None:
        rank, barrier = group.rank, group.barrier
    tmp = begin_save(ckpt_root, step, rank)
    barrier()
    write_tensors(tmp, sharded_state(model, optimizer, mesh))
    if optimizer is not None:  # a model-only checkpoint is a starting point: the trainer's own seeding stands
        write_rng(tmp, rank, rng_state())
    barrier()
    hashed = gather_own_checksums(tmp, group)
    if rank == 0:
        run_state = {**run_state, OPTIMIZER_FLAG: optimizer is not None}
        commit_save(ckpt_root, tmp, step, run_state, keep, hashed)
    barrier()
    return ckpt_root / step_name(step)


# The stages below are shared by the blocking save above and AsyncCheckpointer (async_save.py).

def step_name(step: int) -> str:
    return f"step_{step:08d}"


def begin_save(ckpt_root: Path, step: int, rank: int) -> Path:
    """Rank 0 removes saves interrupted by a crash and creates the temporary directory; returns its path.
    The other ranks must wait (barrier) before writing into it."""
    tmp = ckpt_root / f".tmp-{step_name(step)}"
    if rank == 0:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        for stale in ckpt_root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    return tmp


def write_tensors(tmp: Path, state: dict, no_dist: bool = False) -> None:
    """DCP-write `state` into tmp. no_dist=True writes this process's tensors alone, with no collective: the
    async writer thread of rank 0 uses it, because collectives from a second thread could interleave with
    the training loop's collectives on the same process group. (That caller silences DCP's single-process
    warning itself: warnings.catch_warnings() is not thread-safe.)"""
    if no_dist:
        dcp.save(state, checkpoint_id=str(tmp), no_dist=True, planner=SlicesSavePlanner())
        return
    with _quiet_single_process():
        dcp.save(state, checkpoint_id=str(tmp), planner=SlicesSavePlanner())


def write_rng(tmp: Path, rank: int, rng: dict[str, torch.Tensor]) -> None:
    torch.save(rng, tmp / f"rng_rank{rank}.pt")


def own_files(tmp: Path, rank: int) -> list[Path]:
    """The files rank ``rank`` wrote into a checkpoint directory: its DCP data files and its RNG file."""
    return sorted(p for p in tmp.iterdir()
                  if p.is_file() and (p.name.startswith(f"__{rank}_") or p.name == f"rng_rank{rank}.pt"))


def gather_own_checksums(tmp: Path, group: CheckpointGroup | None) -> dict | None:
    """Each rank checksums what it wrote, in parallel; rank 0 gets the union (None without a group, or on
    other ranks): hashing is split across writers instead of rank 0 reading the whole checkpoint."""
    if group is None:
        return None
    mine = {p.name: {"sha256": _sha256(p), "bytes": p.stat().st_size} for p in own_files(tmp, group.rank)}
    parts = group.gather(mine)
    return None if parts is None else {k: v for part in parts for k, v in part.items()}


def commit_save(ckpt_root: Path, tmp: Path, step: int, run_state: dict, keep: int,
                hashed: dict | None = None) -> Path:
    """Rank 0, once every file is in tmp: state.json, manifest of checksums (``hashed``: those the writers already
    computed), fsync, rename into place, move `latest`, prune. A crash anywhere before the rename leaves only a
    .tmp directory behind."""
    _pause_for_tests()
    name = step_name(step)
    final = ckpt_root / name
    (tmp / STATE).write_text(json.dumps({**run_state, "step": step, "saved_at": time.time()}, indent=1))
    files = sorted(p for p in tmp.iterdir() if p.is_file() and p.name != MANIFEST)
    hashed = hashed or {}
    manifest = {p.name: hashed.get(p.name) or {"sha256": _sha256(p), "bytes": p.stat().st_size} for p in files}
    _write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1))
    for p in tmp.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():  # re-saving the same step (e.g. after a rollback)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(ckpt_root)
    _write_atomic(ckpt_root / "latest", name + "\n")
    _prune(ckpt_root, keep)
    return final


def _pause_for_tests() -> None:
    """Test hook: sleep between writing the tensors and committing, so a test can kill the writer mid-save."""
    pause = os.environ.get(PAUSE_ENV)
    if pause:
        time.sleep(float(pause))


def _prune(ckpt_root: Path, keep: int) -> None:
    done = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def verify_checkpoint(path: Path, group: CheckpointGroup | None = None) -> dict:
    """Check that `path` is complete and every file matches its checksum; return its state.json.

    With ``group`` the files are split over the ranks (each hashes every size-th one) and the verdict is agreed:
    every rank raises the same CheckpointError or none does, so all ranks load the same checkpoint."""
    problem = _manifest_problem(path)
    if problem is None:
        manifest = json.loads((path / MANIFEST).read_text())
        names = sorted(manifest)
        mine = names[group.rank::group.size] if group is not None else names
        problem = next((p for p in (_file_problem(path, n, manifest[n]) for n in mine) if p), None)
    if group is not None and not group.all_true(problem is None):
        problem = next(p for p in group.all_gather(problem) if p)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path}{problem}")
    return json.loads((path / STATE).read_text())


def _manifest_problem(path: Path) -> str | None:
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return f" is incomplete: no {MANIFEST} (the save was interrupted)."
    try:
        json.loads(manifest_path.read_text())
    except json.JSONDecodeError as e:
        return f": {MANIFEST} is corrupt ({e})."
    return None


def _file_problem(path: Path, fname: str, info: dict) -> str | None:
    f = path / fname
    if not f.is_file():
        return f": file {fname} listed in the manifest is missing."
    if f.stat().st_size != info["bytes"] or _sha256(f) != info["sha256"]:
        return f": file {fname} is corrupt (checksum mismatch)."
    return None


def find_checkpoints(ckpt_root: Path) -> list[Path]:
    """Candidates to resume from, best first: the one `latest` names, then the others newest first."""
    if not ckpt_root.is_dir():
        return []
    found = sorted((p for p in ckpt_root.glob("step_*") if p.is_dir()), reverse=True)
    latest = ckpt_root / "latest"
    if latest.is_file():
        named = ckpt_root / latest.read_text().strip()
        if named in found:
            found.remove(named)
            found.insert(0, named)
    return found


def check_compatible(saved: dict, current: dict) -> None:
    """Refuse to load weights of another shape, naming every field that differs."""
    keys = ["arch", "n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "tie_embeddings",
            "parallel_block"]
    diff = [f"model.{k}: checkpoint {saved.get(k)!r} vs config {current.get(k)!r}"
            for k in keys if k in saved and saved.get(k) != current.get(k)]
    if diff:
        raise CheckpointError("checkpoint is incompatible with this model: " + "; ".join(diff) +
                              ". Use the checkpoint's model settings, or checkpoint.resume=none to start fresh.")


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    rank: int = 0, model_cfg: dict | None = None, mesh: Mesh | None = None,
                    group: CheckpointGroup | None = None) -> dict:
    """Verify and load `path` into model (and optimizer); restore this rank's RNG. Returns state.json.

    A model-only checkpoint (state.json has_optimizer_state false) leaves the optimizer untouched, i.e. fresh
    for a fine-tune; the RNG is restored only if the checkpoint has a file for this rank."""
    mesh = mesh or Mesh.single()
    state = verify_checkpoint(path, group)
    if model_cfg is not None and "model" in state:
        check_compatible(state["model"], model_cfg)
    with_optim = optimizer is not None and state.get(OPTIMIZER_FLAG, True)
    if with_optim:
        ensure_optimizer_state(model, optimizer)
    sd = sharded_state(model, optimizer if with_optim else None, mesh)  # views of the live tensors
    with torch.no_grad(), _quiet_single_process():
        safe_load(sd, path, SlicesLoadPlanner())  # DCP's load, unpickling nothing arbitrary (safe_metadata.py)
    after_load(optimizer if with_optim else None, sd)
    rng_file = path / f"rng_rank{rank}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=True))
    return state


def load_newest(ckpt_root: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, rank: int = 0,
                model_cfg: dict | None = None, mesh: Mesh | None = None,
                warn: Callable[[str], None] = print, group: CheckpointGroup | None = None) -> tuple[Path, dict] | None:
    """Load the newest checkpoint under `ckpt_root` that verifies; returns (path, state.json) or None if none does.

    A damaged newer checkpoint is reported through `warn` and skipped; an incompatible one (another model
    shape) is an error, since falling back would not help."""
    candidates = find_checkpoints(ckpt_root)
    if group is not None:  # one list for the job: rank 0's view of the directory
        candidates = group.all_gather(candidates)[0]
    for path in candidates:
        try:
            return path, load_checkpoint(path, model, optimizer, rank=rank, model_cfg=model_cfg, mesh=mesh,
                                         group=group)
        except CheckpointError as e:
            if "incompatible" in str(e):
                raise
            warn(f"WARNING: {e} Falling back to the previous checkpoint.")
    return None
