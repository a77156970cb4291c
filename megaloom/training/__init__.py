"""One training run, one idea per file.

- `preflight.py`: every refusal of a config that needs no process group, data or model, in one place.
- `resolve.py`: the "auto" values filled in, giving the resolved config that run.dir/config.yaml records.
- `options.py`: what train.* changes in the built model (fp8, recomputation, fused loss).
- `trainer.py`: `Trainer`: build (runtime, mesh, data, model, optimizer, resume), then step, log, evaluate,
  checkpoint and roll back until the last step.
- `checkpoints.py`, `evaluate.py`, `records.py`, `timeline.py`: the trainer's checkpointing, evaluation,
  metric records and measured pipeline timeline.

`megaloom.train.train(cfg)` is the entry point; this package's `__init__` imports nothing so that light users
(`megaloom memory`) can import one file.
"""
