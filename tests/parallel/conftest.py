import pytest

from megaloom.models import transformer

from .model_hooks import missing_hooks


@pytest.fixture(autouse=True)
def _transformer_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model hooks for single-process tests here, undone afterwards so other test folders see the
    Transformer as it is."""
    for name, value in missing_hooks().items():
        monkeypatch.setattr(transformer.Transformer, name, value, raising=False)
