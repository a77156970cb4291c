"""The data pipeline: tokenizers, token files, the default corpus, datasets and loaders.

Modules (import from them directly; this package stays light so worker processes start fast):
``tokenizer``, ``indexed`` (token files), ``preprocess``, ``corpus`` (embedded default corpus),
``dataset`` (packing, shuffling, blending, ``build_datasets``) and ``loader``.
"""

from megaloom.data.errors import DataError

__all__ = ["DataError"]
