"""What the spawned ranks run: one suite per world, each returning a dict of measurements per rank.

The tests (test_*_world.py) start each world once and assert on these measurements, so every check here
computes numbers instead of asserting (an assertion inside a rank would only show one rank's view).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megaloom.config import Config, load_config
from megaloom.data.objective import inputs_and_labels, objective_kwargs
from megaloom.models import Transformer, apply_recompute
from megaloom.models.documents import Documents
from megaloom.models.registry import get_family
from megaloom.parallel import borders, comm
from megaloom.parallel.layout import layout_of
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.random import RNGTracker, dropout_seed
from megaloom.parallel.tensor import (
    gather_full_grads,
    gather_full_params,
    gather_vocab_logits,
    parallelize_tensor,
    sync_tp_grads,
    vocab_parallel_cross_entropy,
)

from .grad_compare import first_step_grads
from .lora_setup import base_changed, base_params, freeze_base, randomize_adapters, with_lora

VOCAB, SEQ, BATCH = 128, 16, 2
N_LAYERS = 2
ENCODER_LABELS = 4  # predicted positions per row of an encoder's batch (the rest -100)
T5_TOKENS = 24  # tokens per span-corruption row


BERT_SOP = "bert-sop"  # a case name: bert with model.sentence_order=true (segments + order labels in the rows)
MLA = "mla"  # a case name: llama with multi-head latent attention (query compression, v narrower than q/k)
MLA_KEYS = ["model.attention=mla", "model.q_lora_rank=16", "model.kv_lora_rank=24", "model.qk_nope_head_dim=16",
            "model.qk_rope_head_dim=8", "model.v_head_dim=12"]


UNTIED = "llama-untied"  # a case name: llama whose head has its own weight (the token embedding's gradient fuses)
MTP = "mtp"  # a case name: the latent-attention llama with two multi-token-prediction modules


def family_arch(arch: str) -> str:
    return {BERT_SOP: "bert", MLA: "llama", MTP: "llama", UNTIED: "llama"}.get(arch, arch)


def kv_heads(arch: str) -> int:
    """The case's model.n_kv_heads: grouped-query (2) for decoders, all heads for encoders and latent attention."""
    return 0 if arch in (MLA, MTP) else 4 if is_encoder(arch) else 2


def arch_keys(arch: str) -> list[str]:
    """Config keys a case name adds to its family's (latent attention's shape, multi-token prediction)."""
    return {MLA: MLA_KEYS, MTP: [*MLA_KEYS, "model.mtp_depth=2"]}.get(arch, [])


def is_encoder(arch: str) -> bool:
    """A family trained by an objective of its own (BERT's masked LM) rather than next-token prediction."""
    return get_family(family_arch(arch)).objective is not None


class _StandInTokenizer:
    """What an objective reads of a tokenizer: the vocabulary (half the model's; the objective's own ids above)."""

    vocab_size, eod_id = VOCAB // 2, 0


def token_rows(gen: torch.Generator, rows: int, arch: str = "llama") -> torch.Tensor:
    """Random training rows for ``arch``: [rows, SEQ + 1] tokens (shifted into inputs and labels), or for an
    encoder [rows, 2, SEQ] (inputs, labels) as its objective makes them: labels -100 except ENCODER_LABELS
    positions per row. The same count in every row, so that a mean over micro-batches is the mean over tokens
    whatever the micro-batching."""
    if not is_encoder(arch):
        return torch.randint(0, VOCAB, (rows, SEQ + 1), generator=gen)
    if arch == "t5":  # its own objective's rows (span corruption: the same label count in every row by design)
        obj = get_family(arch).objective.build(tiny_config(arch), _StandInTokenizer())
        # 24 tokens: encoder 22 and decoder 6 positions, both divisible by tp=2 for sequence parallelism
        tokens = torch.randint(1, VOCAB // 2, (rows, T5_TOKENS + 1), generator=gen).numpy()
        return torch.stack([torch.from_numpy(obj.sample(t, i, "train")) for i, t in enumerate(tokens)])
    x = torch.randint(0, VOCAB, (rows, SEQ), generator=gen)
    y = torch.full_like(x, -100)
    for r in range(rows):
        at = torch.randperm(SEQ, generator=gen)[:ENCODER_LABELS]
        y[r, at] = torch.randint(0, VOCAB, (ENCODER_LABELS,), generator=gen)
    if arch != BERT_SOP:
        return torch.stack([x, y], dim=1)
    # sentence-order rows: segment 1 from a random split on, and an order label per row (repeated along it)
    split = torch.randint(2, SEQ - 1, (rows, 1), generator=gen)
    segments = (torch.arange(SEQ) >= split).long()
    order = torch.randint(0, 2, (rows, 1), generator=gen).expand(rows, SEQ)
    return torch.stack([x, y, segments, order], dim=1)


def tiny_config(arch: str = "llama", tp: int = 1, pp: int = 1, ep: int = 1, sp: bool = False,
                tie: bool = True, dropout: float = 0.0, world: int = 1, extra: tuple[str, ...] = ()) -> Config:
    """``extra``: more overrides, last (e.g. model.head_dim)."""
    dp = world // (tp * pp)
    return load_config(None, [
        f"model.arch={family_arch(arch)}", f"model.sentence_order={arch == BERT_SOP}", f"model.vocab_size={VOCAB}",
        "model.d_model=64", f"model.n_layers={N_LAYERS}",
        "model.n_heads=4", f"model.n_kv_heads={kv_heads(arch)}", "model.ffn_dim=128",
        f"model.max_seq_len={SEQ}", f"model.tie_embeddings={tie and arch != UNTIED}", f"model.dropout={dropout}",
        f"train.seq_len={SEQ}",
        f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.ep={ep}", f"parallel.sp={sp}",
        "train.micro_batch_size=1", f"train.global_batch_size={max(dp, 1)}", *arch_keys(arch), *extra])


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


# ------------------------------------------------------------------------------------------------- mesh


def check_mesh(world: int, rank: int, device: torch.device, tp: int, pp: int, ep: int) -> dict:
    """Build a mesh and report the members of each of this rank's groups as torch.distributed sees them."""
    mesh = Mesh.build(tiny_config(tp=tp, pp=pp, ep=ep, world=world), world, rank, device)
    groups = {k: dist.get_process_group_ranks(getattr(mesh, f"{k}_group"))
              for k in ("tp", "cp", "dp", "pp", "dp_cp", "ep", "edp")}
    ranks = dict(tp=mesh.tp_rank, pp=mesh.pp_rank, dp=mesh.dp_rank, cp=mesh.cp_rank, ep=mesh.ep_rank)
    group_ranks = {k: dist.get_rank(getattr(mesh, f"{k}_group")) for k in ("tp", "pp", "dp", "cp")}
    # Point-to-point around the pipeline ring, through the mesh's neighbours.
    out = torch.full((3,), float(rank), device=device)
    got = torch.empty(3, device=device)
    if mesh.pp > 1:
        comm.send_recv([(out, mesh.pp_next)], [(got, mesh.pp_prev)], mesh.pp_group)
    return dict(groups=groups, ranks=ranks, group_ranks=group_ranks, pp_prev=mesh.pp_prev,
                pp_next=mesh.pp_next, received=got[0].item() if mesh.pp > 1 else None,
                init_seconds=mesh.init_seconds, backend=dist.get_backend(), first=mesh.is_first_stage,
                last=mesh.is_last_stage, sizes=mesh.sizes)


def check_collectives(mesh: Mesh) -> dict:
    """broadcast, all_to_all, reduce_scatter, barrier and the last-op recorder on the tp group."""
    g, size, r, dev = mesh.tp_group, mesh.tp, mesh.tp_rank, mesh.device
    rec = comm.LastOpRecorder()
    res: dict = {}
    b = torch.full((2,), float(r), device=dev)
    comm.broadcast(b, src=dist.get_process_group_ranks(g)[-1], group=g, recorder=rec)
    res["broadcast"] = b.tolist()
    a2a_in = torch.arange(size, device=dev, dtype=torch.float32) + 10 * r  # element j goes to rank j
    a2a_out = torch.empty_like(a2a_in)
    comm.all_to_all_single(a2a_out, a2a_in, g, recorder=rec)
    res["all_to_all"] = a2a_out.tolist()  # rank j receives 10*i + j from each rank i
    rs_in = torch.arange(2 * size, device=dev, dtype=torch.float32) * (r + 1)
    rs_out = torch.empty(2, device=dev)
    comm.reduce_scatter(rs_out, rs_in, g, recorder=rec)
    res["reduce_scatter"] = rs_out.tolist()
    expected_in = torch.arange(2 * size, dtype=torch.float32) * (r + 1)
    res["rs_input_intact"] = rs_in.tolist() == expected_in.tolist()
    comm.barrier(g, recorder=rec)
    res["recorder"] = (rec.name, rec.count, rec.in_flight)
    return res


# ---------------------------------------------------------------------------------- tensor-parallel regions


def check_regions(mesh: Mesh) -> dict[str, float]:
    """Forward and backward of the five region borders against the sums they stand for."""
    g, size, r, dev = mesh.tp_group, mesh.tp, mesh.tp_rank, mesh.device
    gen = torch.Generator().manual_seed(0)
    errs: dict[str, float] = {}
    for batch in (1, 2):  # batch 1 makes the reduce-scatter input contiguous without a copy: must not alias
        t_local, d = 3, 5
        x = torch.randn(batch, t_local * size, d, generator=gen).to(dev)  # the same on every rank
        w = torch.randn(size, batch, t_local * size, d, generator=gen).to(dev)  # w[k]: rank k's weights
        sl = slice(r * t_local, (r + 1) * t_local)
        per_rank_slices = torch.cat([w[k][:, k * t_local:(k + 1) * t_local] for k in range(size)], dim=1)

        xs = x[:, sl].clone().requires_grad_()
        y = borders.gather_from_seq(xs, g)
        (y * w[r]).sum().backward()
        errs[f"gather_fwd{batch}"] = _err(y, x)
        errs[f"gather_bwd{batch}"] = _err(xs.grad, w.sum(0)[:, sl])

        z = x.clone().requires_grad_()
        y = borders.reduce_scatter_to_seq(z * (r + 1), g)
        (y * w[r][:, sl]).sum().backward()
        errs[f"rs_fwd{batch}"] = _err(y, x[:, sl] * sum(range(1, size + 1)))
        errs[f"rs_bwd{batch}"] = _err(z.grad, per_rank_slices * (r + 1))

        z = x.clone().requires_grad_()
        y = borders.scatter_to_seq(z, g)
        (y * w[r][:, sl]).sum().backward()
        errs[f"scatter_fwd{batch}"] = _err(y, x[:, sl])
        errs[f"scatter_bwd{batch}"] = _err(z.grad, per_rank_slices)

        z = x.clone().requires_grad_()
        y = borders.copy_to_tp(z, g)
        (y * w[r]).sum().backward()
        errs[f"copy_fwd{batch}"] = _err(y, x)
        errs[f"copy_bwd{batch}"] = _err(z.grad, w.sum(0))

        z = x.clone().requires_grad_()
        y = borders.reduce_from_tp(z * (r + 1), g)
        (y * w[r]).sum().backward()
        errs[f"reduce_fwd{batch}"] = _err(y, x * sum(range(1, size + 1)))
        errs[f"reduce_bwd{batch}"] = _err(z.grad, w[r] * (r + 1))

        # A residual next to the region: its gradient must not be disturbed by the in-place collectives.
        z = x.clone().requires_grad_()
        y = z + borders.copy_to_tp(z, g)
        y.sum().backward()
        errs[f"residual_bwd{batch}"] = _err(z.grad, torch.full_like(x, 1.0 + size))
    return errs


def check_vocab_ce(mesh: Mesh) -> dict[str, float]:
    """Vocab-parallel CE against F.cross_entropy on the full logits; 8 padded rows are never targets."""
    g, size, r, dev = mesh.tp_group, mesh.tp, mesh.tp_rank, mesh.device
    gen = torch.Generator().manual_seed(1)
    n, real_vocab = 24, VOCAB - 8
    logits = (torch.randn(n, VOCAB, generator=gen) * 4).to(dev)
    labels = torch.randint(0, real_vocab, (n,), generator=gen).to(dev)
    labels[::5] = -100  # ignored positions
    v = VOCAB // size
    sl = slice(r * v, (r + 1) * v)
    errs: dict[str, float] = {}

    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full, labels)
    ref.backward()
    local = logits[:, sl].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, labels, g)
    loss.backward()
    errs["loss"] = abs(loss.item() - ref.item())
    errs["grad"] = _err(comm.gather_along_dim(local.grad, 1, g), full.grad)

    # [B, T, V/tp] logits, as the model produces them, and a second backward scale.
    local3 = logits[:, sl].reshape(2, n // 2, v).clone().requires_grad_()
    loss3 = vocab_parallel_cross_entropy(local3, labels.view(2, n // 2), g)
    (loss3 * 3).backward()
    errs["loss_3d"] = abs(loss3.item() - ref.item())
    errs["grad_3d"] = _err(comm.gather_along_dim(local3.grad.reshape(n, v), 1, g), full.grad * 3)

    # bf16 logits: the math is fp32, the loss comes back fp32 and the gradient in bf16.
    lb = logits.bfloat16()
    local_b = lb[:, sl].clone().requires_grad_()
    loss_b = vocab_parallel_cross_entropy(local_b, labels, g)
    loss_b.backward()
    errs["loss_bf16"] = abs(loss_b.item() - F.cross_entropy(lb.float(), labels).item())
    errs["dtypes_ok"] = float(loss_b.dtype == torch.float32 and local_b.grad.dtype == torch.bfloat16)
    return errs


def check_rng(mesh: Mesh) -> dict:
    """Forked streams per rank, the default stream, and replay of a fork after restoring the RNG state."""
    torch.manual_seed(dropout_seed(5, mesh))
    tracker = RNGTracker.for_mesh(mesh)
    with tracker.fork("tp"):
        forked = torch.rand(6)
    default = torch.rand(6)
    state = torch.get_rng_state()
    with tracker.fork("tp"):
        first = torch.rand(6)
    torch.set_rng_state(state)
    with tracker.fork("tp"):
        replay = torch.rand(6)
    return dict(forked=forked, default=default, replay_err=_err(first, replay), tp_rank=mesh.tp_rank,
                dp_rank=mesh.dp_rank)


# ---------------------------------------------------------------------------------------------------- parity


def parity_case(mesh: Mesh, arch: str, sp: bool, tie: bool = True, steps: int = 10, docs: str = "",
                async_tp: bool = False, compiled: bool = False, lora: bool = False,
                extra: tuple[str, ...] = (), overlap: bool = False, backend: str = "aot_eager") -> dict:
    """Train the same model in this process (reference) and tensor-parallel for `steps` AdamW steps.
    `docs`: "mask" or "mask+reset": packed documents (token 0 ends one) kept apart, positions restarting.
    `async_tp`: the sp borders as collective matmuls (ring steps); the first step's tp ops are counted.
    `overlap`: the compiled blocks' borders in the forms Inductor's micro-pipeline TP pass fuses (tp_overlap).
    `compiled`: every block of the tensor-parallel model compiled as train.compile does (AOTAutograd with the
    eager backend: forward and backward graphs traced and partitioned, no C++ compiler needed); the graph
    breaks and graphs compiled are counted (the region borders trace as functional collectives).
    `lora`: LoRA adapters on every linear of the blocks (B non-zero), the base frozen as the trainer freezes it;
    only the adapters train, and the base must stay bit-identical. `extra`: more config overrides (model.head_dim:
    heads wider than d_model / n_heads)."""
    cfg = tiny_config(arch, tp=mesh.tp, sp=sp, tie=tie, world=mesh.world_size, extra=extra)
    cfg = with_lora(cfg) if lora else cfg
    torch.manual_seed(1234)
    ref = get_family(cfg.model.arch).build(cfg.model).to(mesh.device)
    if lora:
        randomize_adapters(ref)
    model = parallelize_tensor(copy.deepcopy(ref), mesh, sp, async_tp=async_tp, overlap=overlap)
    if lora:
        freeze_base(ref, cfg)
        freeze_base(model, cfg)  # after the split, as the trainer does (the shards are new Parameters)
        base_before = base_params(model)
    if compiled:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        for layer in model.layers.values():
            layer.compile(backend=backend)
    tally = comm.CommTally({mesh.tp_group: "tp"})
    # eps 1e-6, not 1e-8: a gradient that is zero in exact arithmetic (gpt2's key bias: softmax ignores a shift
    # shared by all keys) is rounding noise of ~1e-12 on both sides, which Adam with eps 1e-8 turns into steps of
    # up to lr; the weights would then differ by float noise x 1e9 without anything being wrong.
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-6)
    gen = torch.Generator().manual_seed(99)
    batches = [token_rows(gen, BATCH, arch).to(mesh.device) for _ in range(steps)]
    kw: Callable[[torch.Tensor], dict] = lambda x: {}  # noqa: E731
    if docs:
        for b in batches:  # documents of varied lengths in every row
            b[:, SEQ // 5::SEQ // 3] = 0
            b[1:, 3] = 0
        kw = lambda x: {"docs": Documents.from_tokens(x, 0, reset_positions="reset" in docs)}  # noqa: E731
    out: dict = dict(loss_ref=[], loss=[])
    for step, batch in enumerate(batches):
        x, y = inputs_and_labels(batch)
        extra = kw(x) | objective_kwargs(batch)  # BERT's sentence order: segment ids and order labels
        loss_ref = ref(x, y, **extra)
        loss_ref.backward()
        if step == 0:
            mesh.recorder = tally
        loss = model(x, y, **extra)
        loss.backward()
        if step == 0:
            mesh.recorder = comm.NullRecorder()
            out["tp_ops"] = {op: n for (group, op), n in tally.calls.items() if group == "tp"}
        if step == 0:  # gradients as produced by backward, then after the tp sync (what the optimizer sees)
            raw = gather_full_grads(model, mesh, synced=False)
        sync_tp_grads(model, mesh)
        if step == 0:
            out.update(first_step_grads(model, ref, mesh, raw))
            full = gather_full_params(model, mesh)
            out["numel"] = {n: (p.numel(), full[n].numel(), layout_of(p).tp_dim, layout_of(p).tp_replicas)
                            for n, p in model.named_parameters()}
            out["tied"] = model.head.weight is model.tok_emb.weight
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        out["loss_ref"].append(loss_ref.item())
        out["loss"].append(loss.item())
    if compiled:
        counters = torch._dynamo.utils.counters
        out["graph_breaks"] = sum(counters["graph_break"].values())
        out["graphs"] = counters["stats"]["unique_graphs"]
    if lora:
        out["base_changed"] = base_changed(model, base_before)
        out["adapters_trained"] = all(not torch.equal(p, base_before.get(n, torch.zeros(0))) for n, p in
                                      model.named_parameters() if p.requires_grad)
    final = gather_full_params(model, mesh)
    errs = {n: _err(final[n], p) for n, p in ref.named_parameters()}
    out["param_err"], out["param_err_at"] = max((e, n) for n, e in errs.items())
    # Generation path: logits without labels are the local vocabulary shard. Compared with the single model
    # holding the same (gathered) weights: Adam's magnification of last-bit gradient differences (an untied
    # head's rarely seen rows) must not be mistaken for a wrong path.
    with torch.no_grad():
        x = inputs_and_labels(batches[0])[0]
        local_logits = model(x)
        ref.load_state_dict({**ref.state_dict(), **final})
        out["logits_err"] = _err(gather_vocab_logits(local_logits, mesh.tp_group), ref(x))
    return out


def compiled_block_saves(block, x: torch.Tensor, rope, lean: bool) -> tuple[int, list, int]:
    """What ``block`` compiled (Inductor, bf16 autocast, train.recompute_casts=``lean``) saves for backward of one
    forward and backward on ``x``: (activation bytes, every saved (shape, dtype), graphs compiled). Activation
    bytes leave out the parameters and their bf16 copies, which the memory plan counts apart."""
    from megaloom.training.compile_saves import set_lean_saves

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    set_lean_saves(lean)
    saved: list[tuple[tuple[int, ...], torch.dtype]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(t.shape), t.dtype))
        return t

    try:
        compiled = torch.compile(block)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = compiled(x, rope)
        out.float().square().mean().backward()
    finally:
        set_lean_saves(False)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        torch._dynamo.reset()
    weights = {tuple(p.shape) for p in block.parameters()}
    weights |= {s[::-1] for s in weights}
    measured = sum(torch.Size(s).numel() * d.itemsize for s, d in saved  # not parameters, nor their bf16 copies
                   if not (d == torch.float32 and s in weights) and not (d == torch.bfloat16 and s in weights
                                                                          and len(s) == 2))
    return measured, saved, graphs


def compiled_saves_case(mesh: Mesh, sp: bool, lean: bool) -> dict:
    """What a compiled tensor-parallel block saves for backward under bf16 autocast (Inductor, as train.compile
    runs it; saved-tensor hooks), against the memory plan's compiled save-set for tp > 1: the activation bytes
    (neither the resident fp32 parameters nor their bf16 copies, which the plan counts apart)."""
    from megaloom.models.transformer import build_on_device
    from megaloom.planning.memory_activations import block_activation_bytes

    over = ["model.preset=mixtral-tiny", "model.vocab_size=512", "model.moe_every=0", "model.d_model=128",
            "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=352", "train.seq_len=40", "model.max_seq_len=40",
            f"parallel.tp={mesh.tp}", f"parallel.sp={sp}", "train.micro_batch_size=3", "train.global_batch_size=3"]
    cfg = load_config(None, over)
    torch.manual_seed(0)
    model = parallelize_tensor(build_on_device(cfg.model, torch.device("cpu")), mesh, sp)
    block = model.layers["0"]
    x = torch.randn(3, 40 // mesh.tp if sp else 40, 128, requires_grad=True)
    measured, saved, _ = compiled_block_saves(block, x, model.rope(40), lean)
    plan_cfg = load_config(None, over + ["train.compile=true", f"train.recompute_casts={str(lean).lower()}",
                                         "train.precision=bf16"])
    planned = block_activation_bytes(plan_cfg, tokens=120, batch=3, tp=mesh.tp, sp=sp, device="cuda",
                                     attention="flash")
    return {"measured": measured, "planned": sum(planned.values()), "saved": saved, "plan": planned}


def decode_case(mesh: Mesh, arch: str) -> float:
    """Incremental decoding with KV caches (the generation path, sp off): max logit error vs reference."""
    cfg = tiny_config(arch, tp=mesh.tp, world=mesh.world_size)
    torch.manual_seed(1234)
    ref = Transformer(cfg.model).to(mesh.device).eval()
    model = parallelize_tensor(copy.deepcopy(ref), mesh, sp=False).eval()
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (BATCH, 5), generator=gen).to(mesh.device)
    caches_ref, caches = ref.new_caches(BATCH, SEQ), model.new_caches(BATCH, SEQ)
    err, pos = 0.0, 0
    with torch.no_grad():
        for _ in range(4):
            expected = ref(tokens, caches=caches_ref, pos=pos)
            got = gather_vocab_logits(model(tokens, caches=caches, pos=pos), mesh.tp_group)
            err = max(err, _err(got, expected))
            pos += tokens.shape[1]
            tokens = expected[:, -1:].argmax(-1)
    return err


def dropout_case(mesh: Mesh, sp: bool) -> dict:
    """With dropout: replicated weights get equal gradients on all tp ranks (masks agree where they must),
    and recomputation replays the same masks (gradients equal to the run without it)."""
    cfg = tiny_config("gpt2", tp=mesh.tp, sp=sp, dropout=0.2, world=mesh.world_size)
    torch.manual_seed(1234)
    model = parallelize_tensor(Transformer(cfg.model).to(mesh.device), mesh, sp)
    model.train()
    gen = torch.Generator().manual_seed(3)
    batch = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen).to(mesh.device)

    def grads(mode: str) -> dict[str, torch.Tensor]:
        apply_recompute(model, mode)
        torch.manual_seed(dropout_seed(11, mesh))
        model(batch[:, :-1], batch[:, 1:]).backward()
        sync_tp_grads(model, mesh)
        out = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return out

    plain = grads("none")
    replay = {mode: max(_err(g, plain[n]) for n, g in grads(mode).items()) for mode in ("selective", "full")}
    params = dict(model.named_parameters())
    replicated = {n: g for n, g in plain.items() if layout_of(params[n]).tp_dim is None}
    return dict(replicated=replicated, replay=replay)


# ---------------------------------------------------------------------------------------------------- suites

from megaloom.parallel.pipeline.stage import build_embedding_groups  # noqa: E402

from .llava_worlds import llava_parity_case, llava_pipeline_case, llava_pipeline_frozen_case  # noqa: E402
from .sp_checks import check_gathered_linears, step_bytes  # noqa: E402  (they import this module's helpers)


def suite_world4(rank: int, world: int, device: torch.device) -> dict:
    res: dict = {}
    res["mesh_tp2_ep2"] = check_mesh(world, rank, device, tp=2, pp=1, ep=2)
    res["mesh_pp2_tp2"] = check_mesh(world, rank, device, tp=2, pp=2, ep=1)
    res["mesh_dp4_ep2"] = check_mesh(world, rank, device, tp=1, pp=1, ep=2)
    mesh22 = Mesh.build(tiny_config(tp=2, world=world), world, rank, device)
    res["rng"] = check_rng(mesh22)
    mesh = Mesh.build(tiny_config(tp=4, world=world), world, rank, device)
    res["mesh_tp4"] = dict(init_seconds=mesh.init_seconds)
    res["collectives"] = check_collectives(mesh)
    res["regions"] = check_regions(mesh)
    res["vocab_ce"] = check_vocab_ce(mesh)
    for arch in ("llama", "gpt2"):
        for sp in (False, True):
            res[f"parity-{arch}-tp4-sp{int(sp)}"] = parity_case(mesh, arch, sp)
    res["parity-llama-tp4-sp1-untied"] = parity_case(mesh, "llama", True, tie=False, steps=3)
    # Collective matmuls around a ring of 4 (biases: gpt2; untied head: its own gather as ring steps).
    res["parity-llama-tp4-sp1-async"] = parity_case(mesh, "llama", True, steps=3, async_tp=True)
    res["parity-gpt2-tp4-sp1-async-untied"] = parity_case(mesh, "gpt2", True, tie=False, steps=3, async_tp=True)
    # QK-norm with each KV head replicated on two ranks: k_norm's gradient is partial over heads and replicas.
    res["parity-qwen3-tp4-sp1"] = parity_case(mesh, "qwen3", True)
    # LoRA with each KV head replicated on two ranks: k/v's B rows replicated with their head, summed like it.
    res["parity-llama-tp4-sp1-lora"] = parity_case(mesh, "llama", True, steps=3, lora=True)
    res["decode"] = {arch: decode_case(mesh, arch) for arch in ("llama", "gpt2")}
    res["gathered_linears"] = check_gathered_linears(mesh)
    for sp in (False, True):
        res[f"dropout-sp{int(sp)}"] = dropout_case(mesh, sp)
    return res


def group_path_case(mesh: Mesh) -> dict:
    """How `Mesh.build` made its groups (split of a bound world, or new groups), what the one predicate said, and,
    where it said no, torch's own refusal of a split in this world (so the predicate cannot drift from torch)."""
    from megaloom.parallel.groups import can_split

    refused = ""
    if not can_split():
        try:
            dist.split_group(split_ranks=[[r] for r in range(dist.get_world_size())])
        except Exception as e:  # RuntimeError on an unbound CPU world; torch 2.11 bound to a GPU: a pickling error
            refused = f"{type(e).__name__}: {e}"
    return dict(paths=dict(mesh.group_paths), calls=mesh.group_calls, can_split=can_split(), refused=refused,
                bound=str(dist.group.WORLD.bound_device_id))


def suite_world2(rank: int, world: int, device: torch.device) -> dict:
    res: dict = {}
    mesh = Mesh.build(tiny_config(tp=2, world=world), world, rank, device)
    res["group_paths"] = group_path_case(mesh)
    res["regions"] = check_regions(mesh)
    res["vocab_ce"] = check_vocab_ce(mesh)
    res["collectives"] = check_collectives(mesh)
    for arch in ("llama", "gpt2", "qwen3"):
        for sp in (False, True):
            res[f"parity-{arch}-tp2-sp{int(sp)}"] = parity_case(mesh, arch, sp)
    res["parity-gpt2-tp2-sp0-untied"] = parity_case(mesh, "gpt2", False, tie=False, steps=3)
    for sp in (False, True):  # the encoder: bidirectional, post-norm, segment + embedding norm, MLM head and bias
        res[f"parity-bert-tp2-sp{int(sp)}"] = parity_case(mesh, "bert", sp)
        # the encoder-decoder: cross-attention over the encoder's output, bias tables split by heads
        res[f"parity-t5-tp2-sp{int(sp)}"] = parity_case(mesh, "t5", sp)
        # sentence order: segment ids sliced to the sp shard, the pooler's [CLS] gathered from tp rank 0's shard
        res[f"parity-bert-sop-tp2-sp{int(sp)}"] = parity_case(mesh, BERT_SOP, sp)
    res["parity-llama-tp2-sp1-docs"] = parity_case(mesh, "llama", True, steps=3, docs="mask")
    res["parity-gpt2-tp2-sp1-docs-reset"] = parity_case(mesh, "gpt2", True, steps=3, docs="mask+reset")
    res["parity-qwen3-tp2-sp1-async"] = parity_case(mesh, "qwen3", True, steps=3, async_tp=True)
    for sp in (False, True):  # LoRA: adapters split like their base layers, the base frozen
        res[f"parity-llama-tp2-sp{int(sp)}-lora"] = parity_case(mesh, "llama", sp, steps=3, lora=True)
    # model.head_dim: 4 heads of 24 over d_model 64 (Qwen3-0.6B's kind), the q/k/v/o shards and QK-norm of 24; and
    # one KV head replicated over both tp ranks (its rows picked by head_dim)
    res["parity-qwen3-tp2-sp1-hd24"] = parity_case(mesh, "qwen3", True, steps=3, extra=("model.head_dim=24",))
    res["parity-llama-tp2-sp0-hd24-kv1"] = parity_case(mesh, "llama", False, steps=3,
                                                       extra=("model.head_dim=24", "model.n_kv_heads=1"))
    for sp in (False, True):  # gemma: sandwich norms (the post-norms on the residual stream too), windows of 5
        res[f"parity-gemma-tp2-sp{int(sp)}"] = parity_case(mesh, "gemma", sp, steps=5,
                                                           extra=("model.head_dim=24", "model.sliding_window=5"))
    # latent attention: down-projections replicated (partial gradients summed over tp), up-projections by heads
    res["parity-mla-tp2-sp1"] = parity_case(mesh, MLA, True)
    res["parity-mla-tp2-sp0"] = parity_case(mesh, MLA, False, steps=3)
    res["parity-mla-tp2-sp1-async"] = parity_case(mesh, MLA, True, steps=3, async_tp=True)  # ring regions
    # multi-token prediction: its blocks split as the model's, its norms and projection on the sp stream
    res["parity-mtp-tp2-sp1"] = parity_case(mesh, MTP, True, steps=3)
    for arch, sp in (("llama", True), ("qwen3", True), ("gpt2", False), (MLA, True)):  # compiled, borders traced
        res[f"parity-{arch}-tp2-sp{int(sp)}-compiled"] = parity_case(mesh, arch, sp, steps=3, compiled=True)
    for sp, lean in ((True, False), (True, True), (False, False)):  # the compiled save-set at tp 2
        res[f"compiled-saves-sp{int(sp)}-lean{int(lean)}"] = compiled_saves_case(mesh, sp, lean)
    for sp in (False, True):  # LLaVA: a ViT split over tp (never over the sequence), image features merged
        res[f"parity-llava-tp2-sp{int(sp)}"] = llava_parity_case(mesh, sp)
    # LLaVA at pp=2: the encoder on the first stage, the images carried with its micro-batches.
    pp_mesh = Mesh.build(tiny_config(pp=2, world=world), world, rank, device)
    emb_group = build_embedding_groups(pp_mesh)
    for schedule in ("1f1b", "zb"):
        res[f"pipeline-llava-pp2-{schedule}"] = llava_pipeline_case(pp_mesh, emb_group, schedule, 2)
    res["pipeline-llava-pp2-frozen"] = llava_pipeline_frozen_case(pp_mesh, emb_group)  # last stage all frozen
    res["decode"] = {arch: decode_case(mesh, arch) for arch in ("llama", "gpt2", "qwen3", MLA)}
    res["gathered_linears"] = check_gathered_linears(mesh)
    res["step_bytes"] = {(arch, p): step_bytes(mesh, arch, p) for arch in ("llama", "gpt2") for p in ("fp32", "bf16")}
    return res
