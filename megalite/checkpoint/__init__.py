"""Checkpoint storage, layouts, integrity, the HF tables and conversion (megalite/checkpoint/manager.py uses them)."""
