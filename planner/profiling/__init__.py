"""Trace a model on the meta device into a `ModelGraph` (per-layer FLOPs, bytes, parameters)."""
