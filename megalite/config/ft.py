"""What fault-tolerant replicas (training/ft.py, ft_rounds.py) are built from: the Lighthouse and this replica's
place among the replicas, torchft's timeouts, the replicas' shares of the batch, and what every replica of a
quorum must share (the batch flags, semi-synchronous rounds' outer optimizer). The flags and their checks:
cli/features/ft.py."""

import dataclasses

from megalite.config.section import Section


@dataclasses.dataclass(frozen=True)
class FtConfig(Section):
    ft_lighthouse: str  # HOST:PORT
    ft_replica_id: int
    ft_replica_share: object  # a positive integer or "auto"
    ft_share_profile_iters: int
    ft_min_replicas: int
    ft_timeout: float
    ft_quorum_timeout: float
    ft_connect_timeout: float
    ft_heartbeat_ms: int
    global_batch_size: int  # (dealt out over the live replicas)
    micro_batch_size: int
    seq_length: int  # (checked alike over the quorum)
    semi_sync_method: str  # semi-synchronous replicas under faults: one outer optimizer, rounds of one length
    semi_sync_steps: list
    outer_lr: float
    outer_momentum: float
    outer_nesterov: bool
