"""Image-text data (data/image_text/): the synthetic set, folder/JSONL and tar-shard records, <image> expansion and
loss masking, prefix-stable packing (exact resume), and the batches the training step reads."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from megaloom.config import load_config
from megaloom.data.errors import DataError
from megaloom.data.image_text.batch import IGNORE, ImageTextBatch
from megaloom.data.image_text.build import build_image_text_datasets
from megaloom.data.image_text.images import MEAN, STD
from megaloom.data.image_text.packed import plan_rows
from megaloom.data.image_text.sources import folder_records
from megaloom.data.image_text.synthetic import draw, record

SEQ = 96


def config(tmp_path, *extra):
    return load_config(None, ["model.preset=llava-tiny", f"train.seq_len={SEQ}", f"data.cache_dir={tmp_path / 'c'}",
                              "data.synthetic_samples=200", *extra])


def build(cfg, n_train=16, n_valid=4, seed=1):
    return build_image_text_datasets(cfg.data, cfg.train.seq_len, seed, n_train, n_valid, model=cfg.model)


def test_synthetic_captions_describe_their_images():
    for i in range(40):
        rec = record(0, i)
        assert rec == record(0, i)  # a function of (seed, i)
        answer = rec["turns"][-1][1].lower()
        img = np.asarray(draw(0, i, 0))
        assert img.shape == (64, 64, 3)
        # the named colour is in the image
        from megaloom.data.image_text.synthetic import COLOURS
        named = [c for c in COLOURS if f"a {c} " in answer]
        assert named and any((np.abs(img.astype(int) - COLOURS[c]).sum(-1) < 10).any() for c in named), (i, answer)


def test_rows_mask_images_and_prompts_and_keep_answers(tmp_path):
    cfg = config(tmp_path)
    train, valid, tok = build(cfg)
    per_image = (cfg.model.image_size // cfg.model.patch_size) ** 2
    for i in range(len(train)):
        row = train[i]
        tokens, mask, n = row["tokens"], row["loss_mask"], int(row["n_images"])
        assert tokens.shape == (SEQ + 1,) and row["images"].shape == (cfg.data.max_images, 3, 32, 32)
        is_image = tokens == tok.image_id
        assert is_image.sum() == n * per_image and 1 <= n <= cfg.data.max_images
        assert not mask[is_image].any()  # image tokens are never targets
        assert (row["images"][n:] == 0).all() and (np.abs(row["images"][:n]).sum((1, 2, 3)) > 0).all()
        text = tok.decode(tokens[mask & ~is_image].tolist())
        assert "USER:" not in text and "ASSISTANT:" not in text  # prompts are not targets
        assert "background" in text  # captions are
    assert len(valid) == 4


def test_packing_is_deterministic_and_prefix_stable(tmp_path):
    cfg = config(tmp_path)
    a, _, _ = build(cfg, n_train=8)
    b, _, _ = build(cfg, n_train=30)
    c, _, _ = build(cfg, n_train=8, seed=2)
    assert a.rows == b.rows[:8]  # row i never depends on how many rows were asked for: exact resume
    assert a.rows != c.rows
    for i in (0, 7):
        for k in ("tokens", "loss_mask", "images"):
            assert np.array_equal(a[i][k], b[i][k])
    lengths, imgs = np.array([5, 9, 3, 20, 4]), np.array([1, 2, 1, 1, 3])
    rows, skipped = plan_rows(lengths, imgs, 10, 2, 0, 12)
    assert skipped == 2 and all(sum(lengths[r]) <= 10 and sum(imgs[r]) <= 2 for r in map(list, rows))
    assert len(rows) == 12 and {3, 4}.isdisjoint(set(sum(rows, [])))
    with pytest.raises(DataError, match="train.seq_len"):
        plan_rows(lengths, imgs, 2, 2, 0, 1)


def test_batches_give_masked_labels_and_the_rows_images(tmp_path):
    cfg = config(tmp_path)
    train, _, tok = build(cfg)
    batch = ImageTextBatch.stack([train[i] for i in range(4)])
    assert batch.shape == (4, SEQ + 1) and batch.images.dtype == torch.float32
    parts = list(batch.micro_inputs(2))
    assert len(parts) == 2
    x, y, kw = parts[1]
    assert torch.equal(x, batch.tokens[2:, :-1]) and torch.equal(kw["n_images"], batch.n_images[2:])
    assert ((y == IGNORE) == ~batch.loss_mask[2:, 1:]).all()
    assert (y[y != IGNORE] != tok.image_id).all()


def _png(colour, size=(40, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def test_folder_of_jsonl_and_tar_shards(tmp_path):
    jsonl = tmp_path / "jsonl"
    jsonl.mkdir()
    (jsonl / "red.png").write_bytes(_png((255, 0, 0)))
    (jsonl / "blue.png").write_bytes(_png((0, 0, 255)))
    recs = [{"image": "red.png", "caption": "a red picture"},
            {"images": ["red.png", "blue.png"], "conversations": [
                {"from": "human", "value": "<image> and <image>: which is blue?"},
                {"from": "gpt", "value": "the second"}]}]
    (jsonl / "part.jsonl").write_text("\n".join(json.dumps(r) for r in recs) * 1 + "\n")
    got = folder_records(str(jsonl))
    assert [len(r["images"]) for r in got] == [1, 2]
    assert got[0]["turns"][0] == ("prompt", "<image>")  # a caption's image is put before it
    assert got[1]["turns"][1] == ("answer", "the second\n")

    shards = tmp_path / "tars"
    shards.mkdir()
    with tarfile.open(shards / "000.tar", "w") as tar:
        for key, colour, text in (("a", (0, 255, 0), "green"), ("b", (0, 0, 255), "blue")):
            for name, data in ((f"{key}.png", _png(colour)), (f"{key}.txt", text.encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    cfg = config(tmp_path, f"data.images={shards}", "data.split=50,50")
    train, _, tok = build(cfg, n_train=2, n_valid=1)
    row = train[0]
    n = int(row["n_images"])
    pixel = row["images"][0][:, 16, 16] * STD + MEAN  # back to [0, 1]
    text = tok.decode(row["tokens"][row["loss_mask"]].tolist())
    assert n >= 1 and ("green" in text) == (pixel[1] > 0.9) and ("blue" in text) == (pixel[2] > 0.9)

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.jsonl").write_text(json.dumps({"image": "x.png", "caption": "<image><image> two"}) + "\n")
    with pytest.raises(DataError, match="x.jsonl:1: 2 '<image>' placeholders but 1 image"):
        folder_records(str(bad))
    with pytest.raises(DataError, match="data.images"):
        folder_records(str(tmp_path / "missing"))
