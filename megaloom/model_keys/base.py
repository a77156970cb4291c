"""What the key groups are made of, and the one seam through which the config asks the model families.

A key is a dataclass field made by `_f`: its default, its help (what `megaloom config --list` prints), the values it
may take, and for model keys whether it shapes the weights (``shape``: a checkpoint of another value cannot load;
`megaloom.checkpoint.store.check_compatible` compares exactly these keys). This module, megaloom/config.py and every
key group in this package import no torch and nothing of megaloom.models: every command loads them.

`ModelRules` is what validating a config needs from the families (their names, presets, size defaults, rules), and
the family by name for the shared decoder, which every family builds on and so cannot import their registry.
megaloom/config.py asks `model_rules()`; the package (megaloom/__init__.py) wires it to `megaloom.models.rules`,
imported only when a config is first validated, so the config layer never imports the models.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import field
from typing import Any, Protocol

from megaloom.errors import ConfigError

# The rules' arguments are megaloom.config's Config and this package's ModelConfig, named in words only: both import
# this module, and an import of either here (even for annotations) would tie them in a circle.
Config = ModelConfig = Any

# A switch that "auto" leaves to megaloom (train.compile, train.fused_loss): true, false or "auto", resolved to a
# bool for the device before the run's config.yaml is written (megaloom/planning/levers.py).
AutoBool = bool | str
AUTO_BOOL = ("auto", True, False)


def _f(default: Any, help: str, choices: tuple | Callable[[], tuple] | None = None, shape: bool | str = False) -> Any:
    """A dataclass field with a docstring (``help``) and, optionally, the values it may take (a callable is asked
    when checked) and ``shape``: True if the key sizes the weights, or the name of the condition under which it does
    (`check_compatible`: "experts" = only in models with experts)."""
    meta = {"help": help, "choices": choices, "shape": shape}
    if isinstance(default, list | dict):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    if dataclasses.is_dataclass(default):  # a sub-section (model.lora): a fresh copy per config
        return field(default_factory=lambda d=default: dataclasses.replace(d), metadata=meta)
    return field(default=default, metadata=meta)


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def divisors(n: int, near: int | None = None) -> str:
    ds = [d for d in range(1, n + 1) if n % d == 0]
    if near is not None:
        ds = sorted(ds, key=lambda d: abs(d - near))[:4]
        ds.sort()
    return ", ".join(map(str, ds[:8]))


class ModelRules(Protocol):
    """What config validation asks the model families (implemented by `megaloom.models.rules`)."""

    def names(self) -> tuple[str, ...]:
        """The registered families (model.arch's choices)."""
        ...

    def presets(self) -> dict[str, dict[str, Any]]:
        """Every named shape: its model.* values, its family as ``arch``."""
        ...

    def size_defaults(self, m: ModelConfig) -> dict[str, Any]:
        """{"section.key": value} training defaults for a model of this width (empty for CPU-sized models)."""
        ...

    def check(self, cfg: Config) -> None:
        """The model section against its family (raises ConfigError naming the key and the fix)."""
        ...

    def family(self, name: str) -> Any:
        """The family called ``name`` (model.arch; a ValueError lists the known ones). Asked through this seam by the
        shared decoder (megaloom/models/transformer.py) built without its family: every family builds on the decoder,
        so the decoder cannot import the registry that lists them."""
        ...


_provider: Callable[[], ModelRules] | None = None


def use_model_rules(provider: Callable[[], ModelRules]) -> None:
    """Set where `model_rules` finds the families (megaloom/__init__.py does, once)."""
    global _provider
    _provider = provider


def model_rules() -> ModelRules:
    if _provider is None:  # megaloom/__init__.py sets it before any megaloom module loads
        raise RuntimeError("megaloom.model_keys.base: no model rules wired (megaloom/__init__.py sets them)")
    return _provider()


def family_names() -> tuple[str, ...]:
    """model.arch's choices, asked when checked."""
    return model_rules().names()
