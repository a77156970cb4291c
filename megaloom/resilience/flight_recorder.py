"""torch's flight recorder and NCCL's error handling, set up before the process group starts.

The flight recorder is a ring buffer of the last collectives each process group issued (group, sequence
number, op, sizes, and on NCCL whether each has started and completed on the device, discovered by NCCL's own
watchdog thread, so it costs the training loop nothing). megaloom turns it on for every multi-rank run and
reads it in two places:
- megaloom's watchdog (watchdog.py), when it fires, dumps it as JSON next to its report and names the oldest
  collective that has not finished: on GPUs that is the device's view, not the host's "issued".
- NCCL's own timeout (`resilience.collective_timeout_s`, later than the watchdog) dumps it too
  (TORCH_NCCL_DUMP_ON_TIMEOUT) to run.dir/watchdog/flight_recorder_rank<N>, for runs with the watchdog off.
`python -m torch.distributed.flight_recorder.fr_trace` reads the latter across ranks.

Environment variables are only set where the user has not set them, under the names of torch >= 2.8 (megaloom
needs 2.11; setting the deprecated TORCH_NCCL_TRACE_BUFFER_SIZE / TORCH_NCCL_DEBUG_INFO_TEMP_FILE too would print a
deprecation warning on every rank). Those older names, when the user sets them, are respected and left alone.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

TRACE_ENTRIES = 2000  # collectives remembered per process; ~a few hundred bytes each


def configure(run_dir: str | Path) -> dict[str, str]:
    """Set the flight-recorder and NCCL error-handling environment (unless set); returns what was set.

    Must run before the first process group is created: torch reads these once."""
    out = Path(run_dir).absolute() / "watchdog"  # NCCL's thread writes there, whatever the cwd is by then
    out.mkdir(parents=True, exist_ok=True)
    wanted = {
        # 3 = on a collective error or timeout, NCCL's watchdog ends the process without a communicator abort
        # that can itself hang (torch's default; set so that no inherited 0 disables it)
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": ("3", ()),
        "TORCH_FR_BUFFER_SIZE": (str(TRACE_ENTRIES), ("TORCH_NCCL_TRACE_BUFFER_SIZE",)),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": ("1", ()),
        "TORCH_FR_DUMP_TEMP_FILE": (str(out / "flight_recorder_rank"), ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE",)),
    }
    done = {}
    for key, (value, aliases) in wanted.items():
        if key not in os.environ and not any(a in os.environ for a in aliases):
            os.environ[key] = done[key] = value
    return done


def _dumpers() -> list[tuple[str, object]]:
    """The flight recorders this torch build has: NCCL's (CUDA builds) and the generic one (gloo)."""
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError:
        return []
    found = []
    for kind, name in (("nccl", "_dump_nccl_trace_json"), ("gloo", "_dump_fr_trace_json")):
        fn = getattr(c10d, name, None)
        if fn is not None:
            found.append((kind, fn))
    return found


def dump(out_dir: Path, rank: int) -> list[tuple[Path, dict]]:
    """Write each flight recorder's entries as JSON into ``out_dir``; returns (path, parsed dump) pairs.

    Safe from a side thread while the main thread is stuck in a collective (the recorder has its own lock).
    A recorder that is off (no entries) or fails is skipped: the watchdog's report must not depend on it."""
    written = []
    for kind, fn in _dumpers():
        try:
            data = json.loads(fn())
        except Exception:  # noqa: BLE001 -- best effort inside a fault report
            continue
        if not data.get("entries"):
            continue
        path = Path(out_dir) / f"flight_recorder_{kind}_rank{rank}-{int(time.time())}.json"
        path.write_text(json.dumps(data))
        written.append((path, data))
    return written


def unfinished(data: dict) -> list[dict]:
    """Entries not yet retired (NCCL: not completed on the device; gloo: not returned), oldest first."""
    entries = [e for e in data.get("entries", []) if not e.get("retired", True)]
    return sorted(entries, key=lambda e: e.get("time_created_ns", 0))


def describe_entry(e: dict, now_ns: int | None = None) -> str:
    pg = e.get("process_group") or ["?", "?"]
    age = ""
    if e.get("time_created_ns"):
        age = f", issued {((now_ns or time.time_ns()) - e['time_created_ns']) / 1e9:.1f}s ago"
    return (f"{e.get('profiling_name', '?')} #{e.get('collective_seq_id', '?')} of group {pg[0]} ({pg[1]}), "
            f"state {e.get('state', '?')}{age}")


def summary(path: Path, data: dict) -> list[str]:
    """Lines for the watchdog's report: what the flight recorder says this rank is waiting for."""
    late = unfinished(data)
    lines = [f"flight recorder dump: {path} ({len(data.get('entries', []))} entries)"]
    if late:
        lines.append(f"  oldest unfinished collective: {describe_entry(late[0])}"
                     + (f" (+{len(late) - 1} more unfinished)" if len(late) > 1 else ""))
    else:
        lines.append("  every recorded collective has finished (the rank is stuck outside collectives)")
    return lines
