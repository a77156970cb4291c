"""A forged DCP .metadata (a pickle that would run code) with a rehashed manifest is refused on load, in one clear
error, and its code never runs; real checkpoints still load."""

import json
import os
import pickle

import pytest
import torch

from megaloom.checkpoint import CheckpointError, load_checkpoint, load_newest, save_checkpoint
from megaloom.checkpoint.safe_metadata import check_metadata
from megaloom.checkpoint.store import MANIFEST, NoUsableCheckpoint, _sha256
from tests.checkpoint.test_store import make


class _RunsCode:
    """Unpickling this calls os.system: what a forged checkpoint would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _rehash(ckpt):
    """What a forger does after replacing files: the manifest's checksums made to match again."""
    manifest = json.loads((ckpt / MANIFEST).read_text())
    for name in manifest:
        f = ckpt / name
        manifest[name] = {"sha256": _sha256(f), "bytes": f.stat().st_size}
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


def _forge(ckpt, payload):
    (ckpt / ".metadata").write_bytes(pickle.dumps(payload))
    _rehash(ckpt)


@pytest.mark.parametrize("wrap", ["bare", "inside_metadata"])
def test_forged_metadata_is_refused_and_never_runs(tmp_path, wrap):
    cfg, m, opt = make()
    root = tmp_path / "checkpoints"
    path = save_checkpoint(root, 1, m, opt, {"model": cfg.model.__dict__}, keep=3)
    marker = tmp_path / "PWNED"
    payload = _RunsCode(marker)
    if wrap == "inside_metadata":  # the real metadata with the payload hidden in one of its fields
        with open(path / ".metadata", "rb") as f:
            md = pickle.load(f)  # our own, just written: trusted here
        md.planner_data = {"x": payload}
        payload = md
    _forge(path, payload)
    _, m2, opt2 = make(seed=1)
    with pytest.raises(CheckpointError, match=r"refused to load: it names posix\.system"):
        load_checkpoint(path, m2, opt2, model_cfg=cfg.model.__dict__)
    assert not marker.exists()
    # resume=auto: the forged checkpoint is refused with that reason (the only one: no silent fresh start over
    # it), never executed
    with pytest.raises(NoUsableCheckpoint, match=r"refused to load: it names posix\.system"):
        load_newest(root, m2, opt2, model_cfg=cfg.model.__dict__, warn=lambda _: None)
    assert not marker.exists()


def test_metadata_pointing_outside_the_checkpoint_is_refused(tmp_path):
    cfg, m, opt = make()
    path = save_checkpoint(tmp_path / "c", 1, m, opt, {}, keep=3)
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)
    info = next(iter(md.storage_data.values()))
    info.relative_path = "../../etc/passwd"
    _forge(path, md)
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        check_metadata(path)


def test_real_checkpoints_pass_the_allow_list(tmp_path):
    cfg, m, opt = make()
    path = save_checkpoint(tmp_path / "c", 1, m, opt, {}, keep=3)
    md = check_metadata(path)
    assert "model.tok_emb.weight" in md.state_dict_metadata
    _, m2, opt2 = make(seed=1)
    load_checkpoint(path, m2, opt2)
    for a, b in zip(m.state_dict().values(), m2.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_non_tensor_values_are_read_without_arbitrary_unpickling(tmp_path):
    """DCP stores non-tensor state values as pickled bytes and its default planner unpickles them with
    weights_only=False; ours must refuse code there too (the metadata decides which entries are bytes)."""
    import torch.distributed.checkpoint as dcp

    from megaloom.checkpoint.safe_metadata import SafeLoadPlanner, safe_load

    ckpt = tmp_path / "b"
    dcp.save({"x": torch.ones(2), "note": "hello"}, checkpoint_id=str(ckpt), no_dist=True)
    back = {"x": torch.zeros(2), "note": None}
    safe_load(back, ckpt, SafeLoadPlanner(), no_dist=True)
    assert back["note"] == "hello" and torch.equal(back["x"], torch.ones(2))
    marker = tmp_path / "PWNED"
    evil = tmp_path / "evil"
    dcp.save({"x": torch.ones(2), "note": _RunsCode(marker)}, checkpoint_id=str(evil), no_dist=True)
    assert not marker.exists()  # saving pickles, it does not run
    with pytest.raises(CheckpointError, match=r"note: refused to unpickle \(Trying to load unsupported GLOBAL "
                                              r"posix\.system"):
        safe_load({"x": torch.zeros(2), "note": None}, evil, SafeLoadPlanner(), no_dist=True)
    assert not marker.exists()
