"""Every checkpoint damaged (issue 19, fault 2): the run refuses to start, names the directory and the fix, and
leaves the checkpoints as they were (no silent restart from step 0 that overwrites them)."""

import hashlib

import pytest

from megaloom.checkpoint.store import NoUsableCheckpoint
from megaloom.cli import main
from megaloom.config import load_config
from megaloom.train import train
from tests.conftest import tiny_overrides

BASE = ["train.steps=8", "checkpoint.every=4", "checkpoint.async_save=false"]


def _digest(root) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_all_checkpoints_damaged_refuses_to_start_and_overwrites_nothing(small_corpus, tmp_path, capsys):
    run = tmp_path / "r"
    train(load_config(None, tiny_overrides(small_corpus, run, *BASE)))
    ckpts = run / "checkpoints"
    shards = sorted(ckpts.glob("step_*/*.distcp"))
    assert len({s.parent for s in shards}) == 2
    for shard in shards:  # one flipped byte in every shard of every checkpoint
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    before, metrics = _digest(ckpts), (run / "metrics.jsonl").read_text()
    capsys.readouterr()

    with pytest.raises(NoUsableCheckpoint) as err:
        train(load_config(None, tiny_overrides(small_corpus, run, *BASE, "train.steps=12")))
    msg = str(err.value)
    assert str(ckpts) in msg and "checkpoint.resume=none" in msg and "none of the 2 checkpoint(s)" in msg
    out = capsys.readouterr().out
    # the fallback warning names the checkpoint it falls back to, and is not given for the last one
    assert out.count("Falling back") == 1 and "(step_00000004)" in out
    assert _digest(ckpts) == before and (run / "metrics.jsonl").read_text() == metrics

    rc = main(["train", *tiny_overrides(small_corpus, run, *BASE, "train.steps=12")])
    err_text = capsys.readouterr().err
    assert rc == 2 and "megaloom: error: none of the 2 checkpoint(s)" in err_text and "Traceback" not in err_text
    assert _digest(ckpts) == before
