"""The time half of planning a job: what one step of a layout costs on a cluster, and the search over layouts.

`hardware` (a GPU kind's calibration and the cluster's links), `compute` (one rank's kernels per micro-batch,
from the same shapes the dry run executes), `comm` (collectives by an alpha-beta model), `step` (a layout's step:
pipeline schedule, exposed communication, memory from `observe.memory_plan`), `search` (every valid layout of a
world, best first) and `command` (`megaloom plan`). docs/planner.md says how each piece was checked.
"""
