"""The device megaloom runs on and the distributed backend that goes with it (issue 37: any accelerator).

The one module that names a device type or calls a device runtime; everything else asks here
(tests/test_house.py fails on a "cuda" literal, ``torch.cuda`` or ``.is_cuda`` anywhere else in megaloom/).

- Which device: ``train.device`` is ``auto`` (torch's accelerator, `torch.accelerator.current_accelerator`, when
  one is available, else the CPU), ``cpu``, or an accelerator type torch knows (cuda, xpu, musa, npu, mps, ...)
  with an optional ``:N``. `check` refuses an unknown or absent type naming the fix; `pick` gives a rank the
  device of its local rank (or ``:N``'s) and makes it current.
- Which backend: torch.distributed's own device -> backend map (`backend`: gloo for cpu, nccl for cuda, xccl for
  xpu, and what an out-of-tree package such as torch_musa (MCCL) or torch_npu (HCCL) registers for its type),
  rather than a hard-coded "NCCL on CUDA".
- The runtime: synchronize, set_device and memory statistics through `torch.accelerator` (generic since torch
  2.6; its memory calls where this torch has them, else the type's module), the rest through the type's own module
  (``torch.cuda``, ``torch.xpu``, ``torch.musa``, ...: `device_module`): availability and counts, RNG state,
  streams and events (on CUDA exactly the ``torch.cuda`` objects megaloom always used, so CUDA runs are unchanged),
  device names and sizes.
- CUDA-only features (cuDNN and FA4 attention, fp8 and grouped GEMMs, FlexAttention masks, compiled loss chunks,
  activation offload, the memory plan's kernel model): `is_cuda` and `cuda_capability` (None off CUDA), so each
  such path stays explicitly CUDA's and every other device takes the portable one.

Tested: CPU (every test) and CUDA (the H200: ``pytest -m gpu``). Not tested: xpu, musa, npu, mps (no hardware here):
they take the portable paths, with the calls above resolved through their torch modules.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megaloom.config import DEVICE_FORM, DEVICE_TYPES_NAMED
from megaloom.errors import ConfigError

if TYPE_CHECKING:
    from megaloom.config import Config

CPU = "cpu"
CUDA = "cuda"
META = "meta"
_PACKAGES = {"musa": "torch_musa", "npu": "torch_npu"}  # out-of-tree types: importing the package registers them
_VISIBLE = {"cuda": "CUDA_VISIBLE_DEVICES", "xpu": "ZE_AFFINITY_MASK", "musa": "MUSA_VISIBLE_DEVICES",
            "npu": "ASCEND_RT_VISIBLE_DEVICES"}  # the variable that restricts a node's devices of each type

Device = torch.device | str


def kind_of(device: Device) -> str:
    """The device type of a torch.device or of a string such as "cuda:1"."""
    return device.type if isinstance(device, torch.device) else device.partition(":")[0]


# ------------------------------------------------------------------------------------------ which device
def default_type() -> str:
    """What ``train.device=auto`` means here: torch's accelerator when one is available, else cpu."""
    acc = torch.accelerator.current_accelerator()
    return acc.type if acc is not None and torch.accelerator.is_available() else CPU


def is_accelerator(device: Device) -> bool:
    """Anything but the CPU (and meta): a device with its own memory, streams and kernels."""
    return kind_of(device) not in (CPU, META)


def is_cuda(device: Device) -> bool:
    """An NVIDIA (or ROCm) GPU through torch.cuda: the one type whose vendor kernels megaloom calls by name."""
    return kind_of(device) == CUDA


def known(kind: str) -> bool:
    """Whether this torch knows device type ``kind``; an out-of-tree backend's package is imported first (its import
    registers the type, where torch's device-backend autoload has not already)."""
    if kind in _PACKAGES and not hasattr(torch, kind):
        with contextlib.suppress(ImportError):
            importlib.import_module(_PACKAGES[kind])
    try:
        torch.device(kind)
    except RuntimeError:
        return False
    return True


def is_available(kind: str) -> bool:
    """Whether a device of type ``kind`` is visible to this process (its module's ``is_available``)."""
    module = getattr(torch, kind, None)
    return module is not None and hasattr(module, "is_available") and bool(module.is_available())


def device_count(kind: str) -> int:
    """Devices of type ``kind`` visible to this process (0 where torch has no module for it)."""
    module = getattr(torch, kind, None)
    return int(module.device_count()) if module is not None and hasattr(module, "device_count") else 0


def _check_form(spec: str) -> None:
    """auto, cpu or TYPE[:N] (as the config checks it; callers that skip the config meet the same refusal)."""
    if not DEVICE_FORM.fullmatch(spec):
        raise ConfigError(f"train.device: {spec!r} is not auto, cpu, or an accelerator type with an optional index "
                          f"(TYPE or TYPE:N, lower case as torch.device spells it: {DEVICE_TYPES_NAMED}).")


def parse(spec: str) -> tuple[str, int | None]:
    """``train.device`` as (device type, index or None), ``auto`` resolved; ConfigError for a malformed value."""
    _check_form(spec)
    kind, _, index = spec.partition(":")
    return (default_type() if kind == "auto" else kind), (int(index) if index else None)


def check_type(spec: str) -> None:
    """``train.device`` refused where it is malformed or names a type this torch does not know; asks no device
    (`preflight`: auto and cpu need nothing)."""
    _check_form(spec)
    kind = spec.partition(":")[0]
    if kind not in ("auto", CPU) and not known(kind):
        package = f" (install {_PACKAGES[kind]}: its import registers the type)" if kind in _PACKAGES else ""
        raise ConfigError(f"train.device={spec}: this torch ({torch.__version__}) knows no device type {kind!r}"
                          f"{package}; use train.device=auto (here: {default_type()}), cpu, or a type it knows "
                          f"({DEVICE_TYPES_NAMED}).")


def check(spec: str, local_rank: int = 0) -> tuple[str, int | None]:
    """`check_type`, then refused where no such device is visible (or not the one it names), naming the setting
    and the fix: before any process group, data or model exists."""
    check_type(spec)
    kind, index = parse(spec)
    if kind == CPU:
        return kind, index
    if not is_available(kind):
        raise ConfigError(f"train.device={spec} but no {kind} device is visible to this process; use "
                          f"train.device=cpu (or auto: {default_type()} here).")
    wanted, count = (index if index is not None else local_rank), device_count(kind)
    if wanted >= count:
        who = f"{kind}:{index}" if index is not None else f"local rank {local_rank}'s {kind} device"
        raise ConfigError(f"train.device={spec}: {who} does not exist, this process sees {count} {kind} device(s) "
                          f"(0..{count - 1}); use fewer processes per node or a lower index.")
    return kind, index


def pick(spec: str, local_rank: int) -> torch.device:
    """This rank's device, made current: cpu, or the device of its local rank (``:N``'s when given) of the type."""
    kind, index = check(spec, local_rank)
    if kind == CPU:
        return torch.device(CPU)
    device = torch.device(kind, local_rank if index is None else index)
    set_device(device)
    return device


def set_device(device: torch.device) -> None:
    """Make ``device`` this process's current one (its kernels, streams and allocations go there by default);
    initialises the device's runtime, as torch.cuda.set_device did. A device without an index (``cuda``: a
    single-process run) means the current one: torch.accelerator refuses it (found by the offload thread on an
    H100, 2026-12-06)."""
    if device.type == CPU:
        return
    torch.accelerator.set_device_index(device if device.index is not None else torch.accelerator.current_device_index())


def default_device() -> torch.device:
    """The device ``auto`` takes, without choosing an index (a single-process command: generation, calibration)."""
    return torch.device(default_type())


def visible_devices_env(kind: str) -> str | None:
    """The environment variable that restricts which devices of type ``kind`` a node's processes see, if known."""
    return _VISIBLE.get(kind)


# ----------------------------------------------------------------------------------------- which backend
def backend(device: Device) -> str:
    """torch.distributed's default backend for the device's type (torch's map, which out-of-tree backends extend:
    gloo for cpu, nccl for cuda, xccl for xpu); ConfigError where none is registered."""
    kind = kind_of(device)
    found = dist.Backend.default_device_backend_map.get(kind)
    if found is None:
        raise ConfigError(f"train.device={kind}: torch.distributed has no backend registered for {kind!r} devices "
                          "(torch.distributed.Backend.default_device_backend_map); install the backend's package or "
                          "use train.device=cpu.")
    return str(found)


# ------------------------------------------------------------------------------------------- the runtime
def device_module(device: Device) -> ModuleType:
    """The device type's torch module (torch.cuda, torch.xpu, torch.musa, ...): what torch.accelerator lacks."""
    return torch.get_device_module(kind_of(device))


def synchronize(device: Device) -> None:
    """Wait for the work queued on an accelerator device; nothing on CPU (there is no queue)."""
    if is_accelerator(device):
        torch.accelerator.synchronize(device)


def started() -> str | None:
    """The accelerator's type when this process has started its runtime, else None: host-side code (checkpoint
    writers, RNG snapshots) asks first, so that it never starts a device runtime on its own."""
    acc = torch.accelerator.current_accelerator()
    if acc is None or not is_available(acc.type):
        return None
    initialized = getattr(device_module(acc.type), "is_initialized", None)
    return acc.type if initialized is None or initialized() else None


def _memory(name: str, device: Device) -> Callable[..., Any]:
    """torch.accelerator's memory call ``name`` where this torch has it, else the device module's of that name."""
    fn = getattr(torch.accelerator, name, None)
    return fn if fn is not None else getattr(device_module(device), name)


def memory_allocated(device: Device) -> int:
    """Bytes the caching allocator holds for live tensors now."""
    return int(_memory("memory_allocated", device)(device))


def max_memory_allocated(device: Device) -> int:
    """The allocator's peak of live-tensor bytes since the start or the last `reset_peak_memory_stats`."""
    return int(_memory("max_memory_allocated", device)(device))


def memory_reserved(device: Device) -> int:
    """Bytes the caching allocator has reserved from the device (live tensors and its cache)."""
    return int(_memory("memory_reserved", device)(device))


def reset_peak_memory_stats(device: Device) -> None:
    """Start the allocator's peaks afresh (a phase's peak, not the process's)."""
    _memory("reset_peak_memory_stats", device)(device)


def mem_get_info(device: Device) -> tuple[int, int]:
    """(free, total) bytes of the device, as its driver reports them (other processes' use included)."""
    fn = getattr(torch.accelerator, "get_memory_info", None)
    free, total = fn(device) if fn is not None else device_module(device).mem_get_info(device)
    return int(free), int(total)


def total_memory(device: Device) -> int | None:
    """The device's memory in bytes (None on CPU): what the memory plan may fill."""
    if not is_accelerator(device):
        return None
    props = getattr(device_module(device), "get_device_properties", None)
    return int(props(device).total_memory) if props is not None else mem_get_info(device)[1]


def empty_cache() -> None:
    """Give the allocator's cached, unused blocks back to the device (nothing before its runtime has started)."""
    kind = started()
    if kind is not None:
        _memory("empty_cache", kind)()


def device_name(device: Device) -> str:
    """The device's product name (e.g. "NVIDIA H200"), or its type where its module names none (cpu, mps)."""
    if not is_accelerator(device):
        return kind_of(device)
    name = getattr(device_module(device), "get_device_name", None)
    return str(name(device)) if name is not None else kind_of(device)


def pin_memory(device: Device) -> bool:
    """Whether host copies of this device's tensors go to pinned (page-locked) memory, so that the copy can run
    asynchronously: on an accelerator, not on CPU (nothing to copy) nor MPS (memory shared with the host)."""
    return is_accelerator(device) and kind_of(device) != "mps"


def fused_optimizer(device: Device) -> bool:
    """Whether torch has fused AdamW kernels (one launch for all parameters) for the device's type; megaloom keeps
    the foreach implementation on CPU (it always has). torch's own list where this torch exposes it, else CUDA."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # (a private helper: should a torch drop it, CUDA keeps its fused kernel)
        return is_cuda(device)
    return is_accelerator(device) and kind_of(device) in _get_fused_kernels_supported_devices()


def host_fused_optimizer() -> bool:
    """Whether this torch has its fused AdamW kernel for CPU tensors (torch >= 2.4 lists "cpu"): the host step of
    optimizer state offloaded to the host (train.optimizer_offload) uses it, else the foreach implementation."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:
        return False
    return CPU in _get_fused_kernels_supported_devices()


def host_buffer(numel: int, device: Device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A flat host tensor (zeros) that copies to and from ``device`` asynchronously: pinned where the device needs
    it (`pin_memory`), plain memory on CPU (nothing is copied across a bus there)."""
    return torch.zeros(numel, dtype=dtype, pin_memory=pin_memory(device))


def profiler_activity(device: Device) -> Any | None:
    """The torch.profiler activity that records the device's kernels (CUDA, XPU, ..., PrivateUse1 for an
    out-of-tree type), None on CPU or where the profiler has none."""
    from torch.profiler import ProfilerActivity

    kind = kind_of(device)
    if not is_accelerator(kind):
        return None
    if kind == torch._C._get_privateuse1_backend_name():
        return getattr(ProfilerActivity, "PrivateUse1", None)
    return getattr(ProfilerActivity, kind.upper(), None)


def trace_launch_categories() -> tuple[str, ...]:
    """The categories of a profiler trace's host-side launch calls (their ``args.correlation`` names the device
    work they launched): CUDA's runtime and driver API (another accelerator's traces: unverified, likely others)."""
    return ("cuda_runtime", "cuda_driver", "xpu_runtime", "xpu_driver")


# ------------------------------------------------------------------------------------ what the device computes in
def compute_precision(cfg: Config, device: Device) -> str:
    """train.precision with "auto" resolved: bf16 on any accelerator, fp32 on the CPU; any other value as set.

    Decided in one place: the runtime (`megaloom.runtime.resolve_precision`, which adds the refusals of a precision
    the device cannot run), the attention kernel's choice, the speed levers and the memory plan all ask it, so what
    a run computes in and what the plan predicts for it cannot drift apart."""
    p = cfg.train.precision
    return ("bf16" if is_accelerator(device) else "fp32") if p == "auto" else p


_FP32_OUT_GEMM: dict[str, bool] = {}


def fp32_out_gemm(device: torch.device) -> bool:
    """Whether this device runs GEMMs of bf16 inputs with fp32 output, in place into an fp32 accumulator.

    ``torch.mm(a, b, out_dtype=torch.float32)`` and ``torch.addmm(c, a, b, out_dtype=torch.float32, out=c)``: the
    GEMM's epilogue reads and writes the fp32 accumulator, so a sum of products never passes through a bf16 tensor
    and an fp32 add (CUDA in recent PyTorch). Used by the fused head + loss (`models/fused_ce.py`) and by the weight
    gradients fused into the data-parallel buckets (`parallel/grad_fusion.py`); both fall back to the product and
    an add where it is missing. Probed once per device type, on tiny tensors."""
    if device.type not in _FP32_OUT_GEMM:
        try:
            a = torch.ones(16, 16, device=device, dtype=torch.bfloat16)
            c = torch.mm(a, a, out_dtype=torch.float32)
            torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
            _FP32_OUT_GEMM[device.type] = bool(c.dtype == torch.float32 and c[0, 0].item() == 32.0)
        except (RuntimeError, TypeError, NotImplementedError):
            _FP32_OUT_GEMM[device.type] = False
    return _FP32_OUT_GEMM[device.type]


# ------------------------------------------------------------------------------------- streams and events
@dataclass(frozen=True)
class Streams:
    """One accelerator's streams and events: its module's Stream, Event, stream() and current_stream() (on CUDA
    the torch.cuda objects themselves). Made once per user (`streams`), so a step pays no lookup."""

    device: torch.device
    stream_class: Any
    event_class: Any
    use: Callable[[Any], Any]  # context manager: the kernels queued inside run on the given stream
    _current: Callable[[torch.device], Any]

    def new_stream(self) -> Any:
        return self.stream_class(self.device)

    def current(self) -> Any:
        return self._current(self.device)

    def event(self, timing: bool = False) -> Any:
        return self.event_class(enable_timing=timing)


def streams(device: Device) -> Streams | None:
    """The stream API of an accelerator whose module has one (None on CPU, and on MPS, which has no streams)."""
    if not is_accelerator(device):
        return None
    module = device_module(device)
    needed = ("Stream", "Event", "stream", "current_stream")
    if not all(hasattr(module, n) for n in needed):
        return None
    return Streams(torch.device(device), module.Stream, module.Event, module.stream, module.current_stream)


# ------------------------------------------------------------------------------------------------ RNG
@dataclass(frozen=True)
class DeviceRNG:
    """The default generator of one accelerator device, which dropout on its tensors draws from. Holds the type's
    name, not its module: a model that holds this is deep-copied and pickled (a module is neither)."""

    kind: str
    index: int | None

    def fork(self, seed: int) -> tuple[int, torch.Tensor]:
        """Seed the device's generator with ``seed``; returns what `restore` needs to put it back."""
        module = getattr(torch, self.kind)
        index = self.index if self.index is not None else module.current_device()
        state = module.get_rng_state(index)  # (initialises the device's runtime if nothing has yet)
        module.default_generators[index].manual_seed(seed)
        return index, state

    def restore(self, saved: tuple[int, torch.Tensor]) -> None:
        getattr(torch, self.kind).set_rng_state(saved[1], saved[0])


def device_rng(device: Device) -> DeviceRNG | None:
    """The generator to fork beside the CPU's for tensors on ``device`` (None on CPU)."""
    if not is_accelerator(device):
        return None
    device = torch.device(device)
    return DeviceRNG(device.type, device.index)


def rng_states() -> dict[str, torch.Tensor]:
    """The started accelerator's RNG state, keyed by its type ("cuda", as checkpoints have always stored it)."""
    kind = started()
    return {kind: device_module(kind).get_rng_state()} if kind is not None else {}


def set_rng_states(state: dict[str, Any]) -> None:
    """Restore what `rng_states` saved, where this process has that type of device (other keys are ignored)."""
    acc = torch.accelerator.current_accelerator()
    if acc is not None and acc.type in state and is_available(acc.type):
        device_module(acc.type).set_rng_state(state[acc.type])


# ------------------------------------------------------------------------------------ CUDA-only features
def cuda_capability(device: Device) -> tuple[int, int] | None:
    """The compute capability of a CUDA device (FP8, FA4, cuDNN attention and grouped GEMMs ask it); None on any
    other device, whose paths are the portable ones."""
    if not is_cuda(device):
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return int(major), int(minor)


@torch.compiler.assume_constant_result
def _cuda_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def cuda_major(device: torch.device) -> int | None:
    """`cuda_capability`'s major version, a constant to torch.compile (asked inside compiled blocks, where a device
    query would otherwise break the graph); None off CUDA."""
    if not is_cuda(device):
        return None
    return _cuda_major(device.index if device.index is not None else torch.cuda.current_device())
