from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

import megaloom.data.corpus as corpus
from megaloom.config import DataConfig
from megaloom.data.corpus import cache_root, default_corpus_files, prepare_default
from megaloom.data.dataset import build_datasets
from megaloom.data.indexed import IndexedTokens
from megaloom.data.tokenizer import Tokenizer


def test_default_corpus_is_the_stdlib() -> None:
    files = default_corpus_files()
    assert len(files) > 50 and files == sorted(files)
    assert all(f.suffix == ".py" for f in files)


def test_cache_root_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MEGALOOM_CACHE", str(tmp_path / "env"))
    assert cache_root(str(tmp_path / "cfg")) == tmp_path / "cfg"
    assert cache_root("") == tmp_path / "env"
    monkeypatch.delenv("MEGALOOM_CACHE")
    assert cache_root("") == Path.home() / ".cache" / "megaloom"


@pytest.fixture
def small_corpus(monkeypatch: pytest.MonkeyPatch, text_dir: Path) -> list[Path]:
    files = sorted(text_dir.glob("*.txt"))
    monkeypatch.setattr(corpus, "default_corpus_files", lambda: files)
    return files


def test_prepare_default_builds_once(small_corpus: list[Path], tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    tok_path, prefix = prepare_default(tmp_path, vocab_size=300, workers=1)
    assert "building the default corpus" in capsys.readouterr().err
    assert tok_path.parent.name.startswith("default-corpus-")
    assert Tokenizer.from_file(tok_path).vocab_size == 300
    assert IndexedTokens(prefix).n_docs == len(small_corpus)
    mtime = Path(prefix + ".bin").stat().st_mtime_ns

    assert prepare_default(tmp_path, vocab_size=300) == (tok_path, prefix)
    assert capsys.readouterr().err == ""
    assert Path(prefix + ".bin").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [tok_path.parent.name], "no temporary folders left"
    # A different vocabulary is a different cache entry.
    assert prepare_default(tmp_path, vocab_size=290)[0].parent != tok_path.parent


def test_prepare_default_lost_race_uses_winner(small_corpus: list[Path], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    real_rename = corpus.os.rename

    def racing_rename(src: str, dst: str) -> None:
        shutil.copytree(src, dst)  # another rank finishes first...
        (Path(dst) / "winner").touch()
        real_rename(src, dst)  # ...so this rename fails

    monkeypatch.setattr(corpus.os, "rename", racing_rename)
    tok_path, prefix = prepare_default(tmp_path, vocab_size=300, workers=1)
    assert (tok_path.parent / "winner").exists()
    assert IndexedTokens(prefix).n_tokens > 0
    assert len(list(tmp_path.iterdir())) == 1


def test_build_datasets_on_default_corpus(small_corpus: list[Path],
                                          make_cfg: Callable[..., DataConfig]) -> None:
    cfg = make_cfg(paths=[], tokenizer="", default_vocab_size=300)
    train, valid, tok = build_datasets(cfg, 16, seed=0, n_train=50, n_valid=5)
    assert (len(train), len(valid), tok.vocab_size) == (50, 5, 300)
    assert Path(train.datasets[0].base.tokens.prefix).is_relative_to(cfg.cache_dir)


def test_default_corpus_tokenizer_setting(small_corpus: list[Path], make_cfg: Callable[..., DataConfig],
                                          tmp_path: Path) -> None:
    from megaloom.data.errors import DataError

    # A resumed run's saved config names the default tokenizer (possibly a copy of it): accepted.
    _, _, tok = build_datasets(make_cfg(paths=[], tokenizer="", default_vocab_size=300), 16, 0, 10, 2)
    copy = tmp_path / "copy.json"
    shutil.copy(tok.path, copy)
    for named in (tok.path, copy):
        cfg = make_cfg(paths=[], tokenizer=str(named), default_vocab_size=300)
        assert build_datasets(cfg, 16, 0, 10, 2)[2].vocab_size == 300
    # Any other tokenizer cannot have produced the default corpus tokens.
    with pytest.raises(DataError, match=r"data\.tokenizer is set"):
        build_datasets(make_cfg(paths=[], default_vocab_size=290), 16, 0, 10, 2)
