"""Shared fixtures: a tiny deterministic text corpus, a ~300-token BPE trained on it, and its token files.

Everything is session-scoped and built once under tmp_path_factory, so the whole suite stays fast.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from megaloom.config import DataConfig
from megaloom.data.preprocess import preprocess
from megaloom.data.tokenizer import train_bpe

WORDS = ["the", "model", "reads", "tokens", "and", "learns", "to", "predict", "next", "one", "while", "loss",
         "falls", "slowly", "data", "pipeline", "shard", "batch", "epoch", "seed", "naïve", "café", "über",
         "日本語", "données", "🚀", "def", "return", "class"]
VOCAB = 300


def make_text(rng: random.Random, n_words: int) -> str:
    """Sentences of random words with punctuation, newlines and indentation (all round-trip hazards)."""
    lines = []
    while n_words > 0:
        k = min(n_words, rng.randint(3, 14))
        lines.append(" " * rng.choice((0, 0, 4)) + " ".join(rng.choice(WORDS) for _ in range(k)) + ".")
        n_words -= k
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 small .txt documents of varying length (50..600 words)."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    for i in range(12):
        (root / f"doc{i:02d}.txt").write_text(make_text(rng, rng.randint(50, 600)), encoding="utf-8")
    return root


@pytest.fixture(scope="session")
def tokenizer_path(text_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return train_bpe(sorted(text_dir.glob("*.txt")), VOCAB, out, show_progress=False)


@pytest.fixture(scope="session")
def tokens_prefix(text_dir: Path, tokenizer_path: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Token files of ``text_dir``; tests must not modify them (copy first)."""
    prefix = str(tmp_path_factory.mktemp("tokens") / "corpus")
    preprocess([str(text_dir)], tokenizer_path, prefix, workers=1, show_progress=False)
    return prefix


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test may read or write the user's real ~/.cache/megaloom."""
    monkeypatch.setenv("MEGALOOM_CACHE", str(tmp_path / "env-cache"))


@pytest.fixture
def make_cfg(tmp_path: Path, tokens_prefix: str, tokenizer_path: Path) -> Callable[..., DataConfig]:
    """DataConfig over the shared token files with a per-test cache; keyword arguments override."""

    def make(**overrides: object) -> DataConfig:
        base: dict = dict(paths=[tokens_prefix], tokenizer=str(tokenizer_path), split="75,25",
                          cache_dir=str(tmp_path / "cache"), num_workers=0)
        base.update(overrides)
        return DataConfig(**base)

    return make


CHAT_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                 "<|eot_id|>"]


@pytest.fixture(scope="session")
def chat_tokenizer(tokenizer_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The corpus BPE plus ChatML's and Llama 3's markup as special tokens (one id each, as in real chat
    tokenizers), alone in its folder (no tokenizer_config.json: tests that need one copy the folder)."""
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_file(str(tokenizer_path))
    hf.add_special_tokens(CHAT_SPECIALS)
    out = tmp_path_factory.mktemp("chat_tok") / "tokenizer.json"
    hf.save(str(out))
    return out


def conversation(i: int, rng: random.Random) -> dict:
    """A small arithmetic conversation: sometimes a system prompt, 1-3 user/assistant turns."""
    messages = [{"role": "system", "content": "answer with the number only"}] if i % 3 == 0 else []
    for _ in range(rng.randint(1, 3)):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        messages += [{"role": "user", "content": f"what is {a} + {b}?"},
                     {"role": "assistant", "content": f"{a + b}"}]
    return {"messages": messages}


def write_chats(path: Path, n: int, seed: int = 0) -> Path:
    import json

    rng = random.Random(seed)
    path.write_text("".join(json.dumps(conversation(i, rng)) + "\n" for i in range(n)), encoding="utf-8")
    return path
