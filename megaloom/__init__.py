"""megaloom: LLM training with hybrid parallelism, from one laptop CPU to thousands of GPUs."""

__version__ = "0.1.0"
