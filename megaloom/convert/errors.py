"""The one error type of conversions: a ValueError (user error), and a CheckpointError so callers that
already handle unusable checkpoints handle these too."""

from megaloom.checkpoint.store import CheckpointError


class ConversionError(CheckpointError):
    """A model that cannot be converted: names the setting or file, what was found and what would work."""
