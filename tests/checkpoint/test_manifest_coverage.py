"""The manifest must cover every file that loading reads (issue 19, fault 8): an emptied manifest, or an RNG file
the manifest does not list, fails verification instead of being loaded unchecked."""

import json

import pytest
import torch

from megaloom.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from megaloom.checkpoint.store import verify_checkpoint
from tests.checkpoint.test_store import make


@pytest.fixture
def ckpt(tmp_path):
    cfg, m, opt = make()
    return save_checkpoint(tmp_path / "c", 1, m, opt, {"model": cfg.model.__dict__}, keep=3), m, opt


def test_a_complete_checkpoint_verifies(ckpt):
    path, _, _ = ckpt
    assert verify_checkpoint(path)["step"] == 1


def test_an_empty_manifest_fails(ckpt):
    path, _, _ = ckpt
    (path / "manifest.json").write_text("{}")
    with pytest.raises(CheckpointError, match="does not list state.json, .metadata"):
        verify_checkpoint(path)


def test_an_unlisted_rng_file_fails_and_is_never_loaded(ckpt, monkeypatch):
    path, m, opt = ckpt
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["rng_rank0.pt"]  # a forged or damaged manifest: the file would be read unchecked
    (path / "manifest.json").write_text(json.dumps(manifest))
    loaded = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: loaded.append(a) or {})
    with pytest.raises(CheckpointError, match="rng_rank0.pt are not in its manifest"):
        load_checkpoint(path, m, opt)
    assert not loaded


def test_an_added_file_fails(ckpt):
    path, _, _ = ckpt
    torch.save({"torch": torch.get_rng_state()}, path / "rng_rank1.pt")
    with pytest.raises(CheckpointError, match="rng_rank1.pt are not in its manifest"):
        verify_checkpoint(path)


def test_a_manifest_of_the_wrong_shape_fails(ckpt):
    path, _, _ = ckpt
    (path / "manifest.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="corrupt"):
        verify_checkpoint(path)
