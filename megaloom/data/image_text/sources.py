"""Image-text records from local files, in one form for the rest of the pipeline:

    {"images": [ref, ...], "turns": [("prompt" | "answer", text), ...]}

where each "<image>" in the turns' text is where the next image goes (images without a placeholder are put
before the first turn's text, as LLaVA does) and a ref says where the image's bytes are: ("file", path),
("tar", shard, offset, size) or ("synthetic", seed, record, k). Answers are trained; prompts and images are not.

data.images is a folder holding either
  *.jsonl files: one JSON object per line, ``image`` (a path relative to the JSONL file) or ``images`` (a list),
      and ``caption`` / ``text`` (a caption: the answer to the image alone) or ``conversations`` (LLaVA's
      format: [{"from": "human", "value": "<image>\\nWhat is ...?"}, {"from": "gpt", "value": "..."}]);
  *.tar shards (WebDataset layout): members grouped by key (the name up to the first dot), each group one image
      (.jpg .jpeg .png .webp .bmp) with a .txt caption or a .json record as above (without image paths).
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

from megaloom.data.errors import DataError
from megaloom.data.image_text import synthetic
from megaloom.data.tokenizer import IMAGE_TOKEN

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
PROMPT_ROLES = ("human", "user", "system")


def _turns(rec: dict, where: str) -> list[tuple[str, str]]:
    if "conversations" in rec:
        turns = []
        for t in rec["conversations"]:
            role, value = t.get("from", t.get("role")), t.get("value", t.get("content"))
            if not isinstance(value, str):
                raise DataError(f"{where}: a conversation turn has no text ('value'); fix the record")
            prompt = role in PROMPT_ROLES
            turns.append(("prompt", f"USER: {value}\nASSISTANT: ") if prompt else ("answer", value + "\n"))
        return turns
    text = rec.get("caption", rec.get("text"))
    if not isinstance(text, str):
        raise DataError(f"{where}: a record needs 'caption', 'text' or 'conversations'; found keys {sorted(rec)}")
    return [("prompt", ""), ("answer", text)]


def make_record(images: list, rec: dict, where: str) -> dict:
    """A record in the pipeline's form; placeholders are added for images that have none, more placeholders
    than images are refused."""
    turns = _turns(rec, where)
    placed = sum(t.count(IMAGE_TOKEN) for _, t in turns)
    if placed > len(images):
        raise DataError(f"{where}: {placed} '{IMAGE_TOKEN}' placeholders but {len(images)} image(s)")
    if placed < len(images):
        role, text = turns[0]
        turns[0] = (role, IMAGE_TOKEN * (len(images) - placed) + text)
    return {"images": images, "turns": turns}


def _jsonl_records(path: Path) -> list[dict]:
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg})") from e
        names = rec.get("images", [rec["image"]] if "image" in rec else [])
        out.append(make_record([("file", str(path.parent / name)) for name in names], rec, where))
    return out


def _tar_records(path: Path) -> list[dict]:
    groups: dict[str, dict] = {}
    try:
        with tarfile.open(path) as tar:
            for m in tar:
                if not m.isfile():
                    continue
                key, _, ext = m.name.partition(".")
                g = groups.setdefault(key, {})
                ext = "." + ext.lower()
                if ext in IMAGE_EXTS:
                    g["image"] = ("tar", str(path), m.offset_data, m.size)
                elif ext in (".txt", ".json"):
                    g[ext] = tar.extractfile(m).read().decode()
    except tarfile.TarError as e:
        raise DataError(f"{path}: not a readable tar shard ({e})") from e
    out = []
    for key, g in groups.items():
        where = f"{path}:{key}"
        if "image" not in g:
            continue  # a group without an image (e.g. metadata) is not a sample
        if ".json" in g:
            rec = json.loads(g[".json"])
        elif ".txt" in g:
            rec = {"caption": g[".txt"].strip()}
        else:
            raise DataError(f"{where}: an image without a .txt caption or a .json record")
        out.append(make_record([g["image"]], rec, where))
    return out


def folder_records(folder: str) -> list[dict]:
    """Every record of data.images, in file order (*.jsonl files sorted by name, or *.tar shards sorted)."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise DataError(f"data.images={folder}: not a folder; point it at a folder of *.jsonl files with their "
                        "images or of *.tar shards (or leave it empty for the synthetic set)")
    jsonl, shards = sorted(root.glob("*.jsonl")), sorted(root.glob("*.tar"))
    if not jsonl and not shards:
        raise DataError(f"data.images={folder}: no *.jsonl or *.tar files in it")
    records = [r for p in jsonl for r in _jsonl_records(p)] + [r for p in shards for r in _tar_records(p)]
    if not records:
        raise DataError(f"data.images={folder}: no image-text records in its files")
    return records


def synthetic_records(n: int, seed: int = 0) -> list[dict]:
    return [synthetic.record(seed, i) for i in range(n)]


def load_image_bytes(ref: tuple) -> tuple[bytes | str, str]:
    """(what `images.decode` reads, a name for errors) of an image ref; synthetic images are drawn instead."""
    kind = ref[0]
    if kind == "file":
        return ref[1], ref[1]
    if kind == "tar":
        _, shard, offset, size = ref
        with open(shard, "rb") as f:
            f.seek(offset)
            return f.read(size), f"{shard}@{offset}"
    raise ValueError(f"unknown image ref {ref!r}")
