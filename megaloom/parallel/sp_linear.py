"""Column-parallel linears under sequence parallelism that keep this rank's sequence shard for backward.

A column-parallel linear needs its whole input [B, T, D] for the weight gradient. Left to autograd, F.linear
saves the all-gathered sequence: tp times what the sp residual stream holds, and under autocast each of q, k
and v (gate and up) its own bf16 cast of it, so with sp a block kept 8 x s x h bytes that did not shrink
with tp (2.4x more than tp=1/8 at GPT-3 width). Here, as in Megatron (Korthikanti et al. 2022), the
column-parallel linears that read one region's input run as one autograd node (`_GatheredLinears`) that saves
only this rank's shard, in the compute dtype, and gathers it again in backward:

  forward   the shard is cast to the compute dtype once (autocast would cast the gathered input for every
            linear), all-gathered once (half the bytes of the fp32 gather), and every linear runs on it
  backward  the shard is re-gathered asynchronously under the grad-input GEMMs; the summed grad-input is
            reduce-scattered asynchronously under the weight-gradient GEMMs (Megatron's async grad-input)

The region's entry (`SeqRegion`, a forward pre-hook on the attention / MLP module) still hands the module the
gathered sequence through the differentiable `borders.gather_from_seq`: the module reads its shape, and anything
else in it that reads the sequence gets a correct gradient through that gather's reduce-scatter. The first
region linear the module calls computes all of them (`SeqRegion.output`); the others take their outputs from
it. Under torch.compile (the compiler decides what to save) and without gradients the linears run as plain
F.linear on the gathered input. The output head under sp (input mode "gather") uses the same node for itself.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from megaloom.parallel import borders, comm
from megaloom.parallel.collective_matmul import all_gather_linears
from megaloom.parallel.comm import Group, OpRecorder


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the matmuls reading ``x`` run in: autocast's on x's device, else x's own."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def to_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """``x`` cast (differentiably) to `compute_dtype`: what crosses the wire and what is saved."""
    dtype = compute_dtype(x)
    return x if x.dtype == dtype or not x.is_floating_point() else x.to(dtype)


_AS_COMPILED: contextvars.ContextVar[bool] = contextvars.ContextVar("megaloom_sp_as_compiled", default=False)


def lean_path_active() -> bool:
    """Whether the shard-saving node is used: only while gradients are recorded and outside torch.compile's
    tracing (which partitions saved tensors itself and does not take the region's Python-side bookkeeping), and
    not inside `collectives_as_compiled`."""
    return torch.is_grad_enabled() and not torch.compiler.is_compiling() and not _AS_COMPILED.get()


@contextlib.contextmanager
def collectives_as_compiled() -> Iterator[None]:
    """Eager code inside issues the collectives that compiled blocks issue: the regions' linears run as plain
    linears on the gathered sequence (no shard-saving node, so no re-gather in backward), as they do under
    torch.compile. A dry run counts a compiled job's collectives in such an eager step (compiled graphs call
    no recorder)."""
    token = _AS_COMPILED.set(True)
    try:
        yield
    finally:
        _AS_COMPILED.reset(token)


class _GatheredLinears(Function):
    """y_i = gather(x_local) W_i^T + b_i for the linears of one region, saving x_local (not the gather)."""

    @staticmethod
    def forward(ctx, x_local: torch.Tensor, x_full: torch.Tensor | None, group: Group,
                recorder: OpRecorder | None, n: int, *params: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        if x_full is None:
            x_full = comm.gather_along_dim(x_local, 1, group, recorder)
        weights, biases = params[:n], params[n:]
        ctx.group, ctx.recorder, ctx.n = group, recorder, n
        ctx.has_bias = [b is not None for b in biases]
        ctx.set_materialize_grads(False)  # an output nobody used gets no gradient GEMMs
        ctx.save_for_backward(x_local, *weights)
        return tuple(F.linear(x_full, w, b) for w, b in zip(weights, biases, strict=True))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        x_local, *weights = ctx.saved_tensors
        group, rec, n = ctx.group, ctx.recorder, ctx.n
        need_x = ctx.needs_input_grad[0]
        need_w, need_b = ctx.needs_input_grad[5:5 + n], ctx.needs_input_grad[5 + n:]
        regathered = comm.gather_along_dim_async(x_local, 1, group, rec)  # in flight under the grad-input GEMMs
        d = x_local.shape[-1]
        grad_x = None
        if need_x:  # summed last linear first, as autograd would sum them: fp32 results stay bit-identical
            for g, w in reversed(list(zip(grads, weights, strict=True))):
                if g is not None:
                    gx = g.reshape(-1, g.shape[-1]) @ w
                    grad_x = gx if grad_x is None else grad_x + gx
        x_full = regathered().reshape(-1, d)
        scattered = None
        if grad_x is not None:  # in flight under the weight-gradient GEMMs
            full_shape = x_local.shape[:1] + (x_full.shape[0] // x_local.shape[0], d)
            scattered = comm.reduce_scatter_along_dim_async(grad_x.view(full_shape), 1, group, rec)
        grad_w: list[torch.Tensor | None] = [None] * n
        grad_b: list[torch.Tensor | None] = [None] * n
        for i, g in enumerate(grads):
            if g is None:
                continue
            g2 = g.reshape(-1, g.shape[-1])
            if need_w[i]:
                grad_w[i] = g2.t() @ x_full
            if ctx.has_bias[i] and need_b[i]:
                grad_b[i] = g2.sum(0)
        grad_local = scattered() if scattered is not None else None
        return (grad_local, None, None, None, None, *grad_w, *grad_b)


def gathered_linears(x_local: torch.Tensor, x_full: torch.Tensor | None,
                     params: Sequence[tuple[torch.Tensor, torch.Tensor | None]], group: Group,
                     recorder: OpRecorder | None = None, ring: bool = False) -> tuple[torch.Tensor, ...]:
    """The outputs of linears ``params`` ((weight, bias) pairs, this rank's rows) on the all-gathered sequence of
    ``x_local`` [B, T/tp, D] (already in the compute dtype), saving only ``x_local`` for backward. ``x_full``:
    the gathered sequence if the caller already has it (gathered here otherwise). The weights are cast to
    x_local's dtype as autocast would (the casts are saved, as autocast's are). ``ring``: gather as ring steps
    overlapped with the GEMMs (`collective_matmul`, parallel.async_tp); ``x_full`` is then not read."""
    dtype = x_local.dtype
    ws = [w if w.dtype == dtype else w.to(dtype) for w, _ in params]
    bs = [b if b is None or b.dtype == dtype else b.to(dtype) for _, b in params]
    if ring:
        return all_gather_linears(x_local, list(zip(ws, bs, strict=True)), group, recorder)
    full = None if x_full is None else x_full.detach()
    return _GatheredLinears.apply(x_local, full, group, recorder, len(params), *ws, *bs)


class SeqRegion:
    """Entry of one attention / MLP module into its tensor-parallel region under sequence parallelism.

    ``enter`` (forward pre-hook) casts the module's input shard to the compute dtype and all-gathers it;
    ``output(linear, x)`` gives a column-parallel child its output from one `_GatheredLinears` node for all of
    them; ``leave`` (forward hook) drops the bookkeeping, so nothing outlives the module's forward.

    ``ring`` (parallel.async_tp): nothing is gathered on entry; the module gets a stand-in of the gathered
    sequence's shape (a stride-0 view of the shard, no memory) and its column-parallel linears gather the shard
    as ring steps under their GEMMs (`collective_matmul`). This relies on the module reading its input only
    through those linears and its shape, as megaloom's attention and MLP do; a module that reads the values
    otherwise must not be a ring region."""

    def __init__(self, mesh, ring: bool = False) -> None:
        self.mesh, self.ring = mesh, ring
        self.overlap = False  # compiled: the gather in the form Inductor fuses with the GEMMs (parallel.async_tp)
        self._linears: list[nn.Module] | None = None
        self._local: torch.Tensor | None = None
        self._full: torch.Tensor | None = None
        self._outputs: dict[int, torch.Tensor] | None = None

    def bind(self, module: nn.Module) -> None:
        """Find the column-parallel children that read the region's input (once the plan has split them)."""
        self._linears = [m for m in module.children() if hasattr(m, "seq_region")
                         and getattr(m, "input_mode", None) == "none" and getattr(m, "region_input", True)]
        for m in self._linears:
            m.seq_region = self

    def enter(self, module: nn.Module, args: tuple) -> tuple:
        if self._linears is None:  # not bound by parallelize_tensor (a region installed by hand)
            self.bind(module)
        # fp8 linears quantise from the input as it comes (an fp32 input keeps its amax exact): no cast then.
        fp8 = any(m.fp8_recipe is not None for m in self._linears)
        local = args[0] if fp8 else to_compute_dtype(args[0])
        if self.ring and not fp8 and lean_path_active() and self._linears:
            b, t, d = local.shape
            full = local.detach().as_strided((b, t * self.mesh.tp, d), (local.stride(0), 0, local.stride(2)))
            self._local, self._full, self._outputs = local, full, None
            return (full,) + tuple(args[1:])
        full = borders.gather_from_seq(local, self.mesh.tp_group, self.mesh.recorder, self.overlap)
        if lean_path_active():
            self._local, self._full, self._outputs = local, full, None
        return (full,) + tuple(args[1:])

    def output(self, linear: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """``linear``'s output on the region's gathered input ``x``, or None (then it runs as a plain linear):
        ``x`` is something else, or the region's linears run in fp8 (their own save-sets)."""
        if (self._full is None or x is not self._full
                or any(m.fp8_recipe is not None or m.fused_wgrad for m in self._linears)):
            return None  # (fused weight gradients: grad_fusion's node per linear)
        if self._outputs is None:  # the first of the region's linears: all of them, in one node
            outs = gathered_linears(self._local, self._full, [(m.weight, m.bias) for m in self._linears],
                                    self.mesh.tp_group, self.mesh.recorder, ring=self.ring)
            self._outputs = {id(m): o for m, o in zip(self._linears, outs, strict=True)}
        y = self._outputs.pop(id(linear), None)  # a second call on the same input: a plain linear
        if y is None and self.ring:  # ... which would read the stand-in's values
            raise RuntimeError(f"parallel.async_tp: {type(linear).__name__} read its region's input a second time; "
                               "ring regions need each column-parallel linear called once per forward")
        return y

    def leave(self, module: nn.Module, args: tuple, output) -> None:
        self._local = self._full = self._outputs = None
