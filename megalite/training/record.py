"""What a run decided and measured, for its caller: a RunRecord handed to pretrain(record=...) (tests, benchmarks)
and by the run to the components that decide, which fill their field. No module keeps a "last" anything."""

import dataclasses

from megalite.pipeline.run import ScheduleTrace


@dataclasses.dataclass
class RunRecord:
    # the latest forward-backward's operations, ("F" | "B", chunk, micro-batch) in order, and the most
    # micro-batches whose activations were alive at once (pipeline/run.py)
    schedule: ScheduleTrace = dataclasses.field(default_factory=ScheduleTrace)
    layout: tuple = None  # --pipeline-model-parallel-layout auto: (stages as measured, layers per stage)
    rebuilt: bool = None  # whether that cut rebuilt the model (another cut than the near-even one)
    shares: tuple = None  # --data-parallel-shares auto: (seconds per micro-batch by replica, micro-batch counts)
    memory: tuple = None  # a memory budget's choice: (this rank's Profile, budget bytes, sizes by replica, fraction)
