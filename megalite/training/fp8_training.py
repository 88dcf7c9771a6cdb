"""FP8 training as a model converter (training/converter.py): the transformer block gives each FP8 layer its
Fp8Site (tensor_parallel/fp8.py) when the model is built; across an iteration, delayed scaling's amax histories
need the gradients' units (the plan's divisor) and the iteration's amaxes, reduced over the data-parallel ranks
and rolled into the histories only when the step commits."""

from megalite import parallel_state as ps
from megalite.checkpoint.state import fp8_state, set_fp8_state
from megalite.distributed.collectives import max_over_data_parallel
from megalite.tensor_parallel import fp8
from megalite.training.converter import ModelConverter


class Fp8Training(ModelConverter):
    name = "fp8"

    @classmethod
    def wanted(cls, mcfg):
        return bool(mcfg.fp8)

    def __init__(self, chunks):
        super().__init__(chunks)
        self.modules = [m for c in chunks for m in c.module.modules()]
        self.grid = ps.grid_of(chunks)
        self.amaxes = []

    def set_plan(self, plan, per_token_loss=False):
        # (the delayed histories in the single process's units: checkpoints resume at any layout)
        fp8.set_gradient_units(self.modules, 1 if per_token_loss else plan.grad_divisor)

    def after_gradients(self):
        self.amaxes = fp8.iteration_amaxes(self.modules, lambda t: max_over_data_parallel(t, self.grid),
                                           lambda t: max_over_data_parallel(t, self.grid, expert=True))
        return [got for _, got in self.amaxes]

    def commit(self):
        fp8.roll(self.amaxes)
        self.amaxes = []

    def discard(self):
        fp8.discard(self.modules)
        self.amaxes = []

    def state_dict(self):
        return fp8_state(self.chunks)

    def load_state_dict(self, sd):
        set_fp8_state(self.chunks, sd)
