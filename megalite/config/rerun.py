"""What --rerun-mode's state machine (megalite/rerun.py) is built from: the mode, the loss checks it runs and the
faults it injects to test itself."""

import dataclasses

from megalite.config.section import Section


@dataclasses.dataclass(frozen=True)
class RerunConfig(Section):
    rerun_mode: str
    check_for_nan_in_loss_and_grad: bool
    check_for_spiky_loss: bool
    error_injection_rate: int
    error_injection_type: str
    seed: int  # the injector's own stream
