"""Where a pipeline's stages sit: p pipeline ranks of v model chunks each, the stages 0 .. p v - 1 in model order.

Two placements. The loop (Megatron's, 1F1B and interleaved): stage s on rank s mod p as its chunk s div p. The V
(--pipeline-schedule zbv, Qi et al.'s ZB-V, and dualpipev): two chunks per rank, the model going down the ranks
and back up, so the stage after p - 1 stays on the rank that ran it (no message) and a micro-batch's backward
starts on the rank its forward started from. megalite draws the V mirrored, from the last rank: rank r holds
stage p - 1 - r as chunk 0 and stage p + r as chunk 1, so the last pipeline rank holds the first and the last
stage (the embedding and the loss) and everything that reads "the last stage" (the logged loss, the metrics'
broadcast) is unchanged."""

import dataclasses

PLACEMENTS = ("loop", "v")
V_SCHEDULES = ("zbv", "dualpipev")  # the --pipeline-schedule's that place the stages in a V


def placement_of(schedule):
    """Where --pipeline-schedule `schedule` places the stages: "v" or "loop"."""
    return "v" if schedule in V_SCHEDULES else "loop"


@dataclasses.dataclass(frozen=True)
class PipelineStages:
    p: int  # pipeline ranks
    v: int = 1  # model chunks per rank
    placement: str = "loop"

    def __post_init__(self):
        if self.placement not in PLACEMENTS or (self.placement == "v" and self.v != 2):
            raise ValueError(f"pipeline placement {self.placement!r} with {self.v} chunks per rank: the loop takes "
                             "any number, the V two")

    @property
    def count(self):
        return self.p * self.v

    def stage(self, rank, chunk):
        """The stage that pipeline rank `rank` runs as its chunk `chunk`."""
        if self.placement == "v":
            return self.p - 1 - rank if chunk == 0 else self.p + rank
        return chunk * self.p + rank

    def holder(self, stage):
        """(pipeline rank, chunk) that runs `stage`."""
        if self.placement == "v":
            return (self.p - 1 - stage, 0) if stage < self.p else (stage - self.p, 1)
        return stage % self.p, stage // self.p
