"""The command line: Megatron-LM's flags (parser.py), their compatibility (compat.py with megatron_flags.json: what
megalite implements, notices for flags that only pick an implementation, one error listing the rest), the checks
(validate.py, validate_features.py), each feature's flags with their checks (features/), --use-checkpoint-args
(checkpoint_args.py); the configuration values the flags make are megalite/config/from_flags.py's. Only the entry
points (pretrain_*.py), tools/ and benchmarks/ import this package."""
