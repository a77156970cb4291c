"""The embedded default corpus: Python's own standard library, present wherever Python is.

Training with no data configured needs text that exists on every machine without a download; the
top-level ``*.py`` files of the stdlib (~170 files, ~4.7 MB) are that. The tokenizer and token files
built from them are cached per (Python version, file list, vocab size).
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

from megaloom.data.cache import short_hash
from megaloom.data.errors import DataError
from megaloom.data.preprocess import preprocess
from megaloom.data.tokenizer import train_bpe
from megaloom.observe.log import TO_STDERR, get_logger

log = get_logger(__name__)

TOKENIZER_NAME, PREFIX_NAME = "tokenizer.json", "tokens"


def default_corpus_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    if not files:
        raise DataError(f"the default corpus (Python stdlib *.py files in {stdlib}) is missing from this "
                        "Python installation; set data.paths to token files from `megaloom preprocess`")
    return files


def cache_root(cfg_cache_dir: str) -> Path:
    """``data.cache_dir`` if set, else ``$MEGALOOM_CACHE``, else ``~/.cache/megaloom``."""
    root = cfg_cache_dir or os.environ.get("MEGALOOM_CACHE") or "~/.cache/megaloom"
    return Path(root).expanduser()


def _artifacts(folder: Path) -> tuple[Path, str]:
    return folder / TOKENIZER_NAME, str(folder / PREFIX_NAME)


def _is_complete(folder: Path) -> bool:
    tok, prefix = _artifacts(folder)
    return tok.is_file() and Path(prefix + ".bin").is_file() and Path(prefix + ".idx").is_file()


def prepare_default(cache_dir: Path, vocab_size: int, workers: int = 2) -> tuple[Path, str]:
    """Return (tokenizer.json, token-file prefix) of the default corpus, building them on first use.

    Safe for several ranks at once: each builds in its own temporary folder and renames it into
    place; a rank that loses the race discards its copy and uses the winner's (identical) one.
    """
    files = default_corpus_files()
    key = short_hash(sys.version_info[:3], [(f.name, f.stat().st_size) for f in files], vocab_size, length=12)
    cache_dir = Path(cache_dir).expanduser()
    target = cache_dir / f"default-corpus-{key}"
    if _is_complete(target):
        return _artifacts(target)

    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=cache_dir))
    except OSError as e:
        raise DataError(f"cannot create the data cache folder {cache_dir} ({e}); set data.cache_dir or "
                        "$MEGALOOM_CACHE to a writable folder") from e
    log.info(f"megaloom: building the default corpus ({len(files)} stdlib files, vocab {vocab_size}) "
             f"into {target} (first use only, a few seconds)", extra=TO_STDERR)  # stderr: not a command's result
    try:
        tok_path, prefix = _artifacts(tmp)
        train_bpe(files, vocab_size, tok_path, show_progress=False)
        preprocess([str(f) for f in files], tok_path, prefix, workers=workers, show_progress=False)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared by several users
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target):  # not a lost race: a real filesystem problem
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _artifacts(target)
