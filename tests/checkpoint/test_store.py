import json

import pytest
import torch

from megaloom.checkpoint import CheckpointError, find_checkpoints, load_checkpoint, save_checkpoint
from megaloom.checkpoint.store import verify_checkpoint
from megaloom.config import load_config
from megaloom.models import Transformer


def make(seed=0):
    cfg = load_config(None, ["model.vocab_size=64", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
                             "train.seq_len=16", "model.max_seq_len=16"])
    torch.manual_seed(seed)
    m = Transformer(cfg.model)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    x = torch.randint(0, 64, (2, 8))
    m(x, x).backward()
    opt.step()
    return cfg, m, opt


def test_save_load_round_trip_and_latest(tmp_path):
    cfg, m, opt = make()
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        save_checkpoint(root, step, m, opt, {"model": cfg.model.__dict__}, keep=2)
    assert [p.name for p in sorted(root.glob("step_*"))] == ["step_00000003", "step_00000004"]
    assert (root / "latest").read_text().strip() == "step_00000004"
    _, m2, opt2 = make(seed=1)
    state = load_checkpoint(find_checkpoints(root)[0], m2, opt2, model_cfg=cfg.model.__dict__)
    assert state["step"] == 4
    for a, b in zip(m.state_dict().values(), m2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    sa, sb = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"]) for k in sa)


def test_flipped_byte_is_detected_and_previous_used(tmp_path):
    cfg, m, opt = make()
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 1, m, opt, {}, keep=3)
    save_checkpoint(root, 2, m, opt, {}, keep=3)
    shard = next((root / "step_00000002").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt"):
        verify_checkpoint(root / "step_00000002")
    cands = find_checkpoints(root)
    assert cands[0].name == "step_00000002"
    good = None
    for c in cands:
        try:
            verify_checkpoint(c)
            good = c
            break
        except CheckpointError:
            continue
    assert good is not None and good.name == "step_00000001"


def test_partial_save_never_becomes_latest(tmp_path):
    cfg, m, opt = make()
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 1, m, opt, {}, keep=3)
    # a save that died half-way leaves only a .tmp directory: not a candidate, and cleaned by the next save
    (root / ".tmp-step_00000002").mkdir()
    (root / ".tmp-step_00000002" / "__0_0.distcp").write_bytes(b"partial")
    assert [p.name for p in find_checkpoints(root)] == ["step_00000001"]
    save_checkpoint(root, 3, m, opt, {}, keep=3)
    assert not (root / ".tmp-step_00000002").exists()


def test_incompatible_shape_is_refused(tmp_path):
    cfg, m, opt = make()
    root = tmp_path / "checkpoints"
    path = save_checkpoint(root, 1, m, opt, {"model": cfg.model.__dict__}, keep=3)
    other = dict(cfg.model.__dict__, d_model=48)
    with pytest.raises(CheckpointError, match="model.d_model"):
        load_checkpoint(path, m, opt, model_cfg=other)


def test_missing_manifest_is_incomplete(tmp_path):
    cfg, m, opt = make()
    path = save_checkpoint(tmp_path / "c", 1, m, opt, {}, keep=3)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        verify_checkpoint(path)
    json.dumps({})
