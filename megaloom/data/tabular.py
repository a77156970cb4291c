"""Row-oriented inputs of `megaloom preprocess` and `megaloom tokenizer train`: Parquet files and Hugging Face
datasets on local disk, one document per row, the text in a named column (``--text-column``).

- ``*.parquet`` (pyarrow): read a batch of rows at a time, only the text column (memory stays flat on files larger
  than RAM); row groups in file order.
- a folder written by ``datasets``' ``save_to_disk`` (``state.json`` + ``dataset_info.json``, or a DatasetDict's
  ``dataset_dict.json``: ``--split`` names the split; without it, a dict of one split is read and one of several is
  refused, naming them) or a datasets ``*.arrow`` file (``Dataset.from_file``), both
  memory-mapped by ``datasets``.

pyarrow and datasets are optional (``pip install 'megaloom[parquet]'`` / ``'megaloom[hf]'``), imported only when
such an input is given; every source is opened and its column checked before any tokenizing, so a missing package,
column or split is one DataError line naming the input and the fix. Rows whose text is null are skipped like empty
documents; any other non-text value is refused, naming the row.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from pathlib import Path

from megaloom.data.errors import DataError

PARQUET_SUFFIXES = (".parquet",)
ARROW_SUFFIXES = (".arrow",)
BATCH_ROWS = 1024
EXTRAS = {"pyarrow": "parquet", "datasets": "hf"}


def is_hf_dataset_dir(path: Path) -> bool:
    """A folder written by datasets' ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return path.is_dir() and ((path / "dataset_dict.json").is_file()
                              or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file()))


def is_tabular(path: Path) -> bool:
    return path.suffix in PARQUET_SUFFIXES + ARROW_SUFFIXES or is_hf_dataset_dir(path)


def _need(module: str, path: Path):
    package = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise DataError(f"reading {path} needs the optional package {package} ({e}): pip install "
                        f"'megaloom[{EXTRAS[package]}]' (or pip install {package})") from None


def saved_splits(path: Path) -> list[str] | None:
    """The splits a saved DatasetDict's ``dataset_dict.json`` lists (None: not a DatasetDict folder, or a file
    that does not say)."""
    try:
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits")
    except (OSError, ValueError, AttributeError):
        return None
    return [str(s) for s in splits] if isinstance(splits, list) else None


def choose_split(path: Path, split: str | None) -> str | None:
    """The split to read of a saved DatasetDict: ``split`` if it has it; without one, its only split; anything else
    is one DataError line naming its splits and how to choose (read before ``datasets`` is imported)."""
    splits = saved_splits(path) if path.is_dir() else None
    return split if splits is None else _pick_split(path, split, list(splits))


def _pick_split(path: Path, split: str | None, splits: list[str]) -> str:
    """``split`` if the DatasetDict at ``path`` has it; without one, its only split; else one DataError line."""
    if split is None and len(splits) == 1:
        return splits[0]
    if split is None:
        raise DataError(f"{path} is a DatasetDict of {len(splits)} splits ({', '.join(sorted(splits))}): choose the "
                        f"one to read with --split, e.g. --split {sorted(splits)[0]}")
    if split not in splits:
        raise DataError(f"{path} is a DatasetDict without a {split!r} split (it has {sorted(splits)}); choose one "
                        "with --split")
    return split


def _open_hf(path: Path, split: str | None):
    split = choose_split(path, split)
    datasets = _need("datasets", path)
    if not path.is_dir():
        try:
            return datasets.Dataset.from_file(str(path))
        except Exception as e:  # not an Arrow stream file
            raise DataError(f"{path} is not a datasets .arrow file ({type(e).__name__}: {e}); pass a folder "
                            "written by save_to_disk or the dataset's .parquet files") from None
    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):  # a folder whose splits were not listed on disk: the same choice
        data = data[_pick_split(path, split, list(data))]
    return data


def _columns(path: Path, split: str | None) -> list[str]:
    if path.suffix in PARQUET_SUFFIXES:
        pq = _need("pyarrow.parquet", path)
        try:
            return list(pq.read_schema(str(path)).names)
        except Exception as e:  # pyarrow's own errors for a file that is not Parquet
            raise DataError(f"{path} is not a readable Parquet file ({type(e).__name__}: {e})") from None
    return list(_open_hf(path, split).column_names)


def check_source(path: Path, column: str, split: str | None) -> None:
    """Open ``path`` far enough to know it can be read and has ``column``; raise the one-line DataError if not."""
    names = _columns(path, split)
    if column not in names:
        raise DataError(f"{path} has no column {column!r} (its columns: {', '.join(names[:10])}); set --text-column "
                        "to the column that holds the text")


def _text(value, path: Path, row: int, column: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise DataError(f"{path} row {row}: column {column!r} holds {type(value).__name__}, expected text; set "
                    "--text-column to a column of strings")


def iter_rows(path: Path, column: str, split: str | None = None) -> Iterator[str]:
    """The non-null texts of ``column``, row by row."""
    if path.suffix in PARQUET_SUFFIXES:
        pq = _need("pyarrow.parquet", path)
        batches = (b.column(0).to_pylist()
                   for b in pq.ParquetFile(str(path)).iter_batches(batch_size=BATCH_ROWS, columns=[column]))
    else:
        data = _open_hf(path, split).select_columns([column])
        batches = (b[column] for b in data.iter(batch_size=BATCH_ROWS))
    row = 0
    for values in batches:
        for value in values:
            text = _text(value, path, row, column)
            row += 1
            if text is not None:
                yield text
