"""What each rank runs per iteration: `microbatches.py` (the run's batch schedule: ramp-up, step schedules),
`iteration_plan.py` (each DP rank's micro-batch count, size and weight: shares, per-replica sizes) and
`data_iterators.py` (the samplers and loaders that feed that plan)."""
