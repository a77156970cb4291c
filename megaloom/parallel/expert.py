"""Expert parallelism (and tensor parallelism inside experts) for megaloom's MoE layers.

`parallelize_moe(moe, mesh, sp)`, which `parallelize_tensor` applies to every MoE layer, changes it in place:

- ep > 1: this rank keeps experts [ep_rank * E/ep, (ep_rank + 1) * E/ep) of every MoE layer (the stacked
  weights are sliced along dim 0, their `Layout` has ``ep_dim=0``) and the layer's dispatcher becomes an
  `AllToAllDispatcher`. The ep group is carved out of the data-parallel group (megaloom.parallel.mesh), so
  the ranks of an ep group hold *different tokens*: the router runs on local tokens exactly as on one process
  (same top-k, same capacity drops), and only the expert computation travels.
- tp > 1: each expert's SwiGLU is split like the dense MLP (gate/up by columns of F, down by rows), with the
  region borders around the expert GEMMs on the dispatched rows: `copy_to_tp` before (its backward sums the
  partial input gradients) and `reduce_from_tp` after (the combine then sees complete expert outputs, so the
  router's gradient is complete and identical on every tp rank). Shared experts become column/row layers.
  With sequence parallelism the layer first gathers the sequence (backward: keep the own slice, because
  every tp rank back-propagates the complete gradient of its own tokens) and scatters its output back to
  sequence shards. With ep > 1 too, each tp rank then dispatches only its own shard's tokens over ep
  (`SequenceShardDispatcher`: ep traffic 1/tp of every rank sending every token), and the rows reach the tp
  peers, which hold the other hidden units of the same experts, over the tp group instead.

Gradients: an expert weight exists on the dp ranks that share an ep rank (the edp group). Its gradient there
already holds the contributions of every token of the ep group (the all-to-all backward brings them home),
so the data-parallel layer sums it over edp and divides by the full data-parallel size, like every other
gradient (`is_expert_param`). Norms count expert squares summed over the ep group (`parallel/grad_norm.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from megaloom.config import ConfigError
from megaloom.models.moe import Dispatched, LocalDispatcher, MoE
from megaloom.parallel import borders, comm
from megaloom.parallel.layout import Layout, layout_of, set_layout
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.tp_layers import ColumnParallelLinear, RowParallelLinear


def is_expert_param(p: object) -> bool:
    """An expert-parallel weight: each ep rank holds different experts (reduced over edp, normed over ep)."""
    return layout_of(p).expert


@dataclass
class _Route:
    """How rows travelled, so that combine can send the outputs back the same way."""

    inner: Dispatched  # the local dispatch: rows grouped by global expert
    send: list[int]  # rows sent to each ep rank
    recv: list[int]  # rows received from each ep rank
    order: torch.Tensor  # received rows (by source, then local expert) -> grouped by local expert


class AllToAllDispatcher:
    """Dispatch over the ep group: local permutation (with the capacity limit) by global expert, counts
    exchanged with one all-to-all, rows with a second (variable sizes), regrouped by local expert. Combine is
    the inverse route followed by the local weighted sum, so tokens come back in their original order.

    One host synchronisation per dispatch (the split sizes), as in every dropless all-to-all dispatcher.
    """

    def __init__(self, mesh: Mesh) -> None:
        self.mesh, self.ep = mesh, mesh.ep
        self.local = LocalDispatcher()

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, n_experts: int,
                 capacity: int | None) -> Dispatched:
        d = self.local.dispatch(x, weights, experts, n_experts, capacity)
        n_local = n_experts // self.ep
        send_counts = d.counts.view(self.ep, n_local)  # [destination rank, its local expert]
        recv_counts = comm.exchange_counts(send_counts, self.mesh.ep_group, self.mesh.recorder)  # [source, mine]
        sizes = torch.cat([send_counts.sum(1), recv_counts.sum(1)]).tolist()
        send, recv = sizes[:self.ep], sizes[self.ep:]
        rows = d.x
        if torch.is_autocast_enabled(rows.device.type):  # the experts compute in the low precision anyway
            rows = rows.to(torch.get_autocast_dtype(rows.device.type))
        rows = borders.all_to_all(rows, self.mesh.ep_group, recv, send, self.mesh.recorder)
        order = _source_major_to_expert_major(recv_counts, sum(recv))
        return Dispatched(rows[order], recv_counts.sum(0), d.slot, d.weights, d.n_tokens, d.top_k, d.dropped,
                          route=_Route(d, send, recv, order))

    def combine(self, y: torch.Tensor, d: Dispatched) -> torch.Tensor:
        r: _Route = d.route
        back = torch.empty_like(y).index_copy(0, r.order, y)  # undo the regrouping (a permutation)
        back = borders.all_to_all(back, self.mesh.ep_group, r.send, r.recv, self.mesh.recorder)
        return self.local.combine(back, r.inner)


@dataclass
class _ShardRoute:
    """How this tp rank's rows travelled (`SequenceShardDispatcher`): over ep, then to every tp peer."""

    inner: Dispatched  # this rank's own (token, expert) pairs: what the local combine sums
    send: list[int]  # own rows sent to each ep rank
    recv: list[int]  # rows received from each ep rank (for this tp rank's tokens)
    per_tp: list[int]  # rows each tp peer received over ep (all of them computed here, on this rank's hidden units)
    order: torch.Tensor  # rows by (tp source, ep source, local expert) -> grouped by local expert


class SequenceShardDispatcher:
    """Expert dispatch under sequence parallelism with tp > 1 and ep > 1: each tp rank sends only the (token,
    expert) pairs of its own sequence shard over ep, so the ep all-to-alls carry each token once instead of once
    per tp rank (Megatron-Core's expert tensor parallelism: the tokens are split over tp before dispatch).

    The router still runs on the gathered sequence, identically on every tp rank, so top-k, capacity drops (by
    position over the whole micro-batch), aux and z losses and the logged load are the single process's
    (Megatron routes only the shard, which changes what capacity drops). Then:

    - dispatch: the local permutation of every kept pair; this rank keeps the pairs of its own tokens, sends them
      over ep (counts first, one host sync for all the split sizes, as `AllToAllDispatcher`), and every tp peer
      receives them (an all-to-all over tp: each rank's rows to all, i.e. a variable-size all-gather, whose
      backward sums the peers' partial input gradients), because each tp rank holds its own slice of every local
      expert's hidden units. The rows of all tp sources are regrouped by local expert for one grouped GEMM.
    - combine: the expert outputs (partial sums over this rank's hidden units) go back to their tp source and are
      summed there (a variable-size reduce-scatter), return over ep, and the local combine sums this rank's own
      pairs only; other tokens' rows stay zero and the MoE's exit keeps this rank's sequence shard.
    - the router's combine weights enter through `copy_to_tp`: each rank combines only its own tokens, so the
      weights' gradients are summed over tp, and the router's gradient stays complete on every tp rank.

    ``seq_len`` (the gathered sequence's length) is set by the MoE's entry hook before each forward.
    """

    def __init__(self, mesh: Mesh) -> None:
        self.mesh, self.ep, self.tp = mesh, mesh.ep, mesh.tp
        self.local = LocalDispatcher()
        self.seq_len = 0

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, n_experts: int,
                 capacity: int | None) -> Dispatched:
        m, ep, tp = self.mesh, self.ep, self.tp
        weights = borders.copy_to_tp(weights, m.tp_group, m.recorder)
        d = self.local.dispatch(x, weights, experts, n_experts, capacity)  # every token's kept pairs
        token = torch.div(d.slot, d.top_k, rounding_mode="floor")  # flat token b * T + s of each row
        own = torch.div(token % self.seq_len, self.seq_len // tp, rounding_mode="floor") == m.tp_rank
        row_expert = experts.reshape(-1)[d.slot]
        n_local = n_experts // ep
        send_counts = torch.zeros(n_experts, dtype=torch.long, device=x.device).index_add_(
            0, row_expert, own.long()).view(ep, n_local)  # [destination ep rank, its local expert]
        recv_counts = comm.exchange_counts(send_counts, m.ep_group, m.recorder)  # [source ep rank, my local expert]
        every_recv = comm.gather_counts(recv_counts, m.tp_group, m.recorder)  # [tp * ep, local expert]
        sizes = torch.cat([send_counts.sum(1), every_recv.sum(1)]).tolist()  # the one host sync
        send, got = sizes[:ep], sizes[ep:]
        per_tp = [sum(got[q * ep:(q + 1) * ep]) for q in range(tp)]
        recv = got[m.tp_rank * ep:(m.tp_rank + 1) * ep]
        # this rank's rows, still grouped by global expert (a stable sort keeps their order)
        mine = torch.sort((~own).to(torch.int32), stable=True).indices[:sum(send)]
        rows = d.x[mine]
        if torch.is_autocast_enabled(rows.device.type):  # the experts compute in the low precision anyway
            rows = rows.to(torch.get_autocast_dtype(rows.device.type))
        rows = borders.all_to_all(rows, m.ep_group, recv, send, m.recorder)  # (ep source, local expert)
        n = rows.shape[0]
        rows = borders.all_to_all(rows.repeat(tp, 1), m.tp_group, per_tp, [n] * tp, m.recorder)
        order = _source_major_to_expert_major(every_recv, sum(per_tp))
        inner = Dispatched(rows, send_counts.reshape(-1), d.slot[mine], d.weights[mine], d.n_tokens, d.top_k,
                           d.dropped)
        return Dispatched(rows[order], every_recv.sum(0), d.slot, d.weights, d.n_tokens, d.top_k, d.dropped,
                          route=_ShardRoute(inner, send, recv, per_tp, order))

    def combine(self, y: torch.Tensor, d: Dispatched) -> torch.Tensor:
        m, r = self.mesh, d.route
        back = torch.empty_like(y).index_copy(0, r.order, y)  # by (tp source, ep source, local expert)
        n = sum(r.recv)
        back = borders.all_to_all(back, m.tp_group, [n] * self.tp, r.per_tp, m.recorder)  # partial sums, home
        back = back.view(self.tp, n, *back.shape[1:]).sum(0)
        back = borders.all_to_all(back, m.ep_group, r.send, r.recv, m.recorder)
        return self.local.combine(back, r.inner)


def _source_major_to_expert_major(counts: torch.Tensor, n: int) -> torch.Tensor:
    """Gather indices taking rows laid out by (source rank, local expert) to (local expert, source rank).

    ``counts[s, e]`` rows came from source s for local expert e; ``n`` = counts.sum() (known on the host)."""
    flat = counts.reshape(-1)
    start = (torch.cumsum(flat, 0) - flat).view_as(counts)  # where block (s, e) begins in the received rows
    block_start, block_len = start.t().reshape(-1), counts.t().reshape(-1)  # blocks in (e, s) order
    dest_start = torch.cumsum(block_len, 0) - block_len
    pos = torch.arange(n, device=counts.device)
    return torch.repeat_interleave(block_start - dest_start, block_len, output_size=n) + pos


def _slice(p: nn.Parameter, dim: int, index: int, parts: int) -> nn.Parameter:
    n = p.shape[dim] // parts
    return nn.Parameter(p.detach().narrow(dim, index * n, n).clone())


def _scatter_output(mesh: Mesh, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return borders.scatter_to_seq(out, mesh.tp_group, mesh.recorder)


def _enter_copy(mesh: Mesh, module: nn.Module, args: tuple) -> tuple:
    return (borders.copy_to_tp(args[0], mesh.tp_group, mesh.recorder),) + tuple(args[1:])


def _gather_input(mesh: Mesh, module: nn.Module, args: tuple) -> tuple:
    x = borders.gather_from_seq_replicated(args[0], mesh.tp_group, mesh.recorder)
    if isinstance(module.dispatcher, SequenceShardDispatcher):
        module.dispatcher.seq_len = x.shape[1]
    return (x,) + tuple(args[1:])


def _expert_in(mesh: Mesh, x: torch.Tensor) -> torch.Tensor:
    return borders.copy_to_tp(x, mesh.tp_group, mesh.recorder)


def _expert_out(mesh: Mesh, x: torch.Tensor) -> torch.Tensor:
    return borders.reduce_from_tp(x, mesh.tp_group, mesh.recorder)


def check_expert_layout(n_experts: int, mesh: Mesh) -> None:
    if n_experts % mesh.ep:
        works = [e for e in range(1, n_experts + 1) if n_experts % e == 0]
        raise ConfigError(f"parallel.ep={mesh.ep} does not divide model.n_experts={n_experts} (each ep rank "
                          f"owns whole experts); parallel.ep values that would work: {works}.")


def parallelize_moe(moe: MoE, mesh: Mesh, sp: bool) -> MoE:
    """Split one MoE layer over ``mesh.ep`` (experts) and ``mesh.tp`` (each expert's hidden units)."""
    check_expert_layout(moe.n_experts, mesh)
    ex = moe.experts
    if mesh.ep > 1:
        for name in ("w_gate", "w_up", "w_down"):
            setattr(ex, name, _slice(getattr(ex, name), 0, mesh.ep_rank, mesh.ep))
        moe.dispatcher = AllToAllDispatcher(mesh)
    if mesh.tp > 1:
        ffn = ex.w_gate.shape[-1]
        if ffn % mesh.tp:
            raise ConfigError(f"parallel.tp={mesh.tp} does not divide the expert width {ffn} "
                              f"(model.expert_ffn_dim); use a multiple of {mesh.tp}.")
        ex.w_gate = _slice(ex.w_gate, 2, mesh.tp_rank, mesh.tp)
        ex.w_up = _slice(ex.w_up, 2, mesh.tp_rank, mesh.tp)
        ex.w_down = _slice(ex.w_down, 1, mesh.tp_rank, mesh.tp)
        if sp and mesh.ep > 1:  # tokens split over tp before dispatch; the dispatcher crosses the tp border
            moe.dispatcher = SequenceShardDispatcher(mesh)
        else:
            moe.expert_in = partial(_expert_in, mesh)  # the recorder is read per call: the trainer replaces it
            moe.expert_out = partial(_expert_out, mesh)
        if moe.shared is not None:
            sh = moe.shared
            sh.gate_proj = ColumnParallelLinear.from_linear(sh.gate_proj, mesh, "none")
            sh.up_proj = ColumnParallelLinear.from_linear(sh.up_proj, mesh, "none")
            sh.down_proj = RowParallelLinear.from_linear(sh.down_proj, mesh, "reduce")
            sh.register_forward_pre_hook(partial(_enter_copy, mesh))  # once for gate and up together
        if sp:
            moe.register_forward_pre_hook(partial(_gather_input, mesh))
            moe.register_forward_hook(partial(_scatter_output, mesh))
    for name, dim in (("w_gate", 2), ("w_up", 2), ("w_down", 1)):
        set_layout(getattr(ex, name), Layout(tp_dim=dim if mesh.tp > 1 else None, ep_dim=0 if mesh.ep > 1 else None))
    return moe


