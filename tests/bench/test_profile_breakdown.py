"""bench/profile_breakdown.py sorts kernels into kinds by name: checked on names from an H200 trace."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import json  # noqa: E402

import pytest  # noqa: E402
from profile_breakdown import breakdown, kind_of, table  # noqa: E402


def test_kernel_names_from_an_h200_trace_land_in_their_kinds() -> None:
    seen = {
        "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN": "gemm",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64": "attention",
        "void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*)": "attention",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>":
            "optimizer",
        "triton_red_fused__to_copy_arange_div_eq_exp_prepare_softmax_online_scalar_tensor_sub": "loss",
        "triton_per_fused__fused_rms_norm__fused_rms_norm_backward__to_copy__unsafe_view_add_view_6":
            "elementwise/norm/other",
        "triton_poi_fused__to_copy_1": "elementwise/norm/other",
        "Memset (Device)": "copy",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>": "copy",
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL": "communication",
        # an eager elementwise kernel: its C++ lambda is not the LAMB optimizer (an eager MoE step's "optimizer"
        # share read 129 ms of 325 for that reason)
        "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::silu_kernel("
        "at::TensorIteratorBase&)::{lambda()#1}::operator()() const::{lambda(float)#1}>": "elementwise/norm/other",
    }
    assert {name: kind_of(name) for name in seen} == seen


def test_table_shares_are_of_the_unprofiled_step() -> None:
    b = {"wall_ms": 500.0, "busy_ms": 90.0, "kinds_ms": {"gemm": 60.0, "attention": 30.0}, "idle_ms": 410.0}
    lines = table(b, step_ms=100.0).splitlines()
    assert "60.0%" in lines[1] and "30.0%" in lines[2]
    assert lines[3].split()[-2:] == ["10.00", "10.0%"]  # 100 ms step - 90 ms of kernels


def test_cuda_trace_counts_the_step_once_and_idle_from_the_device_span(tmp_path: Path) -> None:
    # A CUDA trace repeats ProfilerStep as a gpu_user_annotation: the wall time is the host annotation's alone,
    # idle is the gap between kernels inside the device's span (here 100-110 us and 150-160 us: 20 us).
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0.0, "dur": 300.0},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#1", "ts": 40.0, "dur": 250.0},
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst_128x256", "ts": 50.0, "dur": 50.0},
        {"ph": "X", "cat": "kernel", "name": "triton_poi_fused_add_0", "ts": 110.0, "dur": 40.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 160.0, "dur": 10.0},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    b = breakdown(path, "cuda")
    assert b["wall_ms"] == 0.3 and b["busy_ms"] == 0.1
    assert abs(b["device_span_ms"] - 0.12) < 1e-9 and abs(b["idle_ms"] - 0.02) < 1e-9
    assert b["kinds_ms"] == {"gemm": 0.05, "elementwise/norm/other": 0.04, "copy": 0.01}


def test_moe_kernels_get_their_own_kinds_only_for_an_moe_model() -> None:
    seen = {
        # torch._grouped_mm on sm90 is a CUTLASS kernel over a GroupProblemShape
        "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<"
        "cute::tuple<int, int, int> >, cutlass::gemm::collective::CollectiveMma<...> > >": "moe grouped GEMM",
        "void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>": "moe routing (top-k)",
        "void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<...>": "moe dispatch/combine",
        "triton_poi_fused_index_copy_mul_3": "moe dispatch/combine",
        "triton_poi_fused_embedding_dense_backward_1": "elementwise/norm/other",  # not dispatch
        "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN": "gemm",
        "ncclDevKernel_AllGather_RING_LL": "communication",
    }
    assert {name: kind_of(name, moe=True) for name in seen} == seen
    # a dense model's trace keeps the plain kinds (an index kernel of RoPE is not dispatch there)
    assert kind_of("triton_poi_fused_index_copy_mul_3") == "elementwise/norm/other"
    assert kind_of(next(iter(seen))) == "gemm"


def test_the_floor_counts_gemm_at_the_ceiling_attention_as_run_and_the_optimizer_at_bandwidth() -> None:
    from profile_breakdown import floor_ms

    # llama3-1b-untied, micro-batch 4 x 4096: 6 x 1.236e9 x 16,384 FLOP at 760 TFLOP/s; 32 bytes x 1.498e9 at 4.26 TB/s
    f = floor_ms({"attention": 44.9, "gemm": 160.2}, gemm_flop=6 * 1.236e9 * 16384, gemm_tflops=760,
                 optimizer_bytes=32 * 1.498e9, hbm_tb_per_s=4.26)
    assert abs(f["gemm"] - 159.87) < 0.01 and f["attention"] == 44.9 and abs(f["optimizer"] - 11.25) < 0.01
    b = {"busy_ms": 250.0, "kinds_ms": {"gemm": 160.2, "attention": 44.9, "elementwise/norm/other": 24.0}}
    lines = table(b, step_ms=256.0, floor=f).splitlines()
    assert lines[0].split()[-2:] == ["floor", "ms"] and lines[1].split()[-1] == "159.87"
    assert lines[-1].endswith(f"step / floor = {256.0 / sum(f.values()):.3f}")


def test_inductor_kernels_named_after_a_collective_are_compute() -> None:
    # the residual add fused with the reduce-scatter input's layout (llama3-70b tp8 sp, H100 2026-12-06: 24 ms of
    # "communication" on a fake group that runs no collective kernel)
    assert kind_of("triton_poi_fused__unsafe_view_add_permute_reduce_scatter_tensor_view_5") == \
        "elementwise/norm/other"
    assert kind_of("triton_red_fused__fused_rms_norm_add_all_gather_into_tensor_3") == "elementwise/norm/other"
    assert kind_of("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL") == "communication"


def test_a_dry_runs_fake_group_copies_are_their_own_kind(tmp_path: Path) -> None:
    # Device work whose launch (matched by correlation id, same thread) lies inside a c10d operator is the fake
    # group's: the copies into an all-gather's chunks. A copy launched elsewhere, or inside a c10d operator of
    # another thread, stays a copy; without fake_group (a real run) nothing moves.
    rt = lambda tid, ts, corr: {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "tid": tid,  # noqa: E731
                                "ts": ts, "dur": 1.0, "args": {"correlation": corr}}
    dev = lambda name, ts, dur, corr, cat="gpu_memcpy": {"ph": "X", "cat": cat, "name": name, "ts": ts,  # noqa: E731
                                                         "dur": dur, "args": {"correlation": corr}}
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0.0, "dur": 400.0},
        {"ph": "X", "cat": "cpu_op", "name": "c10d::allgather_into_tensor_coalesced_", "tid": 1, "ts": 10.0,
         "dur": 20.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "tid": 1, "ts": 12.0, "dur": 5.0},
        rt(1, 13.0, 1), rt(1, 18.0, 2),            # two copies inside the all-gather
        rt(1, 40.0, 3),                            # a copy after it
        {"ph": "X", "cat": "cpu_op", "name": "c10d::_reduce_scatter_base_", "tid": 2, "ts": 45.0, "dur": 20.0},
        rt(1, 50.0, 4),                            # thread 1 copies while thread 2 is inside a collective
        rt(1, 60.0, 5),                            # a GEMM
        dev("Memcpy DtoD (Device -> Device)", 100.0, 10.0, 1), dev("Memcpy DtoD (Device -> Device)", 110.0, 10.0, 2),
        dev("Memcpy DtoD (Device -> Device)", 120.0, 5.0, 3), dev("Memcpy DtoD (Device -> Device)", 125.0, 5.0, 4),
        dev("nvjet_sm90_tst_128x256", 130.0, 50.0, 5, cat="kernel"),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    from megaloom.observe.profile import FAKE_GROUP_KIND

    fake = breakdown(path, "cuda", fake_group=True)["kinds_ms"]
    assert fake == pytest.approx({FAKE_GROUP_KIND: 0.02, "copy": 0.01, "gemm": 0.05})
    assert breakdown(path, "cuda")["kinds_ms"] == pytest.approx({"copy": 0.03, "gemm": 0.05})
