"""The run's checkpoints: resume at start, periodic (blocking or background) saves, and rollback restores."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from megaloom.checkpoint import (
    AsyncCheckpointer,
    CheckpointError,
    find_checkpoints,
    load_checkpoint,
    load_newest,
    save_checkpoint,
)
from megaloom.checkpoint.group import CheckpointGroup
from megaloom.checkpoint.store import STATE, step_name
from megaloom.config import Config
from megaloom.data.identity import data_changes
from megaloom.errors import DataChanged, RunStopped
from megaloom.models.lora import saved_settings
from megaloom.observe.log import get_logger
from megaloom.parallel.mesh import Mesh
from megaloom.runtime import Runtime
from megaloom.step import TrainStep

log = get_logger(__name__)


class RunCheckpoints:
    """run.dir/checkpoints of one run, for every rank: `resume`, `save`, `rollback`, and `wait` at the end."""

    def __init__(self, cfg: Config, run_dir: Path, rt: Runtime, mesh: Mesh, group: CheckpointGroup | None = None,
                 data: list[dict] | None = None) -> None:
        """``group``: the trainer's checkpoint group (made at start-up); None makes one here (collective).
        ``data``: the identity of the run's token files (data/identity.py), saved with every checkpoint and
        compared on resume; None where the data is not token files (image-text sets, a dry run's tokens)."""
        self.cfg, self.root, self.rt, self.mesh = cfg, run_dir / "checkpoints", rt, mesh
        self.data = data
        self.group = group if group is not None else CheckpointGroup(cfg.checkpoint.timeout_s)
        self.saver: AsyncCheckpointer | None = None

    def start_background_saves(self) -> None:
        """checkpoint.async_save: saves copy to host and write in a background thread, every rank its slices."""
        if self.cfg.checkpoint.async_save:
            report = (lambda r: log.info(f"checkpoint {r.path.name} written in {r.write_s:.2f}s (background)"))
            self.saver = AsyncCheckpointer(on_written=report if self.rt.is_main else None, group=self.group)

    def _warn(self, msg: str) -> None:
        if self.rt.is_main:  # the ranks agree on every verdict: one warning for the job
            log.warning(msg)

    def resume(self, model, optimizer) -> tuple[int, dict]:
        """Load the requested checkpoint; with resume=auto, the newest one that verifies. Returns (step, state)."""
        cfg, rt, mesh = self.cfg, self.rt, self.mesh
        choice = cfg.checkpoint.resume
        if choice == "none":
            return 0, {}
        if choice == "auto":
            # LoRA on the model `convert --from-hf` imported into this run.dir (step 0: no schedule is lost, and the
            # adapters' checkpoints sort after it). A trained model at a later step is refused by the load below,
            # naming checkpoint.resume=<its dir> with a new run.dir.
            newest = find_checkpoints(self.root)
            if newest and newest[0].name == step_name(0) and self._new_adapters(newest[0]):
                found = load_newest(self.root, model, None, rank=rt.rank, model_cfg=cfg.model.__dict__, mesh=mesh,
                                    warn=self._warn, group=self.group, fresh_adapters=True)
                log.info(f"checkpoint {found[0]} has no LoRA adapters: this run trains new ones (model.lora) on its "
                         "weights from step 0 with a fresh optimizer")
                return 0, {}
            found = load_newest(self.root, model, optimizer, rank=rt.rank, model_cfg=cfg.model.__dict__, mesh=mesh,
                                warn=self._warn, group=self.group, check_state=self._check_data)
            if found is None:
                return 0, {}
            path, state = found
        else:
            path = Path(choice)
            if not path.is_dir():
                raise CheckpointError(f"checkpoint.resume: directory '{choice}' not found.")
            if self._another_stage(path):  # e.g. LLaVA: projector-only pretraining -> full fine-tuning
                fresh = self._new_adapters(path)
                load_checkpoint(path, model, optimizer, rank=rt.rank, model_cfg=cfg.model.__dict__, mesh=mesh,
                                group=self.group, fresh_adapters=fresh, model_only=True)
                what = "no LoRA adapters (new ones train on its weights)" if fresh else "another model.freeze"
                log.info(f"checkpoint.resume={path}: saved with {what}, a new training stage: this run starts from "
                         "its weights at step 0 with a fresh optimizer")
                return 0, {}
            state = load_checkpoint(path, model, optimizer, rank=rt.rank, model_cfg=cfg.model.__dict__, mesh=mesh,
                                    group=self.group, check_state=self._check_data)
        _check_data_compatible(state, cfg)
        log.info(f"resumed from {path} at step {state['step']}")
        for line in resume_changes(state, cfg, self.layout()):
            log.info(line)
        return int(state["step"]), state

    def _check_data(self, path: Path, state: dict) -> None:
        """Refuse a checkpoint whose data differs from this run's (exact resume would silently read other
        samples), before its tensors load; checkpoint.allow_data_change=true goes on with a warning."""
        changes = data_changes(state.get("data"), self.data)
        if not changes:
            return
        what = "; ".join(changes)
        if self.cfg.checkpoint.allow_data_change:
            self._warn(f"WARNING: the data changed since checkpoint {path.name} was written ({what}); continuing on "
                       "the new data as checkpoint.allow_data_change=true asks (the resume is not exact)")
            return
        raise DataChanged(f"checkpoint {path} was trained on other data than this run's (data.paths): {what}; "
                          "resuming would read other samples than the run it continues. Put the original files "
                          "back, or set checkpoint.allow_data_change=true to continue on the new data (or start a "
                          "new run.dir).")

    def _saved_model(self, path: Path) -> dict | None:
        try:
            return json.loads((path / STATE).read_text()).get("model") or {}
        except (OSError, ValueError):
            return None  # load_checkpoint's verification names what is wrong with it

    def _another_stage(self, path: Path) -> bool:
        """The checkpoint was trained with other parts frozen (model.freeze), or without the LoRA adapters this
        run trains: its optimizer state does not cover this run's trainable parameters, and its step counts
        another stage's schedule."""
        saved = self._saved_model(path)
        if saved is None:
            return False
        return sorted(saved.get("freeze") or []) != sorted(self.cfg.model.freeze) or self._new_adapters(path)

    def _new_adapters(self, path: Path) -> bool:
        """This run has LoRA adapters and the checkpoint none (an imported or fully trained model to adapt)."""
        saved = self._saved_model(path)
        return saved is not None and self.cfg.model.lora.rank > 0 and not saved_settings(saved)["rank"]

    def layout(self) -> dict:
        """The parallel layout of this run, as saved with every checkpoint and compared with it on resume."""
        m = self.mesh
        return {"tp": m.tp, "pp": m.pp, "dp": m.dp, "cp": m.cp, "ep": m.ep, "zero": self.cfg.parallel.zero,
                "world": self.rt.world_size}

    def save(self, step: int, model, optimizer, train_step: TrainStep, data_offset: int) -> float:
        """Checkpoint `step`; returns the seconds the training loop was blocked."""
        cfg, rt, mesh = self.cfg, self.rt, self.mesh
        t0 = time.perf_counter()
        state = run_state(cfg, step)
        state["data_offset"] = data_offset
        if self.data is not None:
            state["data"] = self.data
        state["layout"] = self.layout()
        if train_step.scaler is not None:
            state["loss_scaler"] = train_step.scaler.state_dict()
        if self.saver is not None:
            rec = self.saver.save(self.root, step, model, optimizer, state, cfg.checkpoint.keep, rank=rt.rank,
                                  barrier=self.group.barrier, mesh=mesh)
            how = ("weights and optimizer state written where they are in host memory: the next update waits "
                   "until they are" if rec.in_place else "copy to host")
            log.info(f"checkpoint step {step}: training paused {rec.stall_s:.3f}s ({how}; {rec.wait_s:.3f}s of it "
                     "waiting for the previous write), writing in the background")
            return rec.stall_s
        path = save_checkpoint(self.root, step, model, optimizer, state, cfg.checkpoint.keep, mesh=mesh,
                               group=self.group)
        stall = time.perf_counter() - t0
        log.info(f"saved checkpoint {path} in {stall:.2f}s")
        return stall

    def update_wait_s(self) -> float:
        """How long the optimizer update after the last background save waited for its in-place write."""
        return self.saver.history[-1].update_wait_s if self.saver is not None and self.saver.history else 0.0

    def rollback(self, model, optimizer) -> int:
        """Restore the newest checkpoint that verifies (model, optimizer, RNG); returns its step."""
        self.wait()
        found = load_newest(self.root, model, optimizer, rank=self.rt.rank, model_cfg=self.cfg.model.__dict__,
                            mesh=self.mesh, warn=self._warn, group=self.group)
        if found is None:
            raise RunStopped(f"{self.cfg.resilience.max_bad_steps} non-finite steps in a row and no checkpoint in "
                             f"{self.root} to roll back to; lower train.lr (now {self.cfg.train.lr:g}) or check the "
                             "data, and set checkpoint.every so that a checkpoint exists before the bad steps.")
        optimizer.zero_grad(set_to_none=True)
        return int(found[1]["step"])

    def newest_step(self) -> int | None:
        """The step of the newest finished checkpoint on disk (not verified), None if there is none."""
        found = find_checkpoints(self.root)
        return int(found[0].name[len("step_"):]) if found else None

    def wait(self) -> None:
        """The background write in flight (if any) is on disk when this returns, on every rank."""
        if self.saver is not None:
            self.saver.wait(self.group.barrier)


def run_state(cfg: Config, step: int) -> dict:
    return {"consumed_samples": step * cfg.train.global_batch_size, "model": dataclasses.asdict(cfg.model),
            "seq_len": cfg.train.seq_len, "seed": cfg.train.seed, "train_steps": cfg.train.steps}


def _fmt_layout(layout: dict) -> str:
    world = layout.get("world")
    return " ".join(f"{k}={v}" for k, v in layout.items() if k != "world") + (f" (world {world})" if world else "")


def resume_changes(state: dict, cfg: Config, layout: dict) -> list[str]:
    """One line for each setting of the run that differs from the resumed checkpoint's and is carried on, saying
    what is done with it: the parallel layout (resharded on load) and train.steps (trained to the new value).
    Checkpoints written before these were saved say nothing."""
    lines = []
    saved = state.get("layout")
    if saved and {k: saved.get(k) for k in layout} != layout:
        lines.append(f"the checkpoint was written at layout {_fmt_layout(saved)}; this run is "
                     f"{_fmt_layout(layout)}: its weights and optimizer state are resharded to the new layout as "
                     "they load")
    old_steps, step, steps = state.get("train_steps"), int(state["step"]), cfg.train.steps
    if old_steps is not None and old_steps != steps and steps > step:
        lr = ("; the learning-rate schedule follows the new value" if not cfg.train.lr_decay_steps else "")
        lines.append(f"the checkpoint's run had train.steps={old_steps}; this run trains on from step {step} to the "
                     f"new train.steps={steps}{lr}")
    return lines


def _check_data_compatible(state: dict, cfg: Config) -> None:
    if state.get("seq_len") not in (None, cfg.train.seq_len):
        raise CheckpointError(f"checkpoint was trained with train.seq_len={state['seq_len']} but the config says "
                              f"{cfg.train.seq_len}; exact data resume needs the same value.")
