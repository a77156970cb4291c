"""TensorBoard: event files in run.dir, tags ``train/<key>`` and ``eval/<key>`` (eval_loss -> eval/loss), as
megaloom has always written them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megaloom.observe.trackers.scalars import scalars


class TensorBoard:
    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir))

    def log(self, record: dict[str, Any], step: int) -> None:
        for k, v in scalars(record, finite_only=False).items():  # a NaN spike is worth seeing on the curve
            self.writer.add_scalar(k.replace("eval_", "eval/") if k.startswith("eval_") else f"train/{k}", v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
