"""What semi-synchronous replicas' outer steps (distributed/semi_sync.py, semi_sync_async.py) are built from: the
method, the rounds' inner steps, the outer optimizer, Streaming DiLoCo's fragments, the payloads' precision and the
asynchronous outer updates' staleness (the flags and their checks: cli/features/semi_sync.py)."""

import dataclasses

from megalite.config.section import Section


@dataclasses.dataclass(frozen=True)
class SemiSyncConfig(Section):
    semi_sync_method: str  # local_sgd | diloco (None: no semi-synchronous replicas)
    semi_sync_steps: list  # each replica's inner steps per round
    semi_sync_auto: bool  # --semi-sync-steps auto: the first round timed, then the counts set
    outer_lr: float
    outer_momentum: float
    outer_nesterov: bool
    semi_sync_fragments: int  # Streaming DiLoCo: the model in fragments, one outer step each in turn
    semi_sync_fragment_delay: int
    semi_sync_fragment_alpha: float
    semi_sync_quantize: str  # bf16 / fp8 payloads
    semi_sync_async: bool  # asynchronous outer updates (delayed Nesterov)
    semi_sync_max_staleness: int
    num_layers: int  # (the fragments are cut by layer)
    train_iters: int  # (the last round ends with the run)
    global_batch_size: int  # (an asynchronous replica's slots)
