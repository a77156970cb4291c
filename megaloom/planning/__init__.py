"""Planning a job before it runs, in one package below the training loop: what a layout needs and what it costs.

The memory half: `shape` (the model's "auto" sizes), `levers` (which speed settings `auto` picks for a shape and
device), `memory_plan` (one rank's peak, component by component; `memory_mla` for latent attention) and
`memory_fit` (`megaloom memory`: the worst stage, the largest micro-batch that fits). The time half: `hardware`
(a GPU kind's calibration and the cluster's links), `compute` (one rank's kernels per micro-batch, from the same
shapes the dry run executes), `comm` (collectives by an alpha-beta model), `step` (a layout's step: pipeline
schedule, exposed communication, memory from `memory_plan`), `search` (every valid layout of a world, best first),
`calibrate` (`megaloom doctor --calibrate`) and `command` (`megaloom plan`). Nothing here imports the training
loop (the trainer, the step): `training/` calls down into it (`training/resolve.py` applies a plan to a run).
It reads `megaloom/preflight.py`, the checks `megaloom train` runs before any work, which sits below both, so that
nothing planned would be refused.
docs/planner.md says how each piece was checked.
"""
