"""Predicting a run before running it: memory and step time of a layout on a cluster (tools/plan.py)."""
