"""Starting several processes: the torchrun command behind `megaloom train --nproc N`."""

from __future__ import annotations

import sys

from megaloom.config import ConfigError


def _strip_nproc(argv: list[str]) -> list[str]:
    """Drop --nproc/--max-restarts so a worker never tries to launch workers of its own."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--nproc", "--max-restarts"):
            skip = True
        elif not a.startswith(("--nproc=", "--max-restarts=")):
            out.append(a)
    return out


def torchrun_command(nproc: int, argv: list[str], max_restarts: int = 0) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N [--max-restarts K] -m megaloom train
    ARGV``: one node, a free rendezvous port picked by torchrun, every worker running the same training."""
    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}; use the number of GPUs (or CPU processes) of "
                          "this node, e.g. --nproc 8.")
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {max_restarts}.")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    if max_restarts:
        cmd += ["--max-restarts", str(max_restarts)]
    return cmd + ["-m", "megaloom", "train", *_strip_nproc(list(argv))]
