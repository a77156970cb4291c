"""Token files remember their tokenizer; training them with another one stops before any work (issue 24, 2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megaloom.cli import main
from megaloom.data.dataset import build_datasets
from megaloom.data.errors import DataError
from megaloom.data.provenance import provenance_path, tokenizer_sha256
from megaloom.data.tokenizer import train_bpe


@pytest.fixture(scope="module")
def other_tokenizer(text_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second tokenizer with a LARGER vocabulary than the one that made the token files: the old vocab-size
    check (token file vocab > tokenizer vocab) let exactly this through."""
    out = tmp_path_factory.mktemp("tok2") / "tokenizer.json"
    return train_bpe(sorted(text_dir.glob("*.txt")), 400, out, show_progress=False)


def test_preprocess_records_its_tokenizer(tokens_prefix, tokenizer_path):
    record = json.loads(provenance_path(tokens_prefix).read_text())
    assert record["tokenizer_sha256"] == tokenizer_sha256(tokenizer_path)
    assert record["vocab_size"] == 300
    assert Path(record["tokenizer_path"]) == Path(tokenizer_path).resolve()


def test_the_same_tokenizer_is_accepted(make_cfg):
    train, _, tok = build_datasets(make_cfg(), seq_len=16, seed=0, n_train=4, n_valid=1)
    assert len(train) == 4 and tok.vocab_size == 300


def test_another_tokenizer_is_refused_naming_both(make_cfg, other_tokenizer, tokenizer_path):
    with pytest.raises(DataError, match="different tokenizer") as e:
        build_datasets(make_cfg(tokenizer=str(other_tokenizer)), seq_len=16, seed=0, n_train=4, n_valid=1)
    assert str(Path(tokenizer_path).resolve()) in str(e.value) and "(vocab 300)" in str(e.value)


def test_token_files_without_the_record_keep_the_header_check(make_cfg, other_tokenizer, tokens_prefix, tmp_path):
    prefix = tmp_path / "copy"
    for ext in (".bin", ".idx"):
        shutil.copy(tokens_prefix + ext, str(prefix) + ext)
    train, _, _ = build_datasets(make_cfg(paths=[str(prefix)], tokenizer=str(other_tokenizer)), seq_len=16,
                                 seed=0, n_train=4, n_valid=1)
    assert len(train) == 4


def test_a_damaged_record_is_a_clear_error(make_cfg, tokens_prefix, tmp_path):
    prefix = tmp_path / "copy"
    for ext in (".bin", ".idx"):
        shutil.copy(tokens_prefix + ext, str(prefix) + ext)
    provenance_path(prefix).write_text("{not json")
    with pytest.raises(DataError, match="tokenizer.json.*unreadable"):
        build_datasets(make_cfg(paths=[str(prefix)]), seq_len=16, seed=0, n_train=4, n_valid=1)


def test_cli_refuses_before_any_work(tokens_prefix, other_tokenizer, tmp_path, capsys):
    run = tmp_path / "run"
    code = main(["train", f"data.paths={tokens_prefix}", f"data.tokenizer={other_tokenizer}", f"run.dir={run}",
                 "model.preset=tiny", "train.steps=2", "train.device=cpu"])
    assert code == 2
    assert "different tokenizer" in capsys.readouterr().err
    assert not (run / "checkpoints").exists()
