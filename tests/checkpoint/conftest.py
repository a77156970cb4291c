"""Shared by the checkpoint and conversion tests."""

import pytest


@pytest.fixture(autouse=True)
def _quiet_transformers():
    """transformers' own warnings (missing tokenizer files, ...) are not what these tests look at."""
    try:
        import transformers
    except ImportError:
        return
    transformers.logging.set_verbosity_error()
