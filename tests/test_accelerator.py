"""megaloom/accelerator.py on CPU: train.device's parsing and refusals, the device -> backend map, and the runtime
calls routed to torch.accelerator or the device type's module. Device types this machine lacks (xpu, musa, a
visible CUDA GPU) are stood in for with monkeypatching; nothing here needs an accelerator."""

from __future__ import annotations

import copy
import pickle
import types

import pytest
import torch
import torch.distributed as dist

from megaloom import accelerator
from megaloom.config import ConfigError, load_config
from megaloom.parallel.random import RNGTracker
from megaloom.preflight import preflight


@pytest.fixture
def xpu_present(monkeypatch):
    """Two xpu devices visible, the current one set through torch.accelerator (recorded, not done)."""
    chosen = []
    monkeypatch.setattr(accelerator, "known", lambda kind: kind in ("cpu", "cuda", "xpu"))
    monkeypatch.setattr(accelerator, "is_available", lambda kind: kind == "xpu")
    monkeypatch.setattr(accelerator, "device_count", lambda kind: 2 if kind == "xpu" else 0)
    monkeypatch.setattr(torch.accelerator, "set_device_index", chosen.append)
    return chosen


# ------------------------------------------------------------------------------------------ which device
def test_auto_is_the_current_accelerator_when_available(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a: None)
    assert accelerator.default_type() == "cpu" and accelerator.parse("auto") == ("cpu", None)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a: torch.device("xpu"))
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert accelerator.default_type() == "cpu"  # built for xpu, none visible
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    assert accelerator.parse("auto") == ("xpu", None)
    assert accelerator.default_device() == torch.device("xpu")


@pytest.mark.parametrize("spec, parsed", [
    ("cpu", ("cpu", None)), ("cuda", ("cuda", None)), ("cuda:3", ("cuda", 3)), ("xpu:1", ("xpu", 1)),
    ("musa", ("musa", None)), ("npu:0", ("npu", 0)), ("mps", ("mps", None)),
])
def test_parse(spec, parsed):
    assert accelerator.parse(spec) == parsed
    assert load_config(None, [f"train.device={spec}"]).train.device == spec  # the config accepts the same forms


@pytest.mark.parametrize("spec", ["CUDA", "gpu 0", "cuda:", "cuda:-1", "cuda:x", "cpu:0", "auto:1", ":0"])
def test_malformed_device_is_refused_by_the_config_naming_the_setting(spec):
    with pytest.raises(ConfigError, match="train.device: "):  # ("cuda:" reads as a YAML mapping: refused as such)
        load_config(None, [f"train.device={spec}"])
    with pytest.raises(ConfigError, match="train.device"):
        accelerator.parse(spec)


def test_a_type_torch_does_not_know_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"train.device=gpu: this torch .* knows no device type 'gpu'.*"
                                          r"use train.device=auto .*, cpu"):
        accelerator.check("gpu")
    if not hasattr(torch, "musa"):  # no torch_musa here: the message names the package whose import registers it
        with pytest.raises(ConfigError, match="train.device=musa: .*install torch_musa"):
            accelerator.check("musa")
    with pytest.raises(ConfigError, match="knows no device type 'gpu'"):  # preflight refuses it before any work
        preflight(load_config(None, ["train.device=gpu"]), 1, local_world_size=1)


def test_an_absent_device_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(accelerator, "is_available", lambda kind: False)
    for spec in ("cuda", "cuda:1", "xpu"):
        with pytest.raises(ConfigError, match=rf"train.device={spec} but no {spec.split(':')[0]} device is visible.*"
                                              "use train.device=cpu"):
            accelerator.pick(spec, 0)
    assert accelerator.pick("cpu", 3) == torch.device("cpu")


def test_each_rank_takes_its_local_device_of_any_type(xpu_present):
    assert accelerator.pick("xpu", 1) == torch.device("xpu", 1)
    assert accelerator.pick("xpu:0", 1) == torch.device("xpu", 0)  # TYPE:N names the device
    assert xpu_present == [torch.device("xpu", 1), torch.device("xpu", 0)]  # made current, as torch.cuda.set_device
    with pytest.raises(ConfigError, match="train.device=xpu:2: xpu:2 does not exist, this process sees 2 xpu"):
        accelerator.pick("xpu:2", 0)
    with pytest.raises(ConfigError, match="local rank 2's xpu device does not exist"):
        accelerator.pick("xpu", 2)


def test_one_device_for_several_processes_is_refused_for_every_type():
    cfg = load_config(None, ["train.device=xpu:1"])
    with pytest.raises(ConfigError) as e:
        preflight(cfg, 2, local_world_size=2)
    assert str(e.value) == ("train.device=xpu:1 with 2 processes on this node would put every rank on xpu device 1; "
                            "set train.device=xpu (or auto) so that each rank takes the xpu device of its local rank "
                            "(restrict the xpu devices used with ZE_AFFINITY_MASK).")
    with pytest.raises(ConfigError, match='on GPU 0 \\(NCCL: "Duplicate GPU detected"\\); set train.device=cuda'):
        preflight(load_config(None, ["train.device=cuda:0"]), 2, local_world_size=2)
    assert preflight(cfg, 8, local_world_size=1).sizes["dp"] == 8  # one process per node may choose its device


# ----------------------------------------------------------------------------------------- which backend
def test_backend_is_torchs_map_for_the_type(monkeypatch):
    assert accelerator.backend("cpu") == accelerator.backend(torch.device("cpu")) == "gloo"
    assert accelerator.backend("cuda") == accelerator.backend(torch.device("cuda", 1)) == "nccl"
    if "xpu" not in dist.Backend.default_device_backend_map:
        pytest.skip(f"torch {torch.__version__} maps no backend to xpu")
    assert accelerator.backend("xpu:0") == "xccl"


def test_an_out_of_tree_backend_registered_for_its_type_is_used(monkeypatch):
    with pytest.raises(ConfigError, match="train.device=musa: torch.distributed has no backend registered for 'musa'"):
        accelerator.backend("musa")
    # what torch_musa's import does: Backend.register_backend("mccl", ..., devices=["musa"])
    monkeypatch.setitem(dist.Backend.default_device_backend_map, "musa", "mccl")
    assert accelerator.backend("musa:0") == "mccl"


def test_start_process_group_asks_the_map(monkeypatch):
    from megaloom import runtime

    seen = {}
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.update(backend=backend, **kw))
    monkeypatch.setitem(dist.Backend.default_device_backend_map, "hpu", "hccl")  # (as habana's package registers)
    runtime.start_process_group(torch.device("hpu", 0), 0, 2, runtime.timedelta(seconds=5))
    assert seen["backend"] == "hccl" and seen["device_id"] == torch.device("hpu", 0)
    runtime.start_process_group(torch.device("cpu"), 0, 2, runtime.timedelta(seconds=5))
    assert seen["backend"] == "gloo" and seen["device_id"] is None


# ------------------------------------------------------------------------------------- kinds of device
def test_device_kinds():
    assert not accelerator.is_accelerator("cpu") and not accelerator.is_accelerator(torch.device("meta"))
    assert all(accelerator.is_accelerator(k) for k in ("cuda", "cuda:1", "xpu", "musa", "npu", "mps"))
    assert accelerator.is_cuda("cuda:1") and accelerator.is_cuda(torch.device("cuda"))
    assert not accelerator.is_cuda("xpu") and not accelerator.is_cuda("cpu")
    assert accelerator.pin_memory("cuda") and accelerator.pin_memory("xpu:0")
    assert not accelerator.pin_memory("cpu") and not accelerator.pin_memory("mps")  # mps: memory shared with the host
    assert accelerator.fused_optimizer(torch.device("cuda", 0)) and not accelerator.fused_optimizer("cpu")
    assert accelerator.visible_devices_env("cuda") == "CUDA_VISIBLE_DEVICES"
    assert accelerator.visible_devices_env("mps") is None


def test_cuda_only_features_are_off_elsewhere():
    for device in (torch.device("cpu"), torch.device("xpu", 0), "musa"):
        assert accelerator.cuda_capability(device) is None
    assert accelerator.cuda_major(torch.device("cpu")) is None and accelerator.cuda_major(torch.device("xpu")) is None


def test_capability_asks_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert accelerator.cuda_capability(torch.device("cuda", 0)) == (9, 0)
    assert accelerator.cuda_major(torch.device("cuda", 0)) == 9


def test_profiler_activity():
    from torch.profiler import ProfilerActivity

    assert accelerator.profiler_activity("cpu") is None
    assert accelerator.profiler_activity("cuda") == ProfilerActivity.CUDA
    assert accelerator.profiler_activity("xpu") == ProfilerActivity.XPU


# ------------------------------------------------------------------------------------------- the runtime
def test_cpu_has_no_runtime_to_call():
    cpu = torch.device("cpu")
    accelerator.synchronize(cpu)  # nothing to wait for
    assert accelerator.total_memory(cpu) is None and accelerator.device_name(cpu) == "cpu"
    assert accelerator.streams(cpu) is None and accelerator.device_rng(cpu) is None
    if accelerator.started() is None:
        assert accelerator.rng_states() == {}
    accelerator.set_rng_states({"torch": torch.get_rng_state(), "xpu": torch.zeros(1)})  # no such device: ignored


def test_memory_and_sync_go_to_torch_accelerator_else_the_device_module(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda d=None: calls.append(("sync", d)))
    monkeypatch.setattr(torch.accelerator, "max_memory_allocated", lambda d=None: 123, raising=False)
    xpu = torch.device("xpu", 0)
    accelerator.synchronize(xpu)
    assert calls == [("sync", xpu)] and accelerator.max_memory_allocated(xpu) == 123
    # A torch without torch.accelerator's memory calls: the type's own module answers
    monkeypatch.delattr(torch.accelerator, "memory_allocated", raising=False)
    fake = types.SimpleNamespace(memory_allocated=lambda d: 7)
    monkeypatch.setattr(torch, "get_device_module", lambda kind: fake)
    assert accelerator.memory_allocated(xpu) == 7


def test_total_memory_and_name_from_the_device_module(monkeypatch):
    props = types.SimpleNamespace(total_memory=64 * 2**30)
    fake = types.SimpleNamespace(get_device_properties=lambda d: props, get_device_name=lambda d: "Fake GPU")
    monkeypatch.setattr(torch, "get_device_module", lambda kind: fake)
    assert accelerator.total_memory("xpu:0") == 64 * 2**30 and accelerator.device_name("xpu:0") == "Fake GPU"


def test_streams_are_the_device_modules(monkeypatch):
    fake = types.SimpleNamespace(Stream=lambda d: ("stream", d),
                                 Event=lambda enable_timing=False: ("event", enable_timing),
                                 stream=lambda s: ("use", s), current_stream=lambda d: ("current", d))
    monkeypatch.setattr(torch, "get_device_module", lambda kind: fake)
    s = accelerator.streams("xpu:1")
    xpu = torch.device("xpu", 1)
    assert s.new_stream() == ("stream", xpu) and s.current() == ("current", xpu)
    assert s.event(timing=True) == ("event", True) and s.use("x") == ("use", "x")
    monkeypatch.setattr(torch, "get_device_module", lambda kind: types.SimpleNamespace(Event=object))
    assert accelerator.streams("mps") is None  # no streams in its module: the single-stream paths


def test_device_rng_forks_and_restores_the_devices_generator(monkeypatch):
    gen = torch.Generator()
    gen.manual_seed(5)
    fake = types.SimpleNamespace(current_device=lambda: 0, default_generators=(gen,),
                                 get_rng_state=lambda i: gen.get_state(),
                                 set_rng_state=lambda s, i: gen.set_state(s))
    monkeypatch.setattr(torch, "fakedev", fake, raising=False)
    rng = accelerator.DeviceRNG("fakedev", None)
    before = torch.rand(3, generator=gen)
    gen.manual_seed(5)
    saved = rng.fork(1234)
    forked = torch.rand(3, generator=gen)
    rng.restore(saved)
    assert torch.equal(torch.rand(3, generator=gen), before)  # the device's stream continues as if never forked
    gen.manual_seed(1234)
    assert torch.equal(torch.rand(3, generator=gen), forked)


def test_a_tracker_holding_a_device_rng_copies_and_pickles():
    tracker = RNGTracker({"tp": 1}, device="cuda:1")
    assert tracker._device_rng == accelerator.DeviceRNG("cuda", 1)
    assert copy.deepcopy(tracker)._device_rng == tracker._device_rng  # models holding it are deep-copied
    assert pickle.loads(pickle.dumps(tracker._device_rng)) == tracker._device_rng


def test_set_device_without_an_index_means_the_current_one(monkeypatch) -> None:
    """torch.accelerator.set_device_index refuses a device without an index (torch 2.11 on an H100: the offload
    thread's `cuda`); megaloom passes the current index instead, and any given index as it is."""
    import torch

    from megaloom import accelerator

    calls = []
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda d: calls.append(d))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 3)
    accelerator.set_device(torch.device("meta"))  # a device type without an index (CUDA's on a GPU machine)
    accelerator.set_device(torch.device("meta", 1))
    accelerator.set_device(torch.device("cpu"))  # nothing to set
    assert calls == [3, torch.device("meta", 1)]
