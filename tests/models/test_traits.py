"""Family capabilities are declared traits (issue 50): code outside megaloom/models/ asks the family
(`Traits.images`, `Traits.encoder_decoder`, `Family.reads_images`) instead of probing a module with hasattr or
testing model.vision_layers."""

from __future__ import annotations

import re
from pathlib import Path

from megaloom.config import load_config
from megaloom.models.registry import FAMILIES, get_family, reads_images

ROOT = Path(__file__).resolve().parents[2] / "megaloom"

# A capability probe: hasattr on the methods only some families' modules have, or a model.vision_layers test.
PROBE = re.compile(r"hasattr\([^)]*\"(start_decoding|image_features|decode_step|seq2seq)\"|"
                   r"\b(if|and|or) (not )?[A-Za-z_.()]*\.vision_layers\b\s*(:|and|or|\))")
# The image encoder's keys' own validation (its shape, model.freeze's parts), declared with the keys: a rule about
# the keys themselves (multi-token prediction's refusal is the family rules', megaloom/models/rules.py).
PROBES_ALLOWED = {"model_keys/llava.py"}


def test_no_capability_probes_outside_models():
    found = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
             for path in sorted(ROOT.rglob("*.py")) if "models" not in path.relative_to(ROOT).parts[:1]
             and str(path.relative_to(ROOT)) not in PROBES_ALLOWED
             for i, line in enumerate(path.read_text().splitlines(), 1) if PROBE.search(line)]
    assert not found, "ask the family's traits instead:\n" + "\n".join(found)


def test_the_probe_check_sees_a_probe():
    assert PROBE.search('    if hasattr(model, "start_decoding"):')
    assert PROBE.search("    if cfg.model.vision_layers and x:")
    assert not PROBE.search("    per_image = m.vision_layers * tokens")


def test_declared_traits():
    assert {n for n, f in FAMILIES.items() if f.traits.encoder_decoder} == {"t5"}
    assert {n for n, f in FAMILIES.items() if f.traits.images} == {"llava"}


def test_reads_images_needs_the_trait_and_an_encoder():
    assert reads_images(load_config(None, ["model.preset=llava-tiny"]).model)
    assert not reads_images(load_config(None, ["model.preset=llava-tiny", "model.vision_layers=0"]).model)
    # llama with the vision keys set builds no encoder (they are unused), so its data are tokens
    text = load_config(None, ["model.preset=llava-tiny", "model.arch=llama"]).model
    assert text.vision_layers > 0 and not reads_images(text) and not get_family("llama").reads_images(text)
