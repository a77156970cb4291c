"""Parallel runtime: the process mesh, collectives, and tensor/sequence parallelism.

mesh     -- validate_layout, Mesh (ranks -> coordinates, process groups)
comm     -- the only module calling torch.distributed collectives; autograd borders of tp regions
tensor   -- parallelize_tensor and the gradient / gather helpers of tensor-parallel models
random   -- dropout streams that differ (or agree) across tp ranks
launch   -- torchrun command line
"""

from megaloom.parallel.mesh import Mesh, validate_layout
from megaloom.parallel.tensor import gather_full_grads, gather_full_params, parallelize_tensor, sync_tp_grads

__all__ = ["Mesh", "gather_full_grads", "gather_full_params", "parallelize_tensor", "sync_tp_grads",
           "validate_layout"]
