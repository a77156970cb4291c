"""megaloom: LLM training with hybrid parallelism, from one laptop CPU to thousands of GPUs."""

__version__ = "0.1.0"


def _model_rules():
    # The config layer (megaloom/config.py, megaloom/model_keys/) asks the model families through this seam and
    # imports none of them: the package wires it, and the families (torch) load when a config is first validated.
    from megaloom.models.rules import RULES

    return RULES


def _wire() -> None:
    from megaloom.model_keys.base import use_model_rules

    use_model_rules(_model_rules)


_wire()
