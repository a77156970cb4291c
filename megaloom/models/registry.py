"""The model families megaloom knows: one line per family folder. Adding a family is adding its folder and
its line here; nothing else in megaloom names a family."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megaloom.models import bert, gemma, gpt2, llama, llava, qwen3, t5
from megaloom.models.family import Family

if TYPE_CHECKING:
    from megaloom.config import ModelConfig

FAMILIES: dict[str, Family] = {f.name: f for f in (
    llama.FAMILY,
    gpt2.FAMILY,
    qwen3.FAMILY,
    llava.FAMILY,
    bert.FAMILY,
    t5.FAMILY,
    gemma.FAMILY,
)}


def get_family(name: str) -> Family:
    """The family called ``name`` (model.arch); a ValueError lists the known ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"model.arch: unknown model family {name!r}; known: {', '.join(FAMILIES)}.") from None


def reads_images(m: ModelConfig) -> bool:
    """Whether model ``m`` has an image encoder: its family's declared trait (`Family.reads_images`), asked by
    the data, the trainer, the pipeline partition and conversion instead of testing model.vision_layers."""
    return get_family(m.arch).reads_images(m)


def all_presets() -> dict[str, dict]:
    """Every family's presets by name, each with its ``arch``."""
    out: dict[str, dict] = {}
    for fam in FAMILIES.values():
        for name, values in fam.presets.items():
            out[name] = {"arch": fam.name, **values}
    return out
