"""Everything that must work without torch.distributed: a None group is a world of one."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megaloom.config import ConfigError
from megaloom.models import Transformer
from megaloom.parallel import borders, comm
from megaloom.parallel.grad_norm import global_grad_norm
from megaloom.parallel.launch import torchrun_command
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.random import ForkedDropout, RNGTracker
from megaloom.parallel.tensor import gather_full_params, parallelize_tensor, sync_tp_grads
from megaloom.parallel.tp_layers import ColumnParallelLinear, RowParallelLinear
from megaloom.parallel.vocab_ce import vocab_parallel_cross_entropy

from .harness import run_world
from .worlds import tiny_config


def test_collectives_without_peers_are_identities() -> None:
    x = torch.randn(2, 6, 3)
    assert comm.all_reduce(x.clone(), None).equal(x)
    assert comm.all_gather_into(torch.empty_like(x), x, None).equal(x)
    assert comm.reduce_scatter(torch.empty_like(x), x, None).equal(x)
    assert comm.all_to_all_single(torch.empty_like(x), x, None).equal(x)
    assert comm.gather_along_dim(x, 1, None) is x and comm.reduce_scatter_along_dim(x, 1, None) is x
    for fn in (borders.copy_to_tp, borders.reduce_from_tp, borders.scatter_to_seq, borders.gather_from_seq,
               borders.reduce_scatter_to_seq):
        assert fn(x, None) is x
    comm.barrier(None)
    with pytest.raises(ValueError, match="pipeline group"):
        comm.send_recv([(x, 1)], [], None)


def test_vocab_ce_without_peers_matches_cross_entropy() -> None:
    logits = torch.randn(10, 32, requires_grad=True)
    labels = torch.randint(0, 32, (10,))
    labels[3] = -100
    ref_logits = logits.detach().clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, labels, None)
    ref = F.cross_entropy(ref_logits, labels)
    loss.backward()
    ref.backward()
    assert torch.allclose(loss, ref, atol=1e-6)
    assert torch.allclose(logits.grad, ref_logits.grad, atol=1e-7)


def test_parallelize_on_a_single_mesh_changes_nothing() -> None:
    cfg = tiny_config("gpt2")
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    mesh = Mesh.single()
    assert parallelize_tensor(model, mesh, sp=True) is model
    assert isinstance(model.head, nn.Linear)
    x = torch.randint(0, 128, (2, 8))
    model(x, x).backward()
    sync_tp_grads(model, mesh)
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert torch.allclose(global_grad_norm(list(model.parameters()), mesh), norm)
    full = gather_full_params(model, mesh)
    assert all(full[n].equal(before[n]) for n in before)


def test_parallelize_twice_is_refused() -> None:
    model = Transformer(tiny_config("llama").model)
    mesh = Mesh(tp=2)  # shapes only: without a process group the collectives are identities
    parallelize_tensor(model, mesh, sp=False)
    assert model.layers[str(0)].attn.q_proj.weight.shape == (32, 64)
    with pytest.raises(ValueError, match="already tensor-parallel"):
        parallelize_tensor(model, mesh, sp=False)


def test_layers_check_their_modes() -> None:
    mesh = Mesh.single()
    lin = nn.Linear(4, 6)
    col = ColumnParallelLinear.from_linear(lin, mesh)
    x = torch.randn(3, 4)
    assert torch.allclose(col(x), lin(x)) and col.out_features == 6
    assert torch.allclose(RowParallelLinear.from_linear(lin, mesh)(x), lin(x))
    with pytest.raises(ValueError, match="input_mode"):
        ColumnParallelLinear.from_linear(lin, mesh, input_mode="scatter")
    with pytest.raises(ValueError, match="output_mode"):
        RowParallelLinear.from_linear(lin, mesh, output_mode="gather")


def test_rng_tracker_streams() -> None:
    a, b = RNGTracker({"tp": 0}), RNGTracker({"tp": 1})
    torch.manual_seed(0)
    with a.fork():
        ra = torch.rand(4)
    torch.manual_seed(0)
    with b.fork():
        rb = torch.rand(4)
    default_after = torch.rand(4)
    assert not torch.equal(ra, rb)
    torch.manual_seed(0)
    with a.fork():
        assert torch.equal(torch.rand(4), ra)  # same default state -> same forked stream
    assert torch.equal(torch.rand(4), default_after)  # the fork consumed the same draws of the default stream
    with pytest.raises(KeyError, match="unknown RNG stream"):
        with a.fork("dp"):
            pass
    drop = ForkedDropout(0.5, a).eval()
    x = torch.ones(8)
    assert drop(x) is x


def test_last_op_recorder_describes_itself() -> None:
    rec = comm.LastOpRecorder()
    assert rec.describe() == "no collective issued yet"
    rec.enter("all_reduce_sum", None)
    assert rec.in_flight and "all_reduce_sum" in rec.describe() and "in flight" in rec.describe()
    rec.exit()
    assert not rec.in_flight and rec.count == 1


class _Group:
    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


def test_comm_tally_counts_calls_and_bytes_per_group() -> None:
    tp, pp, other = _Group(2), _Group(4), _Group(3)
    inner = comm.LastOpRecorder()
    tally = comm.CommTally({tp: "tp", pp: "pp"}, inner=inner)
    tally.enter("all_reduce_sum", tp, 100)
    tally.exit()
    tally.enter("all_reduce_sum_async", tp, 50)  # an async op counts as its op; its wait is no new call
    tally.exit()
    tally.enter("wait all_reduce_sum", tp)
    tally.exit()
    tally.message("send", pp, 8)
    tally.message("recv", pp, 8)
    tally.message("recv", pp, 8)
    tally.enter("send_recv", pp, 24)  # the batch: its bytes are the messages'
    tally.exit()
    tally.enter("all_gather", other, 7)
    tally.exit()
    rows = {(r["group"], r["op"]): (r["calls"], r["bytes"]) for r in tally.rows()}
    assert rows == {("tp", "all_reduce_sum"): (2, 150), ("pp", "send"): (1, 8), ("pp", "recv"): (2, 16),
                    ("pp", "send_recv batch"): (1, 0), ("3 ranks", "all_gather"): (1, 7)}
    assert inner.count == 5 and inner.name == "all_gather" and not inner.in_flight  # forwarded to the watchdog's
    tally.reset()
    assert tally.rows() == []


def test_torchrun_command() -> None:
    cmd = torchrun_command(4, ["--config", "c.yaml", "train.steps=5"])
    assert cmd == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                   "-m", "megaloom", "train", "--config", "c.yaml", "train.steps=5"]
    cmd = torchrun_command(2, ["--nproc", "2", "--max-restarts=1", "train.steps=5"], max_restarts=3)
    assert cmd[5:] == ["2", "--max-restarts", "3", "-m", "megaloom", "train", "train.steps=5"]
    with pytest.raises(ConfigError, match="--nproc"):
        torchrun_command(0, [])


def _fail(rank: int, world: int, device: torch.device) -> None:
    raise RuntimeError(f"rank {rank} failed on purpose")


def test_harness_reraises_worker_errors() -> None:
    with pytest.raises(Exception, match="failed on purpose"):
        run_world(1, _fail)
