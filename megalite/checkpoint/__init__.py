"""Checkpoint storage, layouts, integrity, the HF tables and conversion (megalite/checkpointing.py uses them)."""
