"""Model interchange with other ecosystems: Hugging Face `transformers` directories (safetensors).

`from_hf` / `to_hf` are imported on first use: the model families import this package's helpers
(`hf_common`) while the registry is built, and `convert.hf` itself needs the registry.
"""

from megaloom.convert.errors import ConversionError

__all__ = ["ConversionError", "from_hf", "to_hf"]


def __getattr__(name: str):
    if name in ("from_hf", "to_hf"):
        from megaloom.convert import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'megaloom.convert' has no attribute {name!r}")
