"""The model families megaloom knows: one line per family folder. Adding a family is adding its folder and
its line here; nothing else in megaloom names a family."""

from __future__ import annotations

from megaloom.models import bert, gemma, gpt2, llama, llava, qwen3, t5
from megaloom.models.family import Family

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


def all_presets() -> dict[str, dict]:
    """Every family's presets by name, each with its ``arch``."""
    out: dict[str, dict] = {}
    for fam in FAMILIES.values():
        for name, values in fam.presets.items():
            out[name] = {"arch": fam.name, **values}
    return out
