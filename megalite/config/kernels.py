"""What the run's kernel choice (training/kernel_choice.py, kernels/choice.py) is decided from: the user's choice,
whether fused kernels run at all and are self-checked, and the shapes they will see (micro-batch, optimizer)."""

import dataclasses

from megalite.config.section import Section


@dataclasses.dataclass(frozen=True)
class KernelConfig(Section):
    kernel_choice: str  # auto | triton | torch
    no_fused_kernels: bool
    no_kernel_self_check: bool
    micro_batch_size: int
    optimizer: str  # (Adam's fused step is a kernel: raced when it runs)
    muon_scalar_optimizer: str

    @property
    def fused_adam(self):
        return self.optimizer == "adam" or self.optimizer == "muon" and self.muon_scalar_optimizer == "adam"
