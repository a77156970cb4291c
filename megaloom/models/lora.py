"""model.lora: low-rank adapters on the blocks' linears (LoRA, Hu et al. 2021), computed as PEFT computes them.

    y = W x + b + (alpha / r) * B A dropout(x)      A: [r, in], kaiming-uniform (PEFT's init); B: [out, r], zeros

so a fresh adapter leaves the model's output unchanged. The base model trains frozen (`models/freeze.py`), only A
and B take gradients and optimizer state.

The adapted linear keeps its ``weight`` and ``bias`` Parameters (names, checkpoints and HF conversion of the base
unchanged); its adapter is two children, ``lora_A`` and ``lora_B``, so a parameter is named
``layers.0.attn.q_proj.lora_A.weight``: PEFT's own name once the base linear's name is spelled the HF way
(convert/peft.py). The adapters are added to every build of a model with ``model.lora.rank > 0`` (the decoder's
constructor calls `add_lora` before it initialises), so the trainer, conversion, generation and the test worlds all
see the same module. Nothing here knows about parallelism: tensor parallelism splits an adapter like its base layer
when it splits the base (`parallel/tp_lora.py`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math

import torch
import torch.nn.functional as F
from torch import nn

from megaloom.config import ConfigError, LoraConfig
from megaloom.models.init import ZEROS, InitRule

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")  # the attention module's linears (models/attention.py)
MLP = ("gate_proj", "up_proj", "down_proj")  # the dense MLP's (models/layers.py); gate_proj only when gated
ADAPTER_KEYS = (".lora_A.weight", ".lora_B.weight")


class LoraFactor(nn.Module):
    """One adapter matrix, ``weight``. Deliberately not an ``nn.Linear``: code that looks for the model's linears
    (fp8 conversion, fused weight gradients) must never take an adapter for one."""

    def __init__(self, rows: int, cols: int, fan_in: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols))
        self.fan_in = fan_in  # the whole layer's in_features: A's init bound, whatever slice a tp rank holds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Called as a module, never read as a bare weight: per-module forward pre-hooks (ZeRO's wait for the
        # parameter all-gather of this weight's bucket, the overlapped optimizer's chunk wait) must see it.
        return F.linear(x, self.weight)

    @classmethod
    def holding(cls, weight: nn.Parameter, fan_in: int) -> LoraFactor:
        """A factor around an existing Parameter (a tensor-parallel shard of another factor's)."""
        with torch.device("meta"):
            new = cls(0, 0, fan_in)
        new.weight = weight
        return new

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}"


def has_lora(module: nn.Module) -> bool:
    return getattr(module, "lora_A", None) is not None


def attach(module: nn.Module, a: LoraFactor, b: LoraFactor, scale: float, dropout: float) -> None:
    """Give ``module`` (a linear of any kind) the adapter ``a``, ``b``; its forward adds `lora_delta`."""
    module.lora_A, module.lora_B = a, b
    module.lora_scale, module.lora_dropout = scale, dropout


def lora_delta(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The adapter's term (alpha / r) B A dropout(x) for ``module``'s input ``x``. Under tensor parallelism ``x``
    and the factors are this rank's: a row-parallel layer adds it before its reduction, which then sums the
    adapter's partial products with the base's."""
    if module.lora_dropout > 0:
        x = F.dropout(x, module.lora_dropout, module.training)
    return module.lora_B(module.lora_A(x)) * module.lora_scale


class LoraLinear(nn.Linear):
    """An ``nn.Linear`` with an adapter: the very same weight and bias Parameters, plus ``lora_A``, ``lora_B``."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, lora: LoraConfig) -> LoraLinear:
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False)
            a = LoraFactor(lora.rank, linear.in_features, linear.in_features)
            b = LoraFactor(linear.out_features, lora.rank, linear.in_features)
        new.weight, new.bias = linear.weight, linear.bias
        device = linear.weight.device
        if device.type != "meta":  # a model built with storage: the factors get it too (initialised by the caller)
            a, b = a.to_empty(device=device), b.to_empty(device=device)
        attach(new, a, b, lora.alpha / lora.rank, lora.dropout)
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + lora_delta(self, x)


def add_lora(model: nn.Module, lora: LoraConfig) -> list[str]:
    """Give every ``layers.<i>.attn.<t>`` / ``layers.<i>.mlp.<t>`` linear named in ``lora.targets`` an adapter, in
    place (not initialised: the caller's init rule fills the factors). Returns the adapted linears' names. A target
    that matches no linear of the model is a ConfigError (config validation refuses the known cases earlier)."""
    if lora.rank <= 0:
        return []
    adapted: list[str] = []
    for name, module in list(model.named_modules()):
        parts = name.split(".")
        if (len(parts) == 4 and parts[0] == "layers" and parts[2] in ("attn", "mlp") and parts[3] in lora.targets
                and isinstance(module, nn.Linear)):
            setattr(model.get_submodule(".".join(parts[:3])), parts[3], LoraLinear.from_linear(module, lora))
            adapted.append(name)
    missing = [t for t in lora.targets if not any(n.endswith("." + t) for n in adapted)]
    if missing:
        raise ConfigError(f"model.lora.targets: this model has no linear named {', '.join(missing)} in its blocks' "
                          f"attention or dense MLP; choose from {', '.join(ATTENTION + MLP)} (what the model has).")
    return adapted


def is_adapter_name(name: str) -> bool:
    """Whether a parameter (or state-dict key) is a LoRA factor."""
    return ".lora_A." in name or ".lora_B." in name or name.endswith((".lora_A", ".lora_B"))


def adapter_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for n, p in model.named_parameters() if is_adapter_name(n)]


def init_rule(module: nn.Module | None, name: str) -> InitRule | None:
    """The initial values of a LoRA factor named ``name`` (its module ``module``), as PEFT draws them: A from
    kaiming_uniform_(a=sqrt(5)), i.e. U(-1/sqrt(in), 1/sqrt(in)); B zeros. None for any other parameter."""
    if not isinstance(module, LoraFactor):
        return None
    if name.endswith(".lora_B.weight"):
        return ZEROS
    return InitRule("uniform", 1.0 / math.sqrt(module.fan_in))


def merge_lora(sd: dict[str, torch.Tensor], lora: LoraConfig) -> dict[str, torch.Tensor]:
    """A full state dict with every adapter folded into its base weight (W + (alpha / r) B A, computed in fp64 and
    rounded once to W's dtype) and the factors dropped: the plain model that computes what base + adapter does."""
    out = {k: v for k, v in sd.items() if not is_adapter_name(k)}
    scale = lora.alpha / lora.rank if lora.rank else 0.0
    for key in sd:
        if key.endswith(".lora_A.weight"):
            base = key[: -len(".lora_A.weight")]
            w = out[f"{base}.weight"]
            delta = sd[f"{base}.lora_B.weight"].double() @ sd[key].double()
            out[f"{base}.weight"] = (w.double() + scale * delta).to(w.dtype)
    return out


def saved_settings(model_cfg: dict) -> dict:
    """The adapter settings that change the model (rank, alpha, targets) from a model config as a dict (a
    checkpoint's state.json, or ``cfg.model.__dict__``); ``{"rank": 0}`` without adapters, also for checkpoints
    written before model.lora existed."""
    lora = model_cfg.get("lora")
    if lora is None:
        return {"rank": 0}
    if not isinstance(lora, dict):
        lora = dataclasses.asdict(lora)
    if not lora.get("rank"):
        return {"rank": 0}
    return {"rank": lora["rank"], "alpha": float(lora.get("alpha", 16.0)), "targets": list(lora.get("targets", []))}


def describe_settings(settings: dict) -> str:
    if not settings.get("rank"):
        return "no adapters"
    return f"rank {settings['rank']}, alpha {settings['alpha']:g} on {','.join(settings['targets'])}"


def describe(model: nn.Module, lora: LoraConfig) -> str:
    """One start-up line: how many parameters train (the adapters) against the whole model."""
    seen: set[int] = set()
    total = trainable = 0
    for _, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
            trainable += p.numel() if p.requires_grad else 0
    return (f"LoRA rank {lora.rank} (alpha {lora.alpha:g}) on {', '.join(lora.targets)}: {trainable:,} of "
            f"{total:,} parameters of this rank train ({100 * trainable / max(total, 1):.2f}%), the base is frozen")


def check_targets(lora: LoraConfig, gated_mlp: bool, dense_mlp: bool) -> None:
    """Config-time checks of model.lora (no model built): each raises a ConfigError naming the setting and the fix."""
    if lora.rank < 0:
        raise ConfigError(f"model.lora.rank must be >= 0 (0 = no adapters), got {lora.rank}; e.g. "
                          "model.lora.rank=8.")
    if lora.rank == 0:
        return
    if not lora.alpha > 0:
        raise ConfigError(f"model.lora.alpha must be > 0 (the adapters' scale is alpha / rank), got {lora.alpha}; "
                          f"e.g. model.lora.alpha={2 * lora.rank}.")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"model.lora.dropout must be in [0, 1), got {lora.dropout}.")
    if not lora.targets:
        raise ConfigError(f"model.lora.targets is empty with model.lora.rank={lora.rank}: name the linears to adapt, "
                          f"e.g. model.lora.targets={','.join(ATTENTION)}.")
    have = list(ATTENTION) + ([n for n in MLP if gated_mlp or n != "gate_proj"] if dense_mlp else [])
    for t in lora.targets:
        if t in have:
            continue
        if t == "gate_proj" and dense_mlp:
            why, close = "this model's MLP is not gated: it has no gate_proj", []
        elif t in MLP:
            why, close = "every block of this model is a Mixture-of-Experts layer, with no dense MLP", []
        else:  # a typo or a short name (q for q_proj)
            why = "no linear of the blocks is named so"
            close = [n for n in have if n.startswith(t)][:1] or difflib.get_close_matches(t, have, n=1, cutoff=0.5)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"model.lora.targets: {t!r} is not a linear this model can adapt ({why}).{hint} Choose "
                          f"from {', '.join(have)}.")
    if len(set(lora.targets)) != len(lora.targets):
        raise ConfigError(f"model.lora.targets lists a linear twice: {','.join(lora.targets)}.")
