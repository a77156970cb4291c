"""Model interchange with other ecosystems: Hugging Face `transformers` directories (safetensors)."""

from megaloom.convert.errors import ConversionError
from megaloom.convert.hf import from_hf, to_hf

__all__ = ["ConversionError", "from_hf", "to_hf"]
