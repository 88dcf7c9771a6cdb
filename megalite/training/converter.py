"""A model converter: a feature that changes how the model's layers compute (FP8's GEMMs) and so needs a word in
the step and the set-up — the gradients' units once the iteration plan is known, the statistics an iteration
gathered, taken in only when the step commits. The step and set-up call these hooks on every converter the model
wants (training/converters.py, the registry) and never name the feature (torchtitan's model converters are the
anchor). A converter that needs none of a hook leaves the default."""


class ModelConverter:
    """One feature's hooks over one rank's model chunks. name: its key in a live peer's state (fault tolerance)."""

    name = ""

    @classmethod
    def wanted(cls, mcfg):
        """Whether a model of this ModelConfig uses the feature."""
        return False

    def __init__(self, chunks):
        self.chunks = chunks

    def set_plan(self, plan, per_token_loss=False):
        """The run's iteration plan (set-up; again after a fault-tolerant replica's resplit)."""

    def after_gradients(self):
        """After the gradients' finalisation: tensors the iteration gathered, reduced to their maximum over the
        ranks that ran its micro-batches; a fault-tolerant vote takes their maximum over the quorum too, in place."""
        return []

    def commit(self):
        """The step commits: what after_gradients gathered is taken in (before the optimizer step)."""

    def discard(self):
        """The step was voted away (it runs again): what after_gradients gathered is forgotten."""

    def state_dict(self):
        """What a live peer hands a healing replica (fault tolerance), beside the optimizer's state."""
        return {}

    def load_state_dict(self, sd):
        pass
