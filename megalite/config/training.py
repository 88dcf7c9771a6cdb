"""The training's configuration: batch, schedule, optimizer, precision and loss scaling (TrainingConfig)."""

from dataclasses import dataclass, fields
from typing import Optional

import torch

from megalite.errors import ConfigError


@dataclass
class TrainingConfig:
    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None
    train_iters: int = 10
    lr: float = 1e-4
    min_lr: float = 0.0
    lr_decay_style: str = "cosine"  # constant, linear, cosine, inverse-square-root, WSD
    lr_wsd_decay_style: str = "exponential"  # WSD's anneal (optimizer/lr_scheduler.py)
    lr_wsd_decay_iters: Optional[int] = None
    lr_wsd_decay_samples: Optional[int] = None
    start_weight_decay: Optional[float] = None  # the weight decay's increment (None: --weight-decay throughout)
    end_weight_decay: Optional[float] = None
    weight_decay_incr_style: str = "constant"
    lr_warmup_iters: int = 0
    lr_decay_iters: Optional[int] = None
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    optimizer: str = "adam"  # adam, sgd, lion, muon (megalite/cli/features/optimizer.py has the flags' meaning)
    sgd_momentum: float = 0.9
    lion_beta1: float = 0.95
    lion_beta2: float = 0.98
    muon_momentum: float = 0.9
    muon_split_qkv: bool = True
    muon_nesterov: bool = False
    muon_scale_mode: str = "spectral"
    muon_fp32_matmul_prec: str = "medium"
    muon_coefficient_type: str = "quintic"
    muon_num_ns_steps: int = 5
    muon_tp_mode: str = "duplicated"
    muon_extra_scale_factor: float = 1.0
    muon_scalar_optimizer: str = "adam"
    qk_clip_threshold: float = 100.0  # --qk-clip (megalite/optimizer/qk_clip.py)
    qk_clip_alpha: float = 0.5
    bf16: bool = False
    fp16: bool = False
    loss_scale: Optional[float] = None  # constant fp16 scale; None = dynamic
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    log_interval: int = 1
    eval_interval: int = 1000
    eval_iters: int = 10
    seed: int = 1234
    fused_kernels: bool = True  # fused AdamW (Triton) on CUDA
    check_for_nan_in_grad: bool = True  # stop before an update with a NaN/Inf grad norm
    # --optimizer-cpu-offload: a fraction (one, or one per DP replica) of the optimizer on the host
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: object = 1.0
    overlap_cpu_optimizer_d2h_h2d: bool = False
    # one dynamic loss scale for every replica when any computes in fp16 (--data-parallel-precisions)
    loss_scaling: Optional[bool] = None
    train_samples: Optional[int] = None  # sample-based training (train_iters derived from it)
    lr_warmup_fraction: Optional[float] = None
    lr_warmup_samples: int = 0
    lr_decay_samples: Optional[int] = None
    lr_warmup_init: float = 0.0
    rampup_batch_size: Optional[list] = None  # [start, increment, ramp-up samples]
    use_checkpoint_opt_param_scheduler: bool = False
    override_opt_param_scheduler: bool = False
    decoupled_lr: Optional[float] = None  # the input embedding's and output layer's own peak LR
    decoupled_min_lr: Optional[float] = None  # ... and floor (default --min-lr)
    apply_wd_to_qk_layernorm: bool = False  # the q/k norms' weights decayed (optimizer.no_weight_decay)

    @property
    def params_dtype(self):
        return torch.bfloat16 if self.bf16 else torch.float16 if self.fp16 else torch.float32

    @property
    def scaled(self):
        """The loss is scaled (and each step checked for overflow): fp16, or a replica of a mixed run."""
        return self.fp16 if self.loss_scaling is None else self.loss_scaling

    def num_microbatches(self, dp):
        g, m = self.global_batch_size, self.micro_batch_size
        if g % (m * dp):
            raise ConfigError(f"--global-batch-size {g} is not divisible by --micro-batch-size {m} x "
                              f"data-parallel size {dp} = {m * dp}")
        return g // (m * dp)


# The optimizers' own fields (megalite/cli/features/optimizer.py has their flags, of the same names)
OPTIMIZER_FIELDS = tuple(f.name for f in fields(TrainingConfig) if f.name.startswith(("sgd_", "lion_", "muon_",
                                                                                      "qk_clip_")))
