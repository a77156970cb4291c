"""Run one rank's list of a pipeline schedule for one training step (or one evaluation batch).

The executor walks the list: computations call the stage module's chunk forward / backward for one
micro-batch, and each run of consecutive message actions is posted as one batch of isend/irecv
(`comm.send_recv`). Every message has a shape known in advance, [micro_batch, seq_len (/ tp with sequence
parallelism), d_model] in the activation dtype, so receive buffers are allocated without a shape handshake.
Batches are not waited on when posted: a received tensor is waited for just before the computation that
consumes it, and sends complete in the background (their tensors are kept alive until then). The schedule
puts each receive in the batch where its sender sends, so data flows as soon as it exists; the checker has
proved the list deadlock-free under fully blocking semantics, which this lazier waiting cannot break.

Loss: the last stage computes each micro-batch's loss divided by the number of micro-batches, exactly as
`megaloom.step.TrainStep` accumulates gradients on one process, so the summed gradient is the global-batch
mean. ZB-H1's BI/BW use `split_backward` (input gradient first, weight gradients later, identical values).
Tied embeddings, data-parallel reduction and clipping: megaloom.parallel.data_parallel.DataParallelGrads (buckets
reduced as each chunk finishes its last backward; ZeRO 1/2) or the flat `PipelineGradientSync`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from megaloom import accelerator
from megaloom.models.documents import Documents
from megaloom.parallel import comm
from megaloom.parallel.context.layout import SequenceShard
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.pipeline.checker import check_schedule, peer_of
from megaloom.parallel.pipeline.schedules import Action, Kind, Schedule
from megaloom.parallel.pipeline.split_backward import PendingWeightGrad, backward_input
from megaloom.parallel.pipeline.stage import PipelineStage
from megaloom.parallel.pipeline.timing import TimedAction, Timeline
from megaloom.parallel.token_mean import target_weights, weighted


def _writes_weight_grads(a: Action) -> bool:
    return a.kind == Kind.B or (a.kind == Kind.BW and a.stage > 0) or (a.kind == Kind.BI and a.stage == 0)


@dataclass(eq=False)
class _Batch:
    """One posted batch of messages: wait once, before the first received tensor is used."""

    works: list
    keep: list[torch.Tensor]  # send and receive buffers must live until the batch completes
    done: bool = False

    def wait(self) -> None:
        if not self.done:
            for w in self.works:
                w.wait()
            self.done, self.works, self.keep = True, [], []

    def reap(self) -> bool:
        """Release the buffers of a batch that has completed without being waited on (a send-only batch);
        a non-blocking query. True when done."""
        if not self.done and all(w.is_completed() for w in self.works):
            self.done, self.works, self.keep = True, [], []
        return self.done


@dataclass(eq=False)
class _Msg:
    tensor: torch.Tensor
    batch: _Batch | None = None  # None: passed locally between chunks of this rank
    piece: torch.Tensor | None = None  # scatter/gather: this rank's 1/tp received, gathered into tensor on get
    gather: Callable[[torch.Tensor, torch.Tensor], None] | None = None

    @property
    def ready(self) -> bool:
        return (self.batch is None or self.batch.done) and self.piece is None

    def get(self) -> torch.Tensor:
        if self.batch is not None:
            self.batch.wait()
        if self.piece is not None:
            self.gather(self.tensor, self.piece)
            self.piece = None
        return self.tensor


@dataclass
class _StepState:
    tokens: list[torch.Tensor] = field(default_factory=list)
    labels: list[torch.Tensor] = field(default_factory=list)
    first_kwargs: list[dict] = field(default_factory=list)  # the first stage's model keywords (images) per mb
    inputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    inbox_f: dict[tuple[int, int], _Msg] = field(default_factory=dict)  # stage input, by (mb, stage)
    inbox_b: dict[tuple[int, int], _Msg] = field(default_factory=dict)  # gradient of the stage output
    input_grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # waiting for SEND_B
    weight_grads: dict[tuple[int, int], PendingWeightGrad | None] = field(default_factory=dict)
    batches: list[_Batch] = field(default_factory=list)
    loss: torch.Tensor | None = None
    weights: torch.Tensor | None = None  # per micro-batch loss factors of masked targets (token_mean)
    docs: list = field(default_factory=list)  # per micro-batch document boundaries (data.document_mask), every stage


@runtime_checkable
class SplitsItself(Protocol):
    """A batch that cuts its own micro-batches: (inputs, labels, the first stage's keyword arguments) for each
    ``micro`` rows (the image-text batch, data/image_text/batch.py: masked labels, the images for the encoder)."""

    def micro_inputs(self, micro: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, dict]]: ...


# A micro-batch of token rows -> (inputs, labels). How rows are laid out is the data's knowledge (causal rows
# [B, T + 1] shifted by one, or an objective's [B, 2, T]: data/objective.py's `inputs_and_labels`, which the trainer
# passes); the engine is given it rather than importing the data layer above it.
RowsSplit = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class PipelineExecutor:
    def __init__(self, stage: PipelineStage, schedule: Schedule, mesh: Mesh, micro_batch_size: int, seq_len: int,
                 sp: bool = False, dtype: torch.dtype | None = None,
                 autocast: Callable[[], AbstractContextManager] = contextlib.nullcontext,
                 scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None, timing: bool = False,
                 documents: Callable[[torch.Tensor], Documents] | None = None, scatter_gather: bool = False,
                 inputs_and_labels: RowsSplit | None = None) -> None:
        """``inputs_and_labels``: a micro-batch of token rows -> (inputs, labels) (`RowsSplit`; needed on the first
        and last stage, or with ``documents``, unless the batches split themselves, `SplitsItself`);
        ``autocast``: context for each forward (e.g. ``lambda: autocast_ctx(precision, device)``);
        ``scale_loss``: applied to the last stage's loss before backward (fp16 ``GradScaler.scale``);
        ``dtype``: of the activations between stages (default: the parameters'; hidden states stay in the
        parameter dtype under autocast because the residual stream adds to the fp32 embedding output);
        ``timing``: record when each action ran (synchronising the GPU around each one; for profiling);
        ``documents``: the document boundaries of a micro-batch's input tokens (data.document_mask /
        reset_positions). Every stage's blocks need them, so every stage then gets the batch and finds them from
        the tokens itself: a few integers per document, cheaper than sending them along with the activations.
        ``scatter_gather`` (tp > 1 without sp, parallel.pp_scatter_gather): Megatron-LM's scatter/gather of
        pipeline messages (Narayanan et al. 2021, section 4.1). Without sequence parallelism every tp rank of a
        stage holds the same activation and, by the tp regions' all-reduce in backward, the same input gradient;
        so each sends only its 1/tp of the flattened tensor to its peer of the next (previous) stage, and the
        receiving stage's tp ranks all-gather the pieces over their own (intra-node) links before use: the
        inter-node bytes of a message divided by tp. With sp the messages are already 1/tp (sequence-sharded)."""
        if schedule.pp != mesh.pp or schedule.vpp != stage.partition.vpp:
            raise ValueError(f"schedule for pp={schedule.pp} vpp={schedule.vpp}, but the mesh has pp={mesh.pp} and "
                             f"the stage vpp={stage.partition.vpp}")
        check_schedule(schedule)
        self.stage, self.schedule, self.mesh = stage, schedule, mesh
        self.micro, self.seq_len = micro_batch_size, seq_len
        self.autocast, self.scale_loss, self.timing = autocast, scale_loss, timing
        self.documents, self.inputs_and_labels = documents, inputs_and_labels
        self.token_mean = False  # TrainStep sets it: masked targets weigh each token once (parallel/token_mean.py)
        self.rank = mesh.pp_rank
        self.steps = schedule.steps(self.rank)
        self.last = schedule.n_stages - 1
        # Context parallelism: this rank holds seq_len / cp tokens of each sequence (its two chunks).
        self.seq_len = seq_len // mesh.cp
        self.shard = SequenceShard(mesh.cp, mesh.cp_rank) if mesh.cp > 1 else (lambda x: x)
        local_seq = self.seq_len // mesh.tp if sp and mesh.tp > 1 else self.seq_len
        self.shape = (micro_batch_size, local_seq, stage.cfg.d_model)
        numel = micro_batch_size * local_seq * stage.cfg.d_model
        self.scatter = scatter_gather and mesh.tp > 1 and not sp and numel % mesh.tp == 0
        self.dtype = dtype or next(p.dtype for p in stage.parameters() if p.is_floating_point())
        # Global ranks of this pipeline, by stage rank (the p2p peers and the loss's broadcast source).
        self.pp_ranks = next(g for g in mesh.layout(mesh.world_size, mesh.sizes, mesh.order)["pp"] if mesh.rank in g)
        self.params = [stage.chunk_parameters(c) for c in range(schedule.vpp)]
        # The step whose computation writes this rank's last weight gradients (B; BW; BI on the first stage,
        # which runs the full backward): data parallelism may start reducing gradient buckets just before it.
        writes = [i for i, st in enumerate(self.steps) if _writes_weight_grads(st[0])]
        self.last_grad_step = writes[-1] if writes else -1
        # Per chunk (interleaved stages finish at different times): step index -> the chunk whose last weight
        # gradients that step writes, so each chunk's gradient buckets start reducing as soon as it is done.
        self.chunk_done_steps: dict[int, int] = {}
        for c in range(schedule.vpp):
            mine = [i for i in writes if self.steps[i][0].stage // schedule.pp == c]
            if mine:
                self.chunk_done_steps[mine[-1]] = c
        self.events: list[TimedAction] = []
        self._t0 = 0.0
        self.peak_activations = 0  # most (micro-batch, chunk) forwards held for backward at once, last run

    # ------------------------------------------------------------------------------------------------- step

    def run(self, batch: torch.Tensor | None,
            before_last_backward: Callable[[list[torch.nn.Parameter]], None] | None = None) -> torch.Tensor:
        """One step over ``batch`` [m * micro_batch, seq_len + 1] token rows (needed on the first and last stage
        only; None elsewhere). Backward schedules leave the gradients in ``.grad``. Returns the mean loss over
        the micro-batches, on every pipeline rank (a device scalar; no host sync). ``before_last_backward`` is
        called with a chunk's parameters just before the computation that writes that chunk's last weight
        gradients, once per chunk (e.g. the gradient buckets' ``start_last_microbatch``)."""
        st = _StepState()
        m = self.schedule.microbatches
        if self.stage.has_embedding or self.stage.has_head or self.documents is not None:
            if batch is None or batch.shape[0] != m * self.micro:
                got = None if batch is None else tuple(batch.shape)
                raise ValueError(f"pipeline stage {self.rank} needs a batch of {m} x {self.micro} rows, got {got}")
            if isinstance(batch, SplitsItself):  # masked labels; the images go to the first stage (the encoder)
                st.tokens, st.labels, st.first_kwargs = (list(v) for v in zip(*batch.micro_inputs(self.micro),
                                                                                strict=True))
            else:  # token rows, or an objective's (inputs, labels) rows (data/objective.py)
                if self.inputs_and_labels is None:
                    raise ValueError("PipelineExecutor(inputs_and_labels=...) is needed for a batch of token rows")
                pairs = [self.inputs_and_labels(batch[i * self.micro:(i + 1) * self.micro]) for i in range(m)]
                st.tokens = [self.shard(x) for x, _ in pairs]
                st.labels = [self.shard(y) for _, y in pairs]
                if self.documents is not None:  # found in the whole sequence, then this cp rank's part
                    st.docs = [self.documents(x) for x, _ in pairs]
                    if self.mesh.cp > 1:
                        st.docs = [d.sharded(self.shard) for d in st.docs]
            if self.token_mean and self.stage.has_head and self.schedule.backward:
                st.weights = target_weights(st.labels, self.mesh.dp_cp_group, self.mesh.dp * self.mesh.cp,
                                            self.mesh.recorder)
        device = self.mesh.device
        st.loss = torch.zeros((), dtype=torch.float32, device=device)
        self.events = []
        self.peak_activations = 0
        self._t0 = time.perf_counter()
        grad_mode = torch.enable_grad() if self.schedule.backward else torch.no_grad()
        with grad_mode:
            for i, step in enumerate(self.steps):
                if i in self.chunk_done_steps and before_last_backward is not None:
                    before_last_backward(self.params[self.chunk_done_steps[i]])
                if step[0].is_comm:
                    self._timed("COMM", -1, -1, lambda step=step: self._post(step, st), " ".join(map(str, step)))
                else:
                    a = step[0]
                    msg = self._input_of(a, st)
                    if msg is not None and not msg.ready:
                        # Waiting for data (and gathering its pieces) is drawn as communication, not as part of
                        # the computation.
                        self._timed("COMM", -1, -1, msg.get, f"wait for the input of {a}")
                    self._timed(a.kind.value, a.microbatch, a.stage, lambda a=a: self._compute(a, st))
        for b in st.batches:
            b.wait()
        if self.mesh.pp > 1:  # the loss lives on the last stage; every rank reports it
            comm.broadcast(st.loss, src=self.pp_ranks[-1], group=self.mesh.pp_group, recorder=self.mesh.recorder)
        return st.loss

    def timeline(self) -> Timeline:
        """This rank's actions of the last `run` (with ``timing=True``), in seconds from its start."""
        ranks: list[list[TimedAction]] = [[] for _ in range(self.schedule.pp)]
        ranks[self.rank] = list(self.events)
        return Timeline(self.schedule.name, self.schedule.pp, self.schedule.vpp, self.schedule.microbatches, ranks,
                        unit="s")

    def _timed(self, kind: str, mb: int, stage: int, fn: Callable[[], None], label: str = "") -> None:
        if not self.timing:
            fn()
            return
        accelerator.synchronize(self.mesh.device)  # (nothing on CPU)
        start = time.perf_counter()
        fn()
        accelerator.synchronize(self.mesh.device)
        self.events.append(TimedAction(self.rank, kind, mb, stage, start - self._t0, time.perf_counter() - self._t0,
                                       label))

    # ----------------------------------------------------------------------------------------------- messages

    def _post(self, step: tuple[Action, ...], st: _StepState) -> None:
        sends: list[tuple[torch.Tensor, int]] = []
        recvs: list[tuple[torch.Tensor, int]] = []
        new: list[tuple[Action, torch.Tensor]] = []
        for a in step:
            peer = self.pp_ranks[peer_of(a, self.schedule.pp)]
            key = (a.microbatch, a.stage)
            if a.kind == Kind.SEND_F:
                sends.append((self._piece(st.outputs[key].detach()), peer))
                if not self.schedule.backward:
                    del st.outputs[key]
            elif a.kind == Kind.SEND_B:
                sends.append((self._piece(st.input_grads.pop(key)), peer))
            else:
                buf = torch.empty(self.shape, dtype=self.dtype, device=self.mesh.device)
                piece = torch.empty(buf.numel() // self.mesh.tp, dtype=self.dtype,
                                    device=self.mesh.device) if self.scatter else None
                recvs.append((buf if piece is None else piece, peer))
                new.append((a, buf, piece))
        works = comm.send_recv(sends, recvs, self.mesh.pp_group, self.mesh.recorder, wait=False)
        batch = _Batch(works, [t for t, _ in sends] + [t for t, _ in recvs])
        # Sends are never waited on mid-step; drop finished ones so their tensors are freed as they complete.
        st.batches = [b for b in st.batches if not b.reap()] + [batch]
        for a, buf, piece in new:
            inbox = st.inbox_f if a.kind == Kind.RECV_F else st.inbox_b
            inbox[(a.microbatch, a.stage)] = _Msg(buf, batch, piece, self._gather if piece is not None else None)

    def _piece(self, t: torch.Tensor) -> torch.Tensor:
        """What this rank sends of a message: the whole tensor, or with scatter/gather its tp rank's 1/tp (a view
        of the flattened tensor, kept alive by the batch until sent)."""
        if not self.scatter:
            return t
        return t.contiguous().view(-1).chunk(self.mesh.tp)[self.mesh.tp_rank]

    def _gather(self, full: torch.Tensor, piece: torch.Tensor) -> None:
        comm.all_gather_into(full.view(-1), piece, self.mesh.tp_group, self.mesh.recorder)

    # ------------------------------------------------------------------------------------------- computation

    @staticmethod
    def _input_of(a: Action, st: _StepState) -> _Msg | None:
        if a.kind == Kind.F:
            return st.inbox_f.get((a.microbatch, a.stage))
        if a.kind in (Kind.B, Kind.BI):
            return st.inbox_b.get((a.microbatch, a.stage))
        return None

    def _compute(self, a: Action, st: _StepState) -> None:
        if a.kind == Kind.F:
            self._forward(a.microbatch, a.stage, st)
        elif a.kind == Kind.BW:
            pending = st.weight_grads.pop((a.microbatch, a.stage))
            if pending is not None:
                pending.run()
        else:
            self._backward(a.microbatch, a.stage, st, split=a.kind == Kind.BI)

    def _forward(self, mb: int, s: int, st: _StepState) -> None:
        chunk = s // self.schedule.pp
        if s == 0:
            x = st.tokens[mb]
        else:
            x = st.inbox_f.pop((mb, s)).get()
            if self.schedule.backward:
                x = x.detach().requires_grad_()
        kwargs = st.first_kwargs[mb] if s == 0 and st.first_kwargs else {}
        if st.docs:
            kwargs = {**kwargs, "docs": st.docs[mb]}
        with self.autocast():
            out = self.stage(x, chunk, st.labels[mb] if s == self.last else None, seq_len=self.seq_len, **kwargs)
        if s == self.last:
            # as TrainStep: mean of equal-size micro-batch means, or each target once (token_mean)
            loss = out / self.schedule.microbatches if st.weights is None else weighted(out, st.weights[mb])
            st.loss += loss.detach().float()
            out = self.scale_loss(loss) if self.scale_loss is not None else loss
        elif tuple(out.shape) != self.shape or out.dtype != self.dtype:
            raise RuntimeError(f"stage {s} produced {tuple(out.shape)} {out.dtype}, but the pipeline sends "
                               f"{self.shape} {self.dtype} (pass dtype= to the executor if activations changed "
                               "dtype)")
        if self.schedule.backward:
            st.inputs[(mb, s)] = x
            self.peak_activations = max(self.peak_activations, len(st.inputs))
        if s != self.last and (self.schedule.backward or self.schedule.rank_of(s + 1) != self.rank):
            st.outputs[(mb, s)] = out
        if s != self.last and self.schedule.rank_of(s + 1) == self.rank:  # next chunk on this rank (pp == 1)
            st.inbox_f[(mb, s + 1)] = _Msg(out.detach())
        elif s == self.last and self.schedule.backward:
            st.outputs[(mb, s)] = out

    def _backward(self, mb: int, s: int, st: _StepState, split: bool) -> None:
        x, out = st.inputs.pop((mb, s)), st.outputs.pop((mb, s))
        grad = None if s == self.last else st.inbox_b.pop((mb, s)).get()
        if split and s > 0:
            dx, st.weight_grads[(mb, s)] = backward_input(out, grad, x, self.params[s // self.schedule.pp])
        else:
            # A full backward; for BI on the first stage too: its input is tokens, so there is no input gradient
            # to hurry and nothing is gained by deferring the weights.
            torch.autograd.backward(out, grad)
            dx = x.grad if s > 0 else None
            if split:
                st.weight_grads[(mb, s)] = None
        if s == 0:
            return
        if self.schedule.rank_of(s - 1) == self.rank:
            st.inbox_b[(mb, s - 1)] = _Msg(dx)
        else:
            st.input_grads[(mb, s)] = dx
