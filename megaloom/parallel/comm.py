"""The only place megaloom calls torch.distributed collectives in eager code (compiled blocks trace theirs as
functional collectives: `megaloom.parallel.borders`).

Every function takes its process group explicitly (megaloom never relies on the implicit WORLD group) and
reports the op, with its size in bytes, to an optional recorder: a watchdog says which collective a hung rank is
stuck in (`LastOpRecorder`), a dry run tallies calls and bytes per group (`CommTally`). The size is the op's
buffer as nccl-tests counts it: the tensor of an all-reduce or broadcast, the gathered output of an all-gather,
the input of a reduce-scatter or all-to-all, each message of a batch of sends and receives. `CommTally` also
estimates the bytes a rank puts on its links for each op (`sent_bytes`: what the bandwidth-optimal ring and
pairwise algorithms send), the quantity a link's speed divides.
A group of None means "no peers" (`Mesh.single()` or a size-1 dimension): every op is then the identity,
so single-process runs go through exactly the same code.

The differentiable collectives built on these (the borders of Megatron's tensor-parallel regions, the all-to-all
exchanges), with their traced form for compiled blocks, are `megaloom.parallel.borders`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

Group = Any  # torch.distributed.ProcessGroup or None (no peers)

# torch 2.13 renamed the tensor-in/tensor-out collectives; 2.11 only has the old names (same signatures).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "product": dist.ReduceOp.PRODUCT}


class OpRecorder:
    """Told about every collective before it is issued and after it returns; the base class does nothing.

    ``enter``'s ``nbytes`` is the op's buffer (module doc); a ``wait <op>`` entry (an async op's completion)
    carries none. A batch of point-to-point messages is one ``enter("send_recv", ...)`` preceded by one
    ``message("send" | "recv", group, nbytes)`` per message, which only counts (it blocks nothing)."""

    def enter(self, name: str, group: Group, nbytes: int = 0) -> None:
        pass

    def exit(self) -> None:
        pass

    def message(self, kind: str, group: Group, nbytes: int) -> None:
        pass


class NullRecorder(OpRecorder):
    """The default: record nothing."""


class LastOpRecorder(OpRecorder):
    """Remembers the last collective this rank issued and whether it has returned.

    A watchdog thread reads the attributes (plain assignments, so no lock is needed). Note that NCCL ops
    return once enqueued on the stream, so "returned" means issued, not completed on the device.
    """

    def __init__(self) -> None:
        self.name: str | None = None
        self.group: Group = None
        self.started = 0.0
        self.in_flight = False
        self.count = 0
        self.seconds = 0.0  # host time spent inside collectives, for the straggler report
        self.spans = None  # the straggler check's device timing on GPUs (resilience.straggler.DeviceSpans)

    def enter(self, name: str, group: Group, nbytes: int = 0) -> None:
        self.name, self.group, self.started = name, group, time.monotonic()
        self.count += 1
        self.in_flight = True
        if self.spans is not None:
            self.spans.comm_enter()

    def exit(self) -> None:
        self.in_flight = False
        self.seconds += time.monotonic() - self.started
        if self.spans is not None:
            self.spans.comm_exit()

    def describe(self) -> str:
        if self.name is None:
            return "no collective issued yet"
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else []
        # a heartbeat stays one small write however large the group (a dp group can hold thousands of ranks)
        shown = (str(ranks) if len(ranks) <= 8 else
                 f"[{ranks[0]}, {ranks[1]}, {ranks[2]}, ..., {ranks[-1]}] ({len(ranks)} ranks)")
        state = f"in flight for {time.monotonic() - self.started:.1f}s" if self.in_flight else "returned"
        return f"collective #{self.count} {self.name} over ranks {shown}: {state}"


def sent_bytes(op: str, ranks: int, nbytes: int) -> float:
    """Bytes one rank sends over its links for a collective of buffer size ``nbytes`` (the module doc's size)
    over ``ranks`` ranks, by the bandwidth-optimal algorithms (nccl-tests' "bus bandwidth" factors): a ring
    all-reduce sends 2(n-1)/n of the buffer, an all-gather (n-1)/n of its output, a reduce-scatter and an all-to-all
    (n-1)/n of their input (their own chunk stays), a broadcast the buffer, a send its message, a receive nothing."""
    if ranks <= 1 or op in ("recv", "send_recv batch", "barrier", "all_gather_object"):
        return 0.0
    if op == "send" or op == "broadcast":
        return float(nbytes)
    if op.startswith("all_reduce"):
        return 2.0 * (ranks - 1) / ranks * nbytes
    return (ranks - 1) / ranks * nbytes  # all_gather, reduce_scatter, all_to_all


class CommTally(OpRecorder):
    """Counts calls and bytes per (group name, op), e.g. for a dry run; forwards everything to ``inner`` (the
    watchdog's recorder) when given. ``names`` maps a process group to the name it is reported under (`Mesh.
    group_names`); other groups are "N ranks". Point-to-point messages are counted one by one ("send", "recv");
    their batches as "send_recv batch" with no bytes (they are the messages' bytes). ``sent`` holds, per key, the
    bytes this rank put on its links (`sent_bytes`)."""

    def __init__(self, names: dict[Any, str] | None = None, inner: OpRecorder | None = None) -> None:
        self.names = dict(names or {})
        self.inner = inner
        self.calls: dict[tuple[str, str], int] = {}
        self.bytes: dict[tuple[str, str], int] = {}
        self.sent: dict[tuple[str, str], float] = {}

    def name_of(self, group: Group) -> str:
        if group in self.names:
            return self.names[group]
        return "world" if group is dist.group.WORLD else f"{group_size(group)} ranks"

    def _add(self, op: str, group: Group, nbytes: int) -> None:
        key = (self.name_of(group), op)
        self.calls[key] = self.calls.get(key, 0) + 1
        self.bytes[key] = self.bytes.get(key, 0) + nbytes
        self.sent[key] = self.sent.get(key, 0.0) + sent_bytes(op, group_size(group), nbytes)

    def enter(self, name: str, group: Group, nbytes: int = 0) -> None:
        if not name.startswith("wait "):
            self._add("send_recv batch" if name == "send_recv" else name.removesuffix("_async"), group,
                      0 if name == "send_recv" else nbytes)
        if self.inner is not None:
            self.inner.enter(name, group, nbytes)

    def exit(self) -> None:
        if self.inner is not None:
            self.inner.exit()

    def message(self, kind: str, group: Group, nbytes: int) -> None:
        self._add(kind, group, nbytes)
        if self.inner is not None:
            self.inner.message(kind, group, nbytes)

    def reset(self) -> None:
        self.calls, self.bytes, self.sent = {}, {}, {}

    def rows(self) -> list[dict]:
        """[{group, op, calls, bytes, sent}] sorted by group, then op."""
        return [{"group": g, "op": op, "calls": self.calls[(g, op)], "bytes": self.bytes[(g, op)],
                 "sent": self.sent[(g, op)]} for g, op in sorted(self.calls)]

    def group_bytes(self, group_name: str) -> tuple[int, float]:
        """(buffer bytes, bytes sent) of every op counted on the group reported as ``group_name``."""
        keys = [k for k in self.calls if k[0] == group_name]
        return sum(self.bytes[k] for k in keys), sum(self.sent[k] for k in keys)


def buffer_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@contextmanager
def _recording(recorder: OpRecorder | None, name: str, group: Group, size: int = 0) -> Iterator[None]:
    if recorder is None:
        yield
        return
    recorder.enter(name, group, size)
    try:
        yield
    finally:
        recorder.exit()


def group_size(group: Group) -> int:
    return 1 if group is None else group.size()


def group_rank(group: Group) -> int:
    return 0 if group is None else group.rank()


# ----------------------------------------------------------------------------------------------- collectives


def all_reduce(tensor: torch.Tensor, group: Group, op: str = "sum",
               recorder: OpRecorder | None = None) -> torch.Tensor:
    """In place; op is sum, max, min or product. Returns ``tensor``."""
    if group_size(group) > 1:
        with _recording(recorder, f"all_reduce_{op}", group, buffer_bytes(tensor)):
            dist.all_reduce(tensor, op=_OPS[op], group=group)
    return tensor


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group: Group,
                    recorder: OpRecorder | None = None) -> torch.Tensor:
    """``output`` (size * input.shape[0], ...) receives every rank's ``input`` stacked along dim 0."""
    if group_size(group) == 1:
        return output.copy_(input)
    with _recording(recorder, "all_gather", group, buffer_bytes(output)):
        _all_gather_single(output, input.contiguous(), group=group)
    return output


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Group,
                   recorder: OpRecorder | None = None, scratch: bool = False) -> torch.Tensor:
    """Sum ``input`` over the group and keep this rank's chunk of it along dim 0 in ``output`` (which may be that
    chunk of ``input`` itself: in place). ``scratch``: the caller does not need ``input`` afterwards, so the op
    may reduce in it (`reduce_scatter_async` says why that matters on gloo)."""
    size = group_size(group)
    if size == 1:
        return output if output.data_ptr() == input.data_ptr() else output.copy_(input)
    with _recording(recorder, "reduce_scatter", group, buffer_bytes(input)):
        if scratch and input.device.type == "cpu" and input.is_contiguous():
            dist.all_reduce(input, group=group)
            _keep_chunk(output, input, size, group.rank())
        else:
            _reduce_scatter_single(output, input.contiguous(), group=group)
    return output


def _keep_chunk(output: torch.Tensor, reduced: torch.Tensor, size: int, rank: int) -> None:
    chunk = reduced.chunk(size)[rank]
    if output.data_ptr() != chunk.data_ptr():
        output.copy_(chunk)


class Pending:
    """A collective issued with ``async_op=True``. ``wait()`` blocks until it has completed, then runs the
    copy-out that some backends need (gloo's reduce-scatter below); calling it again does nothing.

    Keep the object until ``wait()``: it holds the tensors the backend is still reading or writing."""

    def __init__(self, work: Any = None, then: Callable[[], None] | None = None,
                 recorder: OpRecorder | None = None, name: str = "", group: Group = None) -> None:
        self._work, self._then = work, then
        self._recorder, self._name, self._group = recorder, name, group

    def wait(self) -> None:
        if self._work is not None:
            # The wait is where a rank blocks on its peers: recorded, so the watchdog and the straggler report
            # see it as communication, not compute.
            with _recording(self._recorder, f"wait {self._name}", self._group):
                self._work.wait()
            self._work = None
        if self._then is not None:
            then, self._then = self._then, None
            then()


def all_reduce_async(tensor: torch.Tensor, group: Group, op: str = "sum",
                     recorder: OpRecorder | None = None) -> Pending:
    """`all_reduce` issued without waiting (data-parallel buckets overlap it with backward)."""
    if group_size(group) == 1:
        return Pending()
    with _recording(recorder, f"all_reduce_{op}_async", group, buffer_bytes(tensor)):
        return Pending(dist.all_reduce(tensor, op=_OPS[op], group=group, async_op=True), None, recorder,
                       f"all_reduce_{op}", group)


def reduce_scatter_async(output: torch.Tensor, input: torch.Tensor, group: Group,
                         recorder: OpRecorder | None = None, scratch: bool = False) -> Pending:
    """`reduce_scatter` issued without waiting; ``output`` is valid after ``wait()``.

    ``scratch``: the caller does not need ``input`` afterwards (a gradient bucket whose only use after the
    reduction is this rank's chunk). On CPU (gloo) the op then all-reduces ``input`` in place and keeps the chunk:
    no memory beyond the caller's. Without it gloo's own reduce-scatter runs, which is an all-reduce of an internal
    clone of ``input`` held until ``wait()`` (ProcessGroupGloo::reduce_scatter_tensor_coalesced, torch 2.3 to at
    least 2.13): a full copy of every reduce-scatter in flight. On NCCL the native op runs either way (in place
    when ``output`` is this rank's chunk of ``input``, as NCCL documents)."""
    size = group_size(group)
    if size == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return Pending()
    with _recording(recorder, "reduce_scatter_async", group, buffer_bytes(input)):
        if scratch and input.device.type == "cpu" and input.is_contiguous():
            work = dist.all_reduce(input, group=group, async_op=True)
            return Pending(work, lambda: _keep_chunk(output, input, size, group.rank()), recorder, "reduce_scatter",
                           group)
        return Pending(_reduce_scatter_single(output, input.contiguous(), group=group, async_op=True), None,
                       recorder, "reduce_scatter", group)


def all_gather_into_async(output: torch.Tensor, input: torch.Tensor, group: Group,
                          recorder: OpRecorder | None = None, scratch: bool = False) -> Pending:
    """`all_gather_into` issued without waiting. ``input`` may be this rank's chunk of ``output`` (in place:
    NCCL documents it; gloo copies the chunk onto itself).

    ``scratch``: nothing reads ``output`` until ``wait()`` (the values it holds are being replaced). On CPU the op
    then zeroes the other ranks' chunks and all-reduces ``output`` in place, since gloo's all-gather gathers into
    a flat copy of the whole output and copies it out (a second output-sized buffer while in flight: measured
    with torch 2.13); the all-reduce moves twice the bytes and allocates nothing."""
    size = group_size(group)
    if size == 1:
        if input.data_ptr() != output.data_ptr():
            output.copy_(input)
        return Pending()
    with _recording(recorder, "all_gather_async", group, buffer_bytes(output)):
        if scratch and output.device.type == "cpu" and output.is_contiguous():
            n = input.shape[0]
            lo, hi = group.rank() * n, (group.rank() + 1) * n
            mine = output.narrow(0, lo, n)
            if mine.data_ptr() != input.data_ptr():
                mine.copy_(input)
            output.narrow(0, 0, lo).zero_()
            output.narrow(0, hi, output.shape[0] - hi).zero_()
            return Pending(dist.all_reduce(output, group=group, async_op=True), None, recorder, "all_gather", group)
        return Pending(_all_gather_single(output, input.contiguous(), group=group, async_op=True), None,
                       recorder, "all_gather", group)


def broadcast(tensor: torch.Tensor, src: int, group: Group,
              recorder: OpRecorder | None = None) -> torch.Tensor:
    """In place from global rank ``src``."""
    if group_size(group) > 1:
        with _recording(recorder, "broadcast", group, buffer_bytes(tensor)):
            dist.broadcast(tensor, src=src, group=group)
    return tensor


def send_recv(sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]],
              group: Group, recorder: OpRecorder | None = None, wait: bool = True) -> list:
    """Post all sends and receives ((tensor, peer global rank) pairs) as one batch; NCCL fuses them, which
    avoids the deadlock of two neighbours both sending first. Waits unless ``wait=False`` (then the caller
    waits on the returned works)."""
    if not sends and not recvs:
        return []
    if group is None:
        raise ValueError("send_recv needs a process group with peers (the pipeline group of a pp > 1 mesh).")
    ops = [dist.P2POp(dist.isend, t, peer, group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group) for t, peer in recvs]
    if recorder is not None:
        for kind, pairs in (("send", sends), ("recv", recvs)):
            for t, _ in pairs:
                recorder.message(kind, group, buffer_bytes(t))
    with _recording(recorder, "send_recv", group, sum(buffer_bytes(t) for t, _ in list(sends) + list(recvs))):
        works = dist.batch_isend_irecv(ops)
        if wait:
            for w in works:
                w.wait()
    return [] if wait else works


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, group: Group,
                      output_split_sizes: list[int] | None = None, input_split_sizes: list[int] | None = None,
                      recorder: OpRecorder | None = None) -> torch.Tensor:
    """Rank i's chunk j of ``input`` (along dim 0) lands as chunk i of rank j's ``output``."""
    if group_size(group) == 1:
        return output.copy_(input)
    with _recording(recorder, "all_to_all", group, buffer_bytes(input)):
        dist.all_to_all_single(output, input.contiguous(), output_split_sizes, input_split_sizes, group=group)
    return output


def all_to_all_single_async(output: torch.Tensor, input: torch.Tensor, group: Group,
                            recorder: OpRecorder | None = None) -> Pending:
    """`all_to_all_single` with equal chunks, issued without waiting: rank i's chunk j of ``input`` (dim 0) lands
    as chunk i of rank j's ``output`` once ``wait()`` returns. Both contiguous; keep ``input`` alive until then."""
    if not (input.is_contiguous() and output.is_contiguous()):
        raise ValueError("all_to_all_single_async needs contiguous tensors (a copy made here would be freed while "
                         "the backend still reads it)")
    if group_size(group) == 1:
        output.copy_(input)
        return Pending()
    with _recording(recorder, "all_to_all_async", group, buffer_bytes(input)):
        return Pending(dist.all_to_all_single(output, input, group=group, async_op=True), None, recorder,
                       "all_to_all", group)


# ------------------------------------------------------------------------ exchanges of objects and sizes
#
# Every exchange whose answer the receiving rank *reads on the host* (a Python object, a split size) goes through
# the functions of this section. Under a dry run's fake process group (torch's "fake" backend) no data moves:
# a received buffer holds whatever the allocator left there, so an unpickled object is garbage (on a GPU:
# "invalid load key") and a split size can be negative (Inductor then allocates a buffer of negative size). Here
# such a group never exchanges anything: each function answers locally with what this rank would receive in a
# balanced, uniform job (every rank sending what this one sends). Tensors that only flow on through the model
# (activations, gradients) may stay garbage: the dry run measures time and memory, not values.


def is_fake(group: Group) -> bool:
    """True for a group of the dry run's fake backend (nothing arrives from a peer)."""
    return group is not None and dist.get_backend(group) == "fake"


def all_gather_objects(obj: Any, group: Group, recorder: OpRecorder | None = None) -> list[Any]:
    """Small Python objects (timelines, reports) from every rank of ``group``, in group-rank order. Under the
    fake group: ``obj`` from every rank (a uniform job)."""
    if group_size(group) == 1:
        return [obj]
    if is_fake(group):
        return [obj] * group_size(group)
    out: list[Any] = [None] * group_size(group)
    with _recording(recorder, "all_gather_object", group):
        dist.all_gather_object(out, obj, group=group)
    return out


def gather_objects(obj: Any, group: Group, recorder: OpRecorder | None = None) -> list[Any] | None:
    """Every rank's ``obj`` on the group's rank 0, in group-rank order (None on the others). Small objects only
    (checksums, node names): O(world) on rank 0, O(1) elsewhere. Under the fake group: ``obj`` from every rank."""
    size, rank = group_size(group), group_rank(group)
    if size == 1:
        return [obj]
    if is_fake(group):
        return [obj] * size if rank == 0 else None
    out = [None] * size if rank == 0 else None
    with _recording(recorder, "gather_object", group):
        dist.gather_object(obj, out, dst=dist.get_global_rank(group, 0), group=group)
    return out


def broadcast_int(value: int, src_group_rank: int, group: Group, recorder: OpRecorder | None = None) -> int:
    """Group rank ``src_group_rank``'s ``value`` on every rank (an int64 tensor on the host: the group must take
    CPU tensors, a gloo one). Under the fake group: this rank's own value."""
    if group_size(group) == 1 or is_fake(group):
        return value
    t = torch.tensor([value], dtype=torch.int64)
    with _recording(recorder, "broadcast", group, 8):
        dist.broadcast(t, src=dist.get_global_rank(group, src_group_rank), group=group)
    return int(t.item())


def balanced_counts(total: int, shape: tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
    """``total`` rows spread as evenly as integers allow over the cells of ``shape`` (int64; the first
    ``total % cells`` cells get one more): what a rank receives when routing is balanced."""
    cells = math.prod(shape)
    flat = torch.full((cells,), total // cells, dtype=torch.int64, device=device)
    flat[:total % cells] += 1
    return flat.view(shape)


def exchange_counts(send_counts: torch.Tensor, group: Group, recorder: OpRecorder | None = None) -> torch.Tensor:
    """The expert dispatch's split sizes: ``send_counts[j, e]`` rows go to rank j's local expert e; returns
    ``recv[i, e]``, the rows rank i sends to this rank's local expert e (one all-to-all of the counts).

    Under the fake group: balanced routing, this rank's own total spread evenly over (source rank, local
    expert), as in a job whose router balances the load exactly (the dry run says so in its report)."""
    if group_size(group) == 1:
        return send_counts.clone()
    if is_fake(group):
        return balanced_counts(int(send_counts.sum()), tuple(send_counts.shape), send_counts.device)
    recv = torch.empty_like(send_counts)
    all_to_all_single(recv.view(-1), send_counts.reshape(-1), group, recorder=recorder)
    return recv


def gather_counts(counts: torch.Tensor, group: Group, recorder: OpRecorder | None = None) -> torch.Tensor:
    """Every rank's ``counts`` stacked along dim 0, in group-rank order (sizes the receiver reads on the host).
    Under the fake group: this rank's ``counts`` from every rank (a uniform job)."""
    if group_size(group) == 1:
        return counts
    if is_fake(group):
        return counts.repeat((group_size(group),) + (1,) * (counts.dim() - 1))
    return gather_along_dim(counts, 0, group, recorder)


def barrier(group: Group, recorder: OpRecorder | None = None) -> None:
    if group_size(group) > 1:
        with _recording(recorder, "barrier", group):
            dist.barrier(group=group)


# ------------------------------------------------------------------------ gathers/scatters along a dimension


def split_along_dim(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's contiguous 1/size slice of ``x`` along ``dim`` (no communication)."""
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[dim] % size:
        raise ValueError(f"cannot split dimension {dim} of length {x.shape[dim]} into {size} equal parts "
                         "(with parallel.sp the sequence length must be divisible by parallel.tp)")
    n = x.shape[dim] // size
    return x.narrow(dim, group.rank() * n, n).contiguous()


def gather_along_dim(x: torch.Tensor, dim: int, group: Group,
                     recorder: OpRecorder | None = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order). The collective stacks along dim 0, so the
    result is then moved into place with one copy, giving a contiguous tensor in the expected layout."""
    size = group_size(group)
    if size == 1:
        return x
    out = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
    all_gather_into(out, x, group, recorder)
    if dim == 0:
        return out
    out = out.view((size,) + tuple(x.shape)).movedim(0, dim)
    shape = list(x.shape)
    shape[dim] *= size
    return out.reshape(shape)


def reduce_scatter_along_dim(x: torch.Tensor, dim: int, group: Group,
                             recorder: OpRecorder | None = None) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's 1/size slice along ``dim``."""
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[dim] % size:
        raise ValueError(f"cannot reduce-scatter dimension {dim} of length {x.shape[dim]} over {size} ranks "
                         "(with parallel.sp the sequence length must be divisible by parallel.tp)")
    # Bring the rank-chunks of `dim` to the front so each rank's part is one contiguous block.
    chunks = x.unflatten(dim, (size, x.shape[dim] // size)).movedim(dim, 0).contiguous()
    out = x.new_empty(chunks.shape[1:])
    reduce_scatter(out, chunks.flatten(0, 1), group, recorder, scratch=_own_copy(chunks, x))
    return out


def _own_copy(chunks: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``contiguous()`` made ``chunks`` a new tensor (then the reduction may use it as scratch) rather than
    returning a view of the caller's ``x`` (one sequence per micro-batch, or dim 0)."""
    return chunks.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def gather_along_dim_async(x: torch.Tensor, dim: int, group: Group,
                           recorder: OpRecorder | None = None) -> Callable[[], torch.Tensor]:
    """`gather_along_dim` issued without waiting: returns a function that waits for it and returns the gathered
    tensor (call it once the work that should hide the transfer has been issued)."""
    size = group_size(group)
    if size == 1:
        return lambda: x
    buf = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
    pending = all_gather_into_async(buf, x, group, recorder)
    shape = list(x.shape)
    shape[dim] *= size

    def finish() -> torch.Tensor:
        pending.wait()
        return buf if dim == 0 else buf.view((size,) + tuple(x.shape)).movedim(0, dim).reshape(shape)

    return finish


def reduce_scatter_along_dim_async(x: torch.Tensor, dim: int, group: Group,
                                   recorder: OpRecorder | None = None) -> Callable[[], torch.Tensor]:
    """`reduce_scatter_along_dim` issued without waiting: returns a function that waits for it and returns this
    rank's summed slice."""
    size = group_size(group)
    if size == 1:
        return lambda: x
    if x.shape[dim] % size:
        raise ValueError(f"cannot reduce-scatter dimension {dim} of length {x.shape[dim]} over {size} ranks "
                         "(with parallel.sp the sequence length must be divisible by parallel.tp)")
    chunks = x.unflatten(dim, (size, x.shape[dim] // size)).movedim(dim, 0).contiguous()
    out = x.new_empty(chunks.shape[1:])
    pending = reduce_scatter_async(out, chunks.flatten(0, 1), group, recorder, scratch=_own_copy(chunks, x))
    in_flight = [chunks]  # the backend reads it until the op completes

    def finish() -> torch.Tensor:
        pending.wait()
        in_flight.clear()
        return out

    return finish
