"""Model interchange with other ecosystems: Hugging Face `transformers` directories (safetensors).

`from_hf` / `to_hf` are imported on first use: every `megaloom` command builds its argument parser, which imports
`convert.cli` (and so this package), and only `megaloom convert` needs `convert.hf`'s checkpoint store and DCP.
(The families' helpers that used to live here, and made this a cycle, are in `megaloom.models.hf_common`.)
"""

from megaloom.convert.errors import ConversionError

__all__ = ["ConversionError", "from_hf", "to_hf"]


def __getattr__(name: str):
    if name in ("from_hf", "to_hf"):
        from megaloom.convert import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'megaloom.convert' has no attribute {name!r}")
