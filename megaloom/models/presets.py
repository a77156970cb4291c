"""Named model shapes, gathered from the families (megaloom/models/<family>/presets.py). A preset sets model.*
keys (its family as ``arch``); explicit model.* overrides win over it."""

from __future__ import annotations

from megaloom.models.registry import all_presets

PRESETS: dict[str, dict] = all_presets()
