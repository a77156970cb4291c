"""`megaloom preprocess` from Parquet files and Hugging Face datasets on disk, the text in a named column; the
optional packages imported only for such inputs, and every refusal before anything is tokenized."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

import megaloom.data.tabular as tabular
from megaloom.cli import _add_preprocess
from megaloom.data.errors import DataError
from megaloom.data.indexed import IndexedTokens
from megaloom.data.preprocess import iter_documents, preprocess
from megaloom.data.tokenizer import Tokenizer

TEXTS = ["first row ✓", None, "second\nrow", "", "third row, the last"]  # null and empty rows are skipped
KEPT = [TEXTS[0], TEXTS[2], TEXTS[4]]


def decoded(prefix: Path, tokenizer_path: Path) -> list[str]:
    tok, t = Tokenizer.from_file(tokenizer_path), IndexedTokens(prefix)
    return [tok.decode(t.doc(i).tolist()[:-1]) for i in range(t.n_docs)]


def preprocess_command(*argv: str) -> int:
    """`megaloom preprocess ARGV` (its parser alone: the full CLI's would import torch for `convert`)."""
    parser = argparse.ArgumentParser(prog="megaloom")
    _add_preprocess(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["preprocess", *argv])
    return args.fn(args)


def parquet_file(path: Path, **columns) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table(columns), str(path), row_group_size=2)  # several row groups
    return path


def test_parquet_rows_in_a_named_column(tmp_path: Path, tokenizer_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tabular, "BATCH_ROWS", 2)  # batches within and across row groups
    src = parquet_file(tmp_path / "shard.parquet", id=list(range(5)), content=TEXTS)
    # the CLI's --text-column, two workers (the pool forks after pyarrow has read the first batch)
    assert preprocess_command(str(src), "--tokenizer", str(tokenizer_path), "--out", str(tmp_path / "out"),
                              "--text-column", "content", "--workers", "2") == 0
    assert decoded(tmp_path / "out", tokenizer_path) == KEPT
    # a folder contributes its .parquet files, sorted, beside its text files
    parquet_file(tmp_path / "b.parquet", content=["from b"])
    (tmp_path / "a.txt").write_text("from a")
    assert list(iter_documents([str(tmp_path)], "content")) == ["from a", "from b", *KEPT]


def test_parquet_refusals_come_before_any_tokenizing(tmp_path: Path, tokenizer_path: Path) -> None:
    src = parquet_file(tmp_path / "s.parquet", body=["a", "b"], n=[1, 2])
    (tmp_path / "first.txt").write_text("tokenized first if the check came late")
    with pytest.raises(DataError, match=r"s\.parquet has no column 'text' \(its columns: body, n\); set --text-column"):
        preprocess([str(tmp_path / "first.txt"), str(src)], tokenizer_path, tmp_path / "out", workers=1,
                   show_progress=False)
    assert not list(tmp_path.glob("out*"))
    with pytest.raises(DataError, match=r"row 0: column 'n' holds int, expected text"):
        list(iter_documents([str(src)], "n"))


def test_a_missing_optional_package_is_one_line_naming_the_extra(tmp_path: Path, monkeypatch) -> None:
    """Runs without pyarrow or datasets installed: the import is refused on purpose."""
    def no_module(name: str):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(tabular.importlib, "import_module", no_module)
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    with pytest.raises(DataError, match=r"needs the optional package pyarrow .*pip install 'megaloom\[parquet\]'"):
        iter_documents([str(tmp_path / "x.parquet")])
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "dataset_dict.json").write_text("{}")
    with pytest.raises(DataError, match=r"needs the optional package datasets .*'megaloom\[hf\]'"):
        iter_documents([str(saved)])


def test_a_dataset_dict_without_a_split_is_refused_naming_its_splits(tmp_path: Path, monkeypatch) -> None:
    """Several splits and no --split: one line naming them and the flag, before datasets is imported (issue 46:
    the 'train' default read one silently); one split alone is read; a split it lacks is refused. Built by hand:
    the folder save_to_disk writes for a DatasetDict, its dataset_dict.json listing the splits."""
    import json

    imported = []

    def no_module(name: str):
        imported.append(name)
        raise ImportError(f"No module named {name!r}")
    monkeypatch.setattr(tabular.importlib, "import_module", no_module)
    both = tmp_path / "dict"
    for name in ("train", "test"):
        (both / name).mkdir(parents=True)
        (both / name / "state.json").write_text("{}")
        (both / name / "dataset_info.json").write_text("{}")
    (both / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(DataError) as e:
        iter_documents([str(both)], "body")
    line = str(e.value)
    assert "\n" not in line and "2 splits (test, train)" in line and "--split test" in line, line
    assert not imported
    with pytest.raises(DataError, match=r"without a 'validation' split \(it has \['test', 'train'\]\); .*--split"):
        iter_documents([str(both)], "body", split="validation")
    assert tabular.choose_split(both, "test") == "test"
    parser = argparse.ArgumentParser()  # the CLI passes no split unless given
    _add_preprocess(parser.add_subparsers(dest="command", required=True))
    assert parser.parse_args(["preprocess", str(both), "--tokenizer", "t", "--out", "o"]).split is None
    one = tmp_path / "one"
    (one / "train").mkdir(parents=True)
    (one / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    assert tabular.choose_split(one, None) == "train"
    with pytest.raises(DataError, match=r"needs the optional package datasets"):  # then datasets reads it
        iter_documents([str(one)], "body")

def test_hf_datasets_saved_to_disk(tmp_path: Path, tokenizer_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    single = tmp_path / "single"
    datasets.Dataset.from_dict({"text": TEXTS, "n": list(range(5))}).save_to_disk(str(single))
    preprocess([str(single)], tokenizer_path, tmp_path / "one", workers=1, show_progress=False)
    assert decoded(tmp_path / "one", tokenizer_path) == KEPT
    # a datasets .arrow file named on its own
    (arrow,) = single.glob("*.arrow")
    assert list(iter_documents([str(arrow)])) == KEPT
    # a DatasetDict: --split picks the split; a missing one is refused, naming those there are
    both = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": ["train doc"]}),
                          "test": datasets.Dataset.from_dict({"body": ["test doc"]})}).save_to_disk(str(both))
    assert list(iter_documents([str(both)], "body", split="test")) == ["test doc"]
    with pytest.raises(DataError, match=r"without a 'validation' split \(it has \['test', 'train'\]\); .*--split"):
        iter_documents([str(both)], "body", split="validation")


def test_json_key_still_names_the_text_field(tmp_path: Path, tokenizer_path: Path) -> None:
    """--json-key (the option's name before --text-column) is kept: scripts that use it still work."""
    (tmp_path / "d.jsonl").write_text('{"body": "old spelling"}\n')
    assert preprocess_command(str(tmp_path / "d.jsonl"), "--tokenizer", str(tokenizer_path), "--out",
                              str(tmp_path / "out"), "--json-key", "body", "--workers", "1") == 0
    assert decoded(tmp_path / "out", tokenizer_path) == ["old spelling"]
