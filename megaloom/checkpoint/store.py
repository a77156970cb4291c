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
import dataclasses
import errno
import hashlib
import io
import json
import os
import pickle
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException

from megaloom import accelerator
from megaloom.checkpoint.group import CheckpointGroup
from megaloom.checkpoint.safe_metadata import check_metadata, safe_load
from megaloom.checkpoint.sharded import (
    SlicesLoadPlanner,
    SlicesSavePlanner,
    after_load,
    local_state_fits,
    sharded_state,
)
from megaloom.errors import CheckpointError, NoUsableCheckpoint, SaveFailed
from megaloom.model_keys import shape_keys
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.state import ensure_optimizer_state

MANIFEST = "manifest.json"
STATE = "state.json"
OPTIMIZER_FLAG = "has_optimizer_state"  # in state.json; absent in older checkpoints, which always had it
PAUSE_ENV = "MEGALOOM_CHECKPOINT_TEST_PAUSE_S"


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
    """The CPU's generator ("torch") and, once this process has started it, the accelerator's (keyed by its type:
    "cuda" as always on NVIDIA GPUs)."""
    return {"torch": torch.get_rng_state(), **accelerator.rng_states()}


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    accelerator.set_rng_states(state)


def _os_errors(e: BaseException | None, seen: set[int] | None = None):
    """The OSErrors inside ``e``: its chain of causes, and each rank's failure inside DCP's CheckpointException."""
    seen = set() if seen is None else seen
    if e is None or id(e) in seen:
        return
    seen.add(id(e))
    if isinstance(e, OSError):
        yield e
    for wrapped in (getattr(e, "failures", None) or {}).values():
        yield from _os_errors(wrapped[0] if isinstance(wrapped, tuple) else wrapped, seen)
    yield from _os_errors(e.__cause__, seen)
    yield from _os_errors(e.__context__, seen)


FULL_BELOW_BYTES = 64 << 20  # less free than this after a failed write: the disk is full


def _size(n: float) -> str:
    """Bytes in the largest binary unit that leaves a number >= 1 ("512 B", "3.4 KiB", "20.0 MiB", "1.8 TiB")."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent (a save's directory may be gone, or not made yet)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_space(where: Path) -> tuple[str, bool]:
    """The free space of the filesystem holding ``where`` (or its nearest existing parent), in words, and whether
    it counts as full (less than FULL_BELOW_BYTES free)."""
    try:
        usage = shutil.disk_usage(_existing(where))
    except OSError:
        return "free space unknown", False
    return f"{_size(usage.free)} free of {_size(usage.total)}", usage.free < FULL_BELOW_BYTES


def save_failure_reason(e: BaseException, ckpt_root: Path) -> str:
    """Why a save failed, in words, measured at the failure (before its partial files are removed). torch's
    writer reports a full disk as "unexpected pos N vs M" and loses the errno: the free space tells. The space is
    that of the file the error names (what was being written), else of ``ckpt_root``."""
    os_error = next(_os_errors(e), None)
    written = getattr(os_error, "filename", None)
    free, full = free_space(Path(written) if isinstance(written, (str, os.PathLike)) else ckpt_root)
    if os_error is not None and os_error.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on the device ({os.strerror(os_error.errno)}; {free})"
    inner = os_error or _dcp_failure(e)
    first = str(inner).strip().splitlines()
    said = first[0] if first else type(inner).__name__
    if full:
        return f"no space left on the device ({free}; the writer said: {said})"
    return said


def save_failed(reason: str, ckpt_root: Path, step: int) -> SaveFailed:
    found = find_checkpoints(ckpt_root)
    newest = found[0].name if found else None
    keep = (f"the newest checkpoint is still {newest}: free space (or lower checkpoint.keep) and start the run again "
            f"to resume from it" if newest else "there is no earlier checkpoint: free space and start again")
    return SaveFailed(f"checkpoint {step_name(step)} could not be written to {ckpt_root}: {reason}. Its partial "
                      f"files were removed; {keep}.")


def remove_failed_save(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


def save_checkpoint(ckpt_root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    run_state: dict, keep: int, rank: int = 0,
                    barrier: Callable[[], None] = lambda: None, mesh: Mesh | None = None,
                    group: CheckpointGroup | None = None) -> Path:
    """Write checkpoint `step_<step>` atomically; every rank calls this. Returns the final directory. A failed
    write (a full disk) removes its partial files and raises SaveFailed naming the cause."""
    try:
        return _save_checkpoint(ckpt_root, step, model, optimizer, run_state, keep, rank, barrier, mesh, group)
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        reason = save_failure_reason(e, ckpt_root)
        remove_failed_save(ckpt_root / f".tmp-{step_name(step)}")
        raise save_failed(reason, ckpt_root, step) from e


def _save_checkpoint(ckpt_root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                     run_state: dict, keep: int, rank: int = 0,
                     barrier: Callable[[], None] = lambda: None, mesh: Mesh | None = None,
                     group: CheckpointGroup | None = None) -> Path:
    """Write checkpoint `step_<step>` atomically.

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
    write_tensors(tmp, sharded_state(model, optimizer, mesh, save=True), group=group)
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
        remove_partial_saves(ckpt_root)
        tmp.mkdir()
    return tmp


def remove_partial_saves(ckpt_root: Path) -> list[str]:
    """Remove the .tmp-* directories of saves that never finished (a crash, a full disk): never loadable, and on a
    full disk their bytes are what keeps it full. Only while no save of this run is in flight (start-up under the
    run.dir lock, or the start of a save). Returns the names removed."""
    gone = []
    for stale in ckpt_root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
        gone.append(stale.name)
    return gone


def write_tensors(tmp: Path, state: dict, no_dist: bool = False, group: CheckpointGroup | None = None) -> None:
    """DCP-write `state` into tmp. DCP's planning collectives run on ``group`` (the checkpoint group: gloo, with
    its own long timeout) and never on the default group (NCCL on GPUs, the training timeout, no CPU backend);
    without a group (one process, tools) on the default one. no_dist=True writes this process's tensors alone,
    with no collective: the async writer thread of rank 0 uses it, because collectives from a second thread could
    interleave with the training loop's collectives on the same process group. (That caller silences DCP's
    single-process warning itself: warnings.catch_warnings() is not thread-safe.)"""
    if no_dist:
        dcp.save(state, checkpoint_id=str(tmp), no_dist=True, planner=SlicesSavePlanner())
        return
    with _quiet_single_process():
        dcp.save(state, checkpoint_id=str(tmp), planner=SlicesSavePlanner(),
                 process_group=group.group if group is not None else None)


def write_rng(tmp: Path, rank: int, rng: dict[str, torch.Tensor]) -> None:
    # Serialised in memory, written by Python: a full disk raises OSError(ENOSPC) here, where torch.save's own
    # writer would report "unexpected pos N vs M" and lose the cause.
    buf = io.BytesIO()
    torch.save(rng, buf)
    (tmp / f"rng_rank{rank}.pt").write_bytes(buf.getvalue())


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
    (tmp / STATE).write_text(json.dumps({**run_state, "step": step, "saved_at": time.time()}, indent=1,
                                        default=_jsonable))
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


# Files every checkpoint has and loading reads on every rank: a manifest without them covers nothing.
_REQUIRED = (STATE, ".metadata")


def _manifest_problem(path: Path) -> str | None:
    """The manifest must exist, parse, and cover every file of the directory: loading reads only listed files
    (an unlisted rng_rank<N>.pt, or a manifest emptied to `{}`, would otherwise be loaded unchecked)."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return f" is incomplete: no {MANIFEST} (the save was interrupted)."
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return f": {MANIFEST} is corrupt ({e})."
    if not isinstance(manifest, dict) or not all(isinstance(v, dict) and {"sha256", "bytes"} <= v.keys()
                                                 for v in manifest.values()):
        return f": {MANIFEST} is corrupt (not a mapping of file names to checksums)."
    missing = [n for n in _REQUIRED if n not in manifest]
    if missing:
        return f": {MANIFEST} does not list {', '.join(missing)} (it is damaged or forged)."
    # NFS keeps deleted-but-open files as .nfs*: not part of the checkpoint
    unlisted = sorted(p.name for p in path.iterdir()
                      if p.name != MANIFEST and not p.name.startswith(".nfs") and p.name not in manifest)
    if unlisted:
        return f": file(s) {', '.join(unlisted)} are not in its {MANIFEST} (added after the save, or the manifest " \
               "is damaged); loading reads only checksummed files."
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


def _jsonable(obj: object) -> object:
    """state.json's values: a config sub-section (model.lora, a dataclass) as its mapping."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def check_compatible(saved: dict, current: dict, adapters: bool = True) -> None:
    """Refuse to load weights of another shape, naming every field that differs. ``adapters``: compare the LoRA
    adapters too (False: this load leaves them as built, a new LoRA stage on a checkpoint without them)."""
    # The keys that size weights say so in their declaration (megaloom/model_keys/: `_f(..., shape=...)`; a key absent
    # from the saved config, an image encoder's in a text model's checkpoint, is not compared). max_seq_len sizes a
    # table of learned positions only (RoPE tables are recomputed: any length loads); experts matter only with experts.
    with_experts = bool(current.get("moe_every") or saved.get("moe_every"))
    when = {"positions": _learned_positions(current), "experts": with_experts}
    keys = [k for k, shape in shape_keys().items() if shape is True or when[shape]]
    diff = [f"model.{k}: checkpoint {saved.get(k)!r} vs config {current.get(k)!r}"
            for k in keys if k in saved and _effective(saved, k) != _effective(current, k)]
    if diff:
        raise CheckpointError("checkpoint is incompatible with this model: " + "; ".join(diff) +
                              ". Use the checkpoint's model settings, or checkpoint.resume=none to start fresh.")
    if adapters:
        _check_adapters(saved, current)


def _effective(model_cfg: dict, key: str) -> object:
    """What a model key means for the weights' shape: model.head_dim and n_kv_heads at 0 ("auto") are their
    resolved values (a converted checkpoint saves 0, a trained one the resolved size), and under latent attention
    (model.attention=mla) neither sizes anything (its heads are qk_nope/qk_rope/v_head_dim wide)."""
    value = model_cfg.get(key)
    if key not in ("head_dim", "n_kv_heads"):
        return value
    if model_cfg.get("attention") == "mla":
        return None
    heads, d = model_cfg.get("n_heads") or 0, model_cfg.get("d_model") or 0
    if key == "head_dim":
        return value or (d // heads if heads else value)
    return value or heads


def _check_adapters(saved: dict, current: dict) -> None:
    """The same LoRA adapters (rank, alpha, targets): other ones are another model, not a resume."""
    from megaloom.models.lora import describe_settings, saved_settings

    old, new = saved_settings(saved), saved_settings(current)
    if old == new:
        return
    if old["rank"]:
        fix = ("use the checkpoint's model.lora settings to resume it; to go on with other adapters (or none), "
               "export it merged (`megaloom convert --to-hf RUN OUT`, adapters folded into the weights) and import "
               "that (`megaloom convert --from-hf OUT NEW_RUN`)")
    else:
        fix = ("to train adapters on this checkpoint's weights, name it in checkpoint.resume=<checkpoint dir> with "
               "a new run.dir (a new training stage: adapters fresh, step 0)")
    raise CheckpointError(f"checkpoint is incompatible with this model: model.lora: checkpoint "
                          f"{describe_settings(old)} vs config {describe_settings(new)}; {fix}.")


def _learned_positions(model_cfg: dict) -> bool:
    from megaloom.models.registry import get_family  # the models import the parallel layers: imported late

    try:
        return get_family(model_cfg.get("arch", "")).traits.positions == "learned"
    except (KeyError, ValueError):
        return False


def _dcp_failure(e: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException (which gathers every rank's)."""
    for wrapped in (getattr(e, "failures", None) or {}).values():  # rank -> (exception, stack summary)
        return wrapped[0] if isinstance(wrapped, tuple) else wrapped
    return e


def _read_tensors(path: Path, sd: dict, group: CheckpointGroup | None = None) -> None:
    """DCP-read ``sd`` from ``path`` (DCP's collectives on ``group``, as `write_tensors`); its failures become one
    CheckpointError line. The checksums verified, so a failure is a mismatch with this model (a setting that
    changes a tensor's name or shape) or an I/O error."""
    try:
        with torch.no_grad(), _quiet_single_process():
            # DCP's load, unpickling nothing arbitrary (safe_metadata.py)
            safe_load(sd, path, SlicesLoadPlanner(), process_group=group.group if group is not None else None)
    except CheckpointException as e:
        cause = _dcp_failure(e)
        text = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        if isinstance(cause, OSError):
            raise CheckpointError(f"checkpoint {path} could not be read: {text}.") from e
        raise CheckpointError(f"checkpoint {path} is incompatible with this model: {text}. Use the checkpoint's "
                              "model settings, or checkpoint.resume=none to start fresh.") from e


def _load_rng(rng_file: Path) -> dict:
    try:
        return torch.load(rng_file, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:  # refused (not tensors only) or damaged
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {rng_file.parent}: file {rng_file.name} is not a tensor-only RNG state "
                              f"(refused to load: {first}).") from e


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    rank: int = 0, model_cfg: dict | None = None, mesh: Mesh | None = None,
                    group: CheckpointGroup | None = None,
                    check_state: Callable[[Path, dict], None] | None = None, fresh_adapters: bool = False,
                    model_only: bool = False) -> dict:
    """Verify and load `path` into model (and optimizer); restore this rank's RNG. Returns state.json.

    A model-only checkpoint (state.json has_optimizer_state false), or ``model_only=True`` (the weights of any
    checkpoint, e.g. another training stage's), loads the weights and leaves the optimizer's state untouched, i.e.
    fresh for a fine-tune; pass the optimizer anyway: with ZeRO-1/2 gathering bf16 its fp32 master shards must take
    the loaded weights. The RNG is restored only if the checkpoint has a file for this rank. The weights load at
    any parallel layout (ZeRO 0-3, tp, pp, ep). ``check_state(path,
    state)`` runs once the checkpoint verified, before any tensor is read: it raises to refuse the checkpoint
    (e.g. the run's data changed since it was written; an exception other than CheckpointError ends
    `load_newest`'s fall-back too). ``fresh_adapters``: the model's LoRA adapters are not read (a checkpoint
    without them starting a LoRA stage: they stay as built, B zero)."""
    mesh = mesh or Mesh.single()
    state = verify_checkpoint(path, group)
    if model_cfg is not None and "model" in state:
        check_compatible(state["model"], model_cfg, adapters=not fresh_adapters)
    if check_state is not None:
        check_state(path, state)
    with_optim = optimizer is not None and state.get(OPTIMIZER_FLAG, True) and not model_only
    if with_optim:
        ensure_optimizer_state(model, optimizer)
    onebit = with_optim and hasattr(optimizer, "prepare_load")  # its tensors depend on what the checkpoint holds
    saved = check_metadata(path).state_dict_metadata if onebit else {}
    if onebit:
        optimizer.prepare_load(set(saved))  # the variance window's sums, where the checkpoint has them
    masters = getattr(optimizer, "separate_masters", False)  # ZeRO's fp32 master shards: weights load into them
    sd = sharded_state(model, optimizer if with_optim or masters else None, mesh, with_optim=with_optim)  # views
    if fresh_adapters:
        from megaloom.models.lora import is_adapter_name

        sd["model"] = {k: v for k, v in sd["model"].items() if not is_adapter_name(k)}
    if "optim_local" in sd and not local_state_fits(sd, saved):
        # 1-bit error feedback saved at another data-parallel size (or not at all): it starts at zero
        del sd["optim_local"]
        optimizer.reset_errors()
    _read_tensors(path, sd, group)
    after_load(optimizer if with_optim else None, sd)
    if masters:  # ZeRO gathering bf16: replicas from the master shards, which the weights were read into
        optimizer.weights_loaded(masters_loaded=True)
    rng_file = path / f"rng_rank{rank}.pt"
    if rng_file.is_file():
        set_rng_state(_load_rng(rng_file))
    return state


def load_newest(ckpt_root: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, rank: int = 0,
                model_cfg: dict | None = None, mesh: Mesh | None = None,
                warn: Callable[[str], None] = print, group: CheckpointGroup | None = None,
                check_state: Callable[[Path, dict], None] | None = None,
                fresh_adapters: bool = False) -> tuple[Path, dict] | None:
    """Load the newest checkpoint under `ckpt_root` that verifies; returns (path, state.json), or None when there is
    no checkpoint at all.

    A damaged newer checkpoint is reported through `warn` and skipped; an incompatible one (another model
    shape) is an error, since falling back would not help; checkpoints that all fail to verify raise
    NoUsableCheckpoint (never a silent start from step 0)."""
    candidates = find_checkpoints(ckpt_root)
    if group is not None:  # one list for the job: rank 0's view of the directory
        candidates = group.all_gather(candidates)[0]
    problems = []
    for i, path in enumerate(candidates):
        try:
            return path, load_checkpoint(path, model, optimizer, rank=rank, model_cfg=model_cfg, mesh=mesh,
                                         group=group, check_state=check_state, fresh_adapters=fresh_adapters)
        except CheckpointError as e:
            if "incompatible" in str(e):
                raise
            problems.append(str(e))
            if i + 1 < len(candidates):
                warn(f"WARNING: {e} Falling back to the previous checkpoint ({candidates[i + 1].name}).")
    if candidates:
        raise NoUsableCheckpoint(ckpt_root, problems)
    return None

