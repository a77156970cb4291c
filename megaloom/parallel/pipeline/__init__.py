"""Pipeline parallelism: the model cut into stages over ``parallel.pp`` ranks (``parallel.vpp`` chunks each),
micro-batches flowing through them by a schedule that is data, proven before it runs.

  partition.py       which layers each (virtual) stage holds; micro-batch / schedule checks (ConfigError)
  stage.py           PipelineStage (the model pruned to its stages, a span per chunk), tied-embedding sync
  schedules.py       Action / Schedule and the generators: gpipe, 1f1b, interleaved, zb (ZB-H1), forward_only
  checker.py         check_schedule (dependencies, message order, deadlock) and simulate (planned timeline)
  split_backward.py  the zero-bubble BI / BW split of a backward pass
  executor.py        PipelineExecutor: runs one rank's list with batched isend/irecv
  grads.py           PipelineGradientSync: tied-embedding sum, tp/dp completion, norm counting the tie once
  timing.py          TimedAction / Timeline, drawn by megaloom.observe.timeline

Import the modules themselves: this package imports nothing, so that megaloom.parallel.mesh (or config
validation) can use ``partition`` without an import cycle through the executor.
"""
