"""Each feature's flags and their checks, kept together: the model's (model.py), the optimizers' (optimizer.py),
mixed GPUs' (mixed_gpu.py), semi-synchronous replicas' (semi_sync.py), the pipeline's schedule
(pipeline_schedule.py)."""
