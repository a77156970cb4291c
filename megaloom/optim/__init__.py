"""Optimizers and their sharding, in one package (issue 50).

- `build`: the factory (AdamW or LAMB over whole parameters) and the learning-rate schedule.
- `param_groups`: Megatron's weight-decay rule, shared by every optimizer here.
- `lamb`: LAMB with its trust ratio computed over tensor-parallel shards.
- `onebit`: 1-bit Adam / 1-bit LAMB (error-compensated sign compression of the momentum).
- `compressed`: the compressed all-reduce that 1-bit uses (signs + one scale per chunk).
- `zero`: ZeRO-1/2 state sharding (each data-parallel rank updates its slice of the flat buckets).
- `overlapped_step`: the AdamW step run on a side stream beside the next forward (`train.overlap_optimizer`).

The package sits above `parallel/` (it uses the mesh, the collectives and the gradient buckets) and below
`training/` (the trainer chooses and builds one); nothing in `parallel/` or `models/` imports it.
"""
