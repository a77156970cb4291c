"""Asynchronous two-stage saving: same files as the blocking save, a consistent snapshot, crash safety."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import megaloom
from megaloom.checkpoint import CheckpointError, find_checkpoints, load_checkpoint, save_checkpoint
from megaloom.checkpoint import async_save as async_mod
from megaloom.checkpoint.async_save import AsyncCheckpointer
from megaloom.checkpoint.store import PAUSE_ENV, verify_checkpoint
from megaloom.config import load_config
from megaloom.models import Transformer

SETTINGS = ["model.vocab_size=64", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
            "train.seq_len=16", "model.max_seq_len=16"]


def make(seed: int = 0, *extra: str):
    cfg = load_config(None, [*SETTINGS, *extra])
    torch.manual_seed(seed)
    model = Transformer(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, opt)
    return cfg, model, opt


def step(model, opt) -> None:
    x = torch.randint(0, model.cfg.vocab_size, (2, 8))
    model(x, x).backward()
    opt.step()
    opt.zero_grad()


def snapshot(model, opt) -> tuple[dict, dict]:
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()})


def assert_same(model, opt, expected: tuple[dict, dict]) -> None:
    sd, st = snapshot(model, opt)
    for k, v in expected[0].items():
        assert torch.equal(sd[k], v), k
    for i, s in expected[1].items():
        for k, v in s.items():
            assert torch.equal(st[i][k], v), (i, k)


def test_async_save_then_load_is_the_state_at_save_time(tmp_path):
    cfg, model, opt = make()
    root = tmp_path / "checkpoints"
    ckpt = AsyncCheckpointer()
    at_save = snapshot(model, opt)
    record = ckpt.save(root, 1, model, opt, {"model": cfg.model.__dict__}, keep=2)
    for _ in range(2):  # training goes on while the writer thread works
        step(model, opt)
    done = ckpt.wait()
    assert done is record and record.write_s is not None and record.stall_s >= 0
    assert (root / "latest").read_text().strip() == "step_00000001"
    # CPU state is written where it lives: only the step counters are copied to host buffers
    assert record.in_place and 0 < ckpt.host_buffer_bytes < 1024

    _, model2, opt2 = make(seed=1)
    state = load_checkpoint(find_checkpoints(root)[0], model2, opt2, model_cfg=cfg.model.__dict__)
    assert state["step"] == 1 and state["has_optimizer_state"] is True
    assert_same(model2, opt2, at_save)


def test_an_update_during_an_in_place_write_waits_for_it(tmp_path, monkeypatch):
    """Host-resident state is written in place, not copied: the optimizer's next update (the only thing that
    changes it) starts only once the write is done, so the checkpoint is the state at save time."""
    cfg, model, opt = make()
    root = tmp_path / "checkpoints"
    real_write = async_mod.write_tensors
    events = []

    def slow_write(*args, **kwargs):
        time.sleep(0.3)
        real_write(*args, **kwargs)
        events.append("written")

    monkeypatch.setattr(async_mod, "write_tensors", slow_write)
    ckpt = AsyncCheckpointer()
    at_save = snapshot(model, opt)
    x = torch.randint(0, model.cfg.vocab_size, (2, 8))
    model(x, x).backward()
    record = ckpt.save(root, 1, model, opt, {"model": cfg.model.__dict__}, keep=2)
    opt.register_step_pre_hook(lambda *_: events.append("update"))  # runs after the save's own hook
    opt.step()
    assert events == ["written", "update"] and record.in_place and record.update_wait_s > 0, (events, record)
    step(model, opt)
    ckpt.wait()
    _, model2, opt2 = make(seed=1)
    load_checkpoint(find_checkpoints(root)[0], model2, opt2, model_cfg=cfg.model.__dict__)
    assert_same(model2, opt2, at_save)
    ckpt.save(root, 2, model, opt, {}, keep=2)
    ckpt.wait()
    assert len(opt._optimizer_step_pre_hooks) == 1  # each save's hook goes with its write (the test's stays)


def test_async_files_match_the_blocking_layout_and_buffers_are_reused(tmp_path):
    cfg, model, opt = make()
    save_checkpoint(tmp_path / "blocking", 1, model, opt, {}, keep=3)
    ckpt = AsyncCheckpointer()
    for s in (1, 2, 3):
        ckpt.save(tmp_path / "async", s, model, opt, {}, keep=2)
    ckpt.wait()
    names = sorted(p.name for p in (tmp_path / "blocking" / "step_00000001").iterdir())
    assert sorted(p.name for p in (tmp_path / "async" / "step_00000003").iterdir()) == names
    assert [p.name for p in find_checkpoints(tmp_path / "async")] == ["step_00000003", "step_00000002"]
    assert len(ckpt.history) == 3 and all(r.write_s is not None for r in ckpt.history)


def test_stall_and_blocking_save_times_are_recorded(tmp_path, record_property):
    # A model whose write dominates (about 12 MB with the optimizer state): the loop only pays for the copy.
    cfg, model, opt = make(0, "model.d_model=128", "model.n_layers=2", "model.vocab_size=4096")
    t0 = time.perf_counter()
    save_checkpoint(tmp_path / "blocking", 1, model, opt, {}, keep=1)
    blocking_s = time.perf_counter() - t0
    ckpt = AsyncCheckpointer()
    ckpt.save(tmp_path / "async", 1, model, opt, {}, keep=1)  # first save allocates the host buffers
    ckpt.wait()
    record = ckpt.save(tmp_path / "async", 2, model, opt, {}, keep=1)
    ckpt.wait()
    record_property("blocking_save_s", round(blocking_s, 4))
    record_property("async_stall_s", round(record.stall_s, 4))
    record_property("async_write_s", round(record.write_s, 4))
    print(f"\nblocking save {blocking_s:.3f}s; async stall {record.stall_s:.3f}s + background write "
          f"{record.write_s:.3f}s ({ckpt.host_buffer_bytes / 2**20:.0f} MiB host buffers)")
    assert record.write_s > 0


def test_write_failure_is_raised_by_the_next_call_and_latest_is_kept(tmp_path, monkeypatch):
    cfg, model, opt = make()
    root = tmp_path / "checkpoints"
    ckpt = AsyncCheckpointer()
    ckpt.save(root, 1, model, opt, {}, keep=3)
    ckpt.wait()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(async_mod, "commit_save", full_disk)
    ckpt.save(root, 2, model, opt, {}, keep=3)
    with pytest.raises(CheckpointError, match="No space left"):
        ckpt.wait()
    assert (root / "latest").read_text().strip() == "step_00000001"
    assert [p.name for p in find_checkpoints(root)] == ["step_00000001"]


def test_flipped_byte_in_async_checkpoint_falls_back(tmp_path):
    cfg, model, opt = make()
    root = tmp_path / "checkpoints"
    ckpt = AsyncCheckpointer()
    ckpt.save(root, 1, model, opt, {}, keep=3)
    at_step1 = snapshot(model, opt)
    step(model, opt)
    ckpt.save(root, 2, model, opt, {}, keep=3)
    ckpt.wait()
    shard = next((root / "step_00000002").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    _, model2, opt2 = make(seed=3)
    loaded = None
    for cand in find_checkpoints(root):  # what the trainer's resume=auto does
        try:
            loaded = load_checkpoint(cand, model2, opt2)
            break
        except CheckpointError as e:
            assert "corrupt" in str(e) and "step_00000002" in str(e)
    assert loaded is not None and loaded["step"] == 1
    assert_same(model2, opt2, at_step1)


WRITER = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from megaloom.checkpoint.async_save import AsyncCheckpointer
    from megaloom.config import load_config
    from megaloom.models import Transformer
    cfg = load_config(None, sys.argv[2:])
    model = Transformer(cfg.model)
    opt = torch.optim.AdamW(model.parameters())
    ckpt = AsyncCheckpointer()
    ckpt.save(Path(sys.argv[1]), 2, model, opt, {}, keep=3)
    ckpt.wait()  # the writer thread pauses before committing: the test kills the process there
""")


def test_writer_killed_mid_save_leaves_previous_checkpoint_and_latest(tmp_path):
    cfg, model, opt = make()
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 1, model, opt, {}, keep=3)
    at_step1 = snapshot(model, opt)
    # A fresh interpreter, as a real training process (forking this one is unsafe once CUDA or threads exist).
    repo = str(Path(megaloom.__file__).resolve().parent.parent)
    env = {**os.environ, PAUSE_ENV: "60", "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root), *SETTINGS], env=env)
    tmp = root / ".tmp-step_00000002"
    try:
        deadline = time.monotonic() + 60
        while not (tmp.is_dir() and any(tmp.glob("*.distcp")) and (tmp / ".metadata").exists()):
            assert proc.poll() is None, "the writer process exited before it was killed"
            assert time.monotonic() < deadline, "the writer never started writing"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)  # mid-save: tensors written, nothing committed
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert tmp.is_dir()  # the partial save is left behind ...
    assert [p.name for p in find_checkpoints(root)] == ["step_00000001"]  # ... but is no candidate
    assert (root / "latest").read_text().strip() == "step_00000001"
    verify_checkpoint(root / "step_00000001")
    _, model2, opt2 = make(seed=5)
    assert load_checkpoint(find_checkpoints(root)[0], model2, opt2)["step"] == 1
    assert_same(model2, opt2, at_step1)
    AsyncCheckpointer().save(root, 3, model, opt, {}, keep=3)  # the next save removes the leftover
    assert not tmp.exists()
