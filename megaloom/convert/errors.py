"""The one error type of conversions: a ValueError (user error), and a CheckpointError so callers that
already handle unusable checkpoints handle these too (defined in megaloom/errors.py with every other; this name
stays for the modules and users that import it from here)."""

from megaloom.errors import ConversionError as ConversionError
