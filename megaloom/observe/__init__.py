"""Observability: metrics sinks, FLOPs/MFU, memory."""
