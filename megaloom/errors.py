"""Every exception megaloom raises for a person to act on, in one module that imports nothing of megaloom's.

Why here: an error class is what two layers share most often (the checkpoint store raises, the trainer and the
CLI catch; every layer raises ConfigError). When one lived in a heavy module (ConfigError in config.py,
CheckpointError in checkpoint/store.py), every module that raised it had to import that module, and those imports
tied forty modules into one import circle (issue 37). Modules keep raising them under their old names too:
``megaloom.config.ConfigError``, ``megaloom.checkpoint.store.CheckpointError``, ``megaloom.data.errors.DataError``
... are these same classes, re-exported, so no caller's import or ``except`` changes.

The families, each a ValueError (a user error, not a bug) unless it says otherwise:
- ConfigError: a setting (a key, what was found, what would work); RunDirLocked / RunDirUnwritable: run.dir.
- DataError: token files, tokenizers, data sources; DataChanged: a resume onto other token files.
- CheckpointError: a checkpoint that cannot be used; ConversionError: a model that cannot be converted
  (also a CheckpointError, so callers that handle unusable checkpoints handle it); NoUsableCheckpoint.
- RunStopped (a RuntimeError): a run that cannot go on and a person must act; PeerLost (another rank died),
  Diverged (rollbacks did not help) and SaveFailed (also a CheckpointError) are ones.
- ScheduleError: a pipeline schedule that would deadlock or compute on missing data.
"""

from __future__ import annotations

from pathlib import Path


class RunStopped(RuntimeError):
    """A run that cannot go on: the message says what happened, what is on disk, and what to do.

    `megaloom train` prints its message as one line and exits 1 (cli.py); under torchrun --max-restarts the job is
    restarted like after any failure, so a lasting cause stops it again within the restart budget."""


class PeerLost(RunStopped):
    """This rank stopped because another rank of the job died; ``line`` (possibly empty: another rank says it)
    is what to print (megaloom/resilience/peers.py)."""

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.line = line


class Diverged(RunStopped):
    """Rolling back again would not help: non-finite steps came back after the rollbacks allowed
    (megaloom/resilience/rollbacks.py)."""


class ConfigError(ValueError):
    """A user-facing configuration error: names the key, what was found and what would work."""


class RunDirLocked(ConfigError):
    """run.dir is in use by another live megaloom run."""


class RunDirUnwritable(ConfigError):
    """run.dir cannot be created or written (read-only, another user's, not a directory)."""


class DataError(ValueError):
    """A user-facing data problem.

    Messages name the setting or file involved, what was found, and what would fix it, so that a
    bad path or a stale token file fails with advice instead of a numpy traceback deep in a worker.
    """


class DataChanged(DataError):
    """The checkpoint to resume from was trained on other token files than the run's data.paths hold now."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, partial, corrupt or incompatible."""


class ConversionError(CheckpointError):
    """A model that cannot be converted: names the setting or file, what was found and what would work."""


class SaveFailed(RunStopped, CheckpointError):
    """A checkpoint could not be written (a full disk, most often). Its partial files are gone; the newest
    checkpoint on disk is unchanged. The run stops rather than train on with nothing saved (docs/resilience.md).
    A CheckpointError too, as the asynchronous saver's failures always were."""


class NoUsableCheckpoint(CheckpointError):
    """Checkpoints exist but none verifies: starting from step 0 would silently discard the run and overwrite its
    checkpoints, so the caller must refuse (the person decides what to do with the damaged ones)."""

    def __init__(self, ckpt_root: Path, problems: list[str]) -> None:
        self.ckpt_root, self.problems = ckpt_root, problems
        super().__init__(
            f"none of the {len(problems)} checkpoint(s) in {ckpt_root} verifies (newest: {problems[0]}); refusing "
            f"to start from step 0 over them. Move the damaged ones aside (e.g. `mv {ckpt_root} "
            f"{ckpt_root}.damaged`) to start fresh in this run.dir, or start elsewhere with "
            "checkpoint.resume=none run.dir=<a new directory>.")


class ScheduleError(ValueError):
    """A schedule that would compute on missing data, mismatch messages or deadlock."""
