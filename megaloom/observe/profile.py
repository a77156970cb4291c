"""Where one training step's time goes: a PyTorch profiler trace split into kinds of work, and the step's floor.

Used by `megaloom train --dry-run` on a GPU (one profiled step after the timed ones) and by the benchmarks
(bench/bench_train.py --profile, bench/profile_breakdown.py re-reads a saved trace). On an accelerator the
device's kernel spans are read (tested on CUDA; another accelerator's trace is read the same way, unverified), on
CPU the top-level operators. Kinds are read from kernel names (CUDA) or operator names (CPU): GEMM (cuBLAS /
CUTLASS / nvjet / scaled and grouped mm), attention (flash / cuDNN / efficient SDPA kernels), optimizer
(multi-tensor Adam and the clipping norm), communication (NCCL), the loss's softmax, copies (memcpy / memset / copy
kernels), and everything else (norms, RoPE, SwiGLU, residual adds, casts: mostly Triton kernels under compile).
Idle = the step's wall time minus the union of the device's busy intervals: launch gaps, host syncs (and the
profiler's own overhead).

For an MoE model (`moe=True`) three more kinds come first: the experts' grouped GEMM (CUTLASS grouped kernels),
the routing (top-k selection) and dispatch / combine (the permutation into expert-contiguous rows and back:
sort, bincount, cumsum, gathers, scatters, index copies). Names are the only handle under torch.compile, which
drops `record_function` ranges inside compiled code: Inductor names each fused kernel after its aten ops, so a
kernel that fuses the combine's index copy with the residual add counts as dispatch / combine.

The floor (`floor_ms`) is the speed issue's: the step's GEMM FLOPs at the measured matmul ceiling, attention as
the kernel ran, the optimizer's traffic at HBM bandwidth; `DEVICE_CEILINGS` holds the measured ceilings by GPU.
"""


from __future__ import annotations

import gzip
import json
import re
from bisect import bisect_right
from itertools import accumulate
from pathlib import Path

KINDS = [
    # Not Inductor's kernels named after a collective they feed ("triton_poi_fused_..._add_permute_reduce_scatter_
    # tensor_...": the residual add fused with the layout of the reduce-scatter's input): compute.
    ("communication", re.compile(r"^(?!triton_).*(nccl|all_reduce|allreduce|reduce_scatter|all_gather|alltoall)",
                                 re.I)),
    # cuDNN's attention runs helper kernels beside its fprop/bprop (cudnn::fusion::compute_dot_do_o, ...)
    ("attention", re.compile(r"flash|fmha|cudnn.*(attn|sdpa)|cudnn::fusion|sdpa|attention|_efficient_attention",
                             re.I)),
    # Not "lamb" alone: eager elementwise kernels are named after their C++ lambdas ("...{lambda(float)#1}...").
    ("optimizer", re.compile(r"adam|multi_tensor|foreach|lamb(?!da)", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|nvjet|xmma|cublas|_scaled_mm|grouped_mm|\bmm\b|addmm|matmul|bmm|linear",
                        re.I)),
    ("loss", re.compile(r"softmax|cross_entropy|nll_loss", re.I)),
    # Inductor names fused kernels after their ops ("triton_..._to_copy_..."): those are compute, not copies.
    ("copy", re.compile(r"^(?!triton_).*(memcpy|memset|copy_kernel|direct_copy)", re.I)),
]


# MoE kinds, tried before the ones above. The embedding's backward (an index accumulate, a sort in eager) is
# not dispatch: it is caught first and left with the elementwise kind.
MOE_KINDS = [
    ("elementwise/norm/other", re.compile(r"embedding", re.I)),
    ("communication", KINDS[0][1]),
    ("moe grouped GEMM", re.compile(r"group", re.I)),
    ("moe routing (top-k)", re.compile(r"topk|radixFindKth|gatherTopK", re.I)),
    ("moe dispatch/combine", re.compile(r"sort|bincount|histc|histogram|cumsum|scan|index|scatter|gather|"
                                        r"repeat_interleave", re.I)),
]


def kind_of(name: str, moe: bool = False) -> str:
    for kind, pattern in (MOE_KINDS + KINDS) if moe else KINDS:
        if pattern.search(name):
            return kind
    return "elementwise/norm/other"


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _on_device(device_type: str) -> bool:
    """Whether a trace of ``device_type`` holds device kernels (an accelerator's) or only CPU operators."""
    from megaloom.accelerator import is_accelerator  # (torch: re-reading a saved trace needs it no other way)

    return is_accelerator(device_type)


def _spans(trace_path: Path, on_device: bool) -> tuple[list[dict], list[dict]]:
    """(kernel or top-level operator spans, all events) of a saved trace."""
    opener = gzip.open if str(trace_path).endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    if on_device:
        spans = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    else:  # CPU (a smoke test of the tool more than a measurement): top-level operators of each thread only
        spans = []
        ends: dict = {}
        for e in sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"),
                        key=lambda e: (e["ts"], -e.get("dur", 0.0))):
            if e["ts"] >= ends.get(e.get("tid"), float("-inf")):
                spans.append(e)
                ends[e.get("tid")] = e["ts"] + e.get("dur", 0.0)
    return spans, events


# A dry run's kind for the device work its fake process group launches itself (see `launched_by_collectives`).
FAKE_GROUP_KIND = "fake group's copies"


def launched_by_collectives(events: list[dict], spans: list[dict]) -> set[int]:
    """Indices into ``spans`` of the device work launched from inside a c10d collective operator (``c10d::...``,
    matched to its launch through the trace's correlation ids, on the launching thread).

    Under a dry run's fake process group that is the group's own doing: torch's FakeProcessGroup copies the input
    into every chunk of an all-gather's output (tp of them) and one chunk of a reduce-scatter's input into the
    output, device copies on the compute stream that a real group replaces with NCCL kernels on their own stream.
    They are not the rank's work: the dry run's compute-only figures leave them out (issue 47: 5,885 copies,
    26 ms of the llama3-70b tp8 x pp8 x vpp2 4k rank's 707 ms step on an H100)."""
    inside: dict = {}  # tid -> sorted (start, end) of c10d operators
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op" and e.get("name", "").startswith("c10d::"):
            inside.setdefault(e.get("tid"), []).append((e["ts"], e["ts"] + e.get("dur", 0.0)))
    if not inside:
        return set()
    starts = {tid: [a for a, _ in sorted(iv)] for tid, iv in inside.items()}
    ends = {tid: list(accumulate((b for _, b in sorted(iv)), max)) for tid, iv in inside.items()}
    from megaloom.accelerator import trace_launch_categories

    categories = trace_launch_categories()
    launches = {}  # correlation id -> (tid, ts) of the runtime call that launched it
    for e in events:
        if e.get("cat") in categories and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = (e.get("tid"), e["ts"])
    out = set()
    for i, e in enumerate(spans):
        tid, ts = launches.get(e.get("args", {}).get("correlation"), (None, None))
        if tid not in starts:
            continue
        j = bisect_right(starts[tid], ts) - 1  # the last operator starting before the launch; any earlier one
        if j >= 0 and ends[tid][j] >= ts:      # reaching past it encloses it too (running max of the ends)
            out.add(i)
    return out


def breakdown(trace_path: Path, device_type: str, moe: bool = False, fake_group: bool = False) -> dict:
    """Busy time per kind (ms) from a Chrome trace written by `torch.profiler.profile.export_chrome_trace`.
    ``fake_group`` (a dry run): the device work launched inside collectives is its own kind, `FAKE_GROUP_KIND`."""
    on_device = _on_device(device_type)
    spans, events = _spans(trace_path, on_device)
    fake = launched_by_collectives(events, spans) if fake_group and on_device else set()
    per_kind: dict[str, float] = {}
    for i, e in enumerate(spans):
        k = FAKE_GROUP_KIND if i in fake else kind_of(e.get("name", ""), moe)
        per_kind[k] = per_kind.get(k, 0.0) + e.get("dur", 0.0) / 1e3
    # The step's host-side annotation only: CUDA traces repeat "ProfilerStep#N" as a gpu_user_annotation, and
    # adding both doubled the wall time (and the "idle" derived from it).
    step = [e for e in events if e.get("ph") == "X" and e.get("name", "").startswith("ProfilerStep")
            and e.get("cat", "user_annotation") == "user_annotation"]
    wall = sum(e["dur"] for e in step) / 1e3 if step else None
    busy = _union_us([(e["ts"], e["ts"] + e.get("dur", 0.0)) for e in spans]) / 1e3
    out = {"wall_ms": wall, "busy_ms": busy, "kinds_ms": dict(sorted(per_kind.items(), key=lambda kv: -kv[1]))}
    if spans and on_device:
        # Idle = the device's own span (first kernel start to last kernel end) less its busy time: gaps between
        # kernels, independent of how far the host ran ahead.
        span = (max(e["ts"] + e.get("dur", 0.0) for e in spans) - min(e["ts"] for e in spans)) / 1e3
        out["device_span_ms"] = span
        out["idle_ms"] = max(0.0, span - busy)
    return out


def floor_ms(kinds_ms: dict[str, float], *, gemm_flop: float, gemm_tflops: float, optimizer_bytes: float,
             hbm_tb_per_s: float) -> dict[str, float]:
    """The speed issue's floor of one step, per kind (ms): the step's GEMM FLOPs at the measured matmul ceiling,
    attention at the time the best kernel available (the one that ran) took, the optimizer's traffic at HBM
    bandwidth; every other kind 0 (elementwise work, the loss, copies and gaps are what fusion and overlap could
    remove). ``gemm_flop``: e.g. 6 x matmul parameters x tokens (8 x with full recompute); ``optimizer_bytes``:
    28 per fp32 parameter for AdamW plus 4 for the clipping norm's read."""
    return {"gemm": gemm_flop / (gemm_tflops * 1e12) * 1e3, "attention": kinds_ms.get("attention", 0.0),
            "optimizer": optimizer_bytes / (hbm_tb_per_s * 1e12) * 1e3}


def table(b: dict, step_ms: float | None = None, floor: dict[str, float] | None = None) -> str:
    """Busy time per kind, as a share of the step. The profiler's own overhead stretches the profiled step's
    wall time (launch gaps), so with ``step_ms`` (the unprofiled median step) the shares are of that, and the
    last line is what is left of it beyond the kernels: host gaps and launch latency. With ``floor`` (`floor_ms`)
    a column of each kind's floor and, under the step, its ratio to the summed floor."""
    wall = step_ms or b.get("wall_ms") or b["busy_ms"]
    floor_col = (lambda k: f"{floor.get(k, 0.0):>10.2f}") if floor else (lambda k: "")
    lines = [f"{'kind':<24}{'ms':>10}{'% of step':>11}" + (f"{'floor ms':>10}" if floor else "")]
    for k, ms in b["kinds_ms"].items():
        lines.append(f"{k:<24}{ms:>10.2f}{100 * ms / wall:>10.1f}%" + floor_col(k))
    if step_ms:
        gap = max(0.0, step_ms - b["busy_ms"])
        lines.append(f"{'no kernel (host, gaps)':<24}{gap:>10.2f}{100 * gap / wall:>10.1f}%" + floor_col("-"))
        lines.append(f"{'step (unprofiled median)':<24}{step_ms:>10.2f}")
        if floor:
            total = sum(floor.values())
            lines.append(f"{'floor (sum)':<24}{total:>10.2f}  step / floor = {step_ms / total:.3f}")
        if b.get("wall_ms"):
            lines.append(f"{'profiled step wall time':<24}{b['wall_ms']:>10.2f}  (profiler overhead included)")
        return "\n".join(lines)
    if "idle_ms" in b:
        lines.append(f"{'idle (no kernel)':<24}{b['idle_ms']:>10.2f}{100 * b['idle_ms'] / wall:>10.1f}%")
    lines.append(f"{'step wall time':<24}{wall:>10.2f}")
    return "\n".join(lines)


def top_kernels(trace_path: Path, device_type: str, moe: bool = False, n: int = 5) -> dict[str, list]:
    """Each kind's `n` largest kernels by total time: [(ms, calls, name)], to check the classification."""
    per: dict[tuple[str, str], list[float]] = {}
    for e in _spans(trace_path, _on_device(device_type))[0]:
        name = e.get("name", "")
        acc = per.setdefault((kind_of(name, moe), name), [0.0, 0])
        acc[0] += e.get("dur", 0.0) / 1e3
        acc[1] += 1
    out: dict[str, list] = {}
    for (kind, name), (ms, calls) in sorted(per.items(), key=lambda kv: -kv[1][0]):
        if len(out.setdefault(kind, [])) < n:
            out[kind].append((round(ms, 3), calls, name))
    return out


def profile_step(run_step, out_dir: Path, device_type: str, moe: bool = False, fake_group: bool = False) -> dict:
    """Profile one call of `run_step()` (after warm-up), save the trace and the breakdown; return the breakdown."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from megaloom import accelerator

    out_dir.mkdir(parents=True, exist_ok=True)
    device_activity = accelerator.profiler_activity(device_type)
    acts = [ProfilerActivity.CPU] + ([device_activity] if device_activity is not None else [])
    with profile(activities=acts, schedule=schedule(wait=0, warmup=1, active=1, repeat=1)) as prof:
        for _ in range(2):
            run_step()
            accelerator.synchronize(device_type)
            prof.step()
    trace = out_dir / "trace.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as src, gzip.open(out_dir / "trace.json.gz", "wb") as dst:
        dst.write(src.read())
    trace.unlink()
    b = breakdown(out_dir / "trace.json.gz", device_type, moe, fake_group)
    (out_dir / "breakdown.json").write_text(json.dumps(b, indent=1))
    return b


# Measured ceilings per GPU (a substring of `accelerator.device_name`): the bf16 matmul rate at 8192^3 and the
# HBM bandwidth of a large copy, both on an H200 (bench/RESULTS.md: bench_matmul.py, bench_optimizer.py).
DEVICE_CEILINGS = {"H200": {"gemm_tflops": 760.0, "hbm_tbps": 4.26}}


def device_ceilings(device_name: str) -> dict[str, float] | None:
    """The measured matmul ceiling and HBM bandwidth of a GPU by name, or None (not measured here)."""
    for key, ceilings in DEVICE_CEILINGS.items():
        if key in device_name:
            return dict(ceilings)
    return None


def kernel_count(trace_path: Path) -> int:
    """Kernels launched in a saved trace of a device."""
    return sum(1 for e in _spans(trace_path, on_device=True)[0] if e.get("cat") == "kernel")
