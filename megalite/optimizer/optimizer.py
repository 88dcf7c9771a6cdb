"""AdamW over fp32 main parameters, with Megatron's weight-decay groups.

fp32 models step their own parameters. bf16/fp16 models keep fp32 master copies (the
"main params"); gradients are read from the fp32 `main_grad` buffer the DDP wrapper
fills, so low-precision gradients are never accumulated. fp16 scales the loss and skips
a step (counted) whenever any rank of the model-parallel group saw inf/nan.
"""

import math

import torch
import torch.distributed as dist

from megalite import parallel_state as ps
from megalite.optimizer.clip_grads import clip_grads, grad_norm_tensor
from megalite.optimizer.loss_scaler import ConstantLossScaler, DynamicLossScaler, unscale_and_find_inf_


class NonFiniteGradError(RuntimeError):
    """The global grad norm is NaN/Inf (outside fp16 loss scaling); `param` names this rank's
    first non-finite gradient, or is None when the bad values live on another rank."""

    def __init__(self, grad_norm, param):
        super().__init__(f"grad norm {grad_norm}")
        self.grad_norm, self.param = grad_norm, param


def no_weight_decay(name, param):
    """Megatron's rule: biases and norm weights (all 1-D parameters) are not decayed."""
    return param.ndim < 2 or name.endswith(".bias")


def build_loss_scaler(c):
    if c.fp16 and c.loss_scale:
        return ConstantLossScaler(c.loss_scale)
    if c.fp16:
        return DynamicLossScaler(c.initial_loss_scale, c.min_loss_scale,
                                 growth_interval=c.loss_scale_window, hysteresis=c.hysteresis)
    return ConstantLossScaler(1.0)


class MixedPrecisionOptimizer:
    def __init__(self, model_chunks, config):
        c = config
        self.config = c
        named = [(n, p) for m in model_chunks for n, p in m.named_parameters() if p.requires_grad]
        self.model_params = [p for _, p in named]
        self.names = [n for n, _ in named]  # aligned with _grads(), for error messages
        low_precision = c.bf16 or c.fp16
        self.main_params = [p.detach().float().clone() if low_precision else p for p in self.model_params]
        for mp in self.main_params:
            mp.requires_grad_(True)
        self._build_adamw([(n, p, m) for (n, p), m in zip(named, self.main_params)])

    def _build_adamw(self, triples):
        """torch AdamW over the main params, Megatron's decay / no-decay groups, loss scaler.
        triples: (name, model param, main param)."""
        c = self.config
        decay = [m for n, p, m in triples if not no_weight_decay(n, p)]
        nodecay = [m for n, p, m in triples if no_weight_decay(n, p)]
        groups = [g for g in ({"params": decay, "weight_decay": c.weight_decay},
                              {"params": nodecay, "weight_decay": 0.0}) if g["params"]]
        self.optimizer = torch.optim.AdamW(groups, lr=c.lr, betas=(c.adam_beta1, c.adam_beta2), eps=c.adam_eps)
        self.scaler = build_loss_scaler(c)
        self.param_groups = self.optimizer.param_groups

    @property
    def loss_scale(self):
        return self.scaler.scale

    def scale_loss(self, loss):
        return loss * self.scaler.scale

    def _grads(self):
        return [p.main_grad if getattr(p, "main_grad", None) is not None else p.grad for p in self.model_params]

    def _unscale_found_inf(self, grads, inv_scale):
        """grads *= inv_scale and whether any rank saw inf/NaN: one fused pass per dtype group
        (no kernel or host sync per parameter), one all-reduce, one host read."""
        flag = unscale_and_find_inf_(grads, inv_scale, torch.zeros(1, dtype=torch.float32, device=ps.get_device()))
        # Every rank must take the same decision to skip, or the grid diverges.
        for group in self._inf_groups():
            if group is not None:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return flag

    def _inf_groups(self):
        return (ps.get_model_parallel_group(),)

    def _grad_norm(self, grads):
        return grad_norm_tensor(self.model_params, grads)

    def _copies(self):
        """Where the updated values go: the model's parameters."""
        return self.model_params

    def _after_step(self):
        pass

    @torch.no_grad()
    def step(self):
        """Returns (stepped, grad_norm); stepped is False for a skipped fp16 iteration."""
        grads = self._grads()
        c = self.config
        found_inf = self._unscale_found_inf(grads, 1.0 / self.scaler.scale) if c.fp16 else None
        grad_norm = self._grad_norm(grads)  # a device tensor: clipping needs no host read
        if c.fp16 or c.check_for_nan_in_grad:
            # The iteration's one host read: fp16's skip decision and the NaN check together.
            inf, norm = torch.cat([found_inf if found_inf is not None else torch.zeros_like(grad_norm.reshape(1)),
                                   grad_norm.reshape(1).float()]).tolist()
            if c.fp16:
                self.scaler.update(bool(inf))
                if inf:
                    return False, None
            if c.check_for_nan_in_grad and not math.isfinite(norm):
                # Before the update: a NaN norm would disable clipping and write NaN into every weight.
                bad = next((n for n, g in zip(self.names, grads) if not torch.isfinite(g).all()), None)
                raise NonFiniteGradError(norm, bad)
        clip_grads(grads, c.clip_grad, grad_norm)
        self._adam_update(grads, self._copies())
        self._after_step()
        return True, grad_norm

    def _adam_update(self, grads, copies):
        """AdamW over the fp32 main params; then each model copy takes the new values.
        On CUDA with fused kernels, one Triton pass per tensor does both, keeping torch's
        optimizer-state layout so state dicts do not change."""
        import kernels
        # Triton on CUDA; also when a test forces the Triton backend (interpreter on CPU).
        if self.config.fused_kernels and (self.main_params[0].is_cuda or kernels.get_backend() == "triton"):
            if not hasattr(self, "_main_index"):  # group order -> position in main_params, once
                self._main_index = {id(m): i for i, m in enumerate(self.main_params)}
            where = self._main_index
            for group in self.optimizer.param_groups:
                beta1, beta2 = group["betas"]
                for mp in group["params"]:
                    i = where[id(mp)]
                    st = self.optimizer.state[mp]
                    if not st:
                        st["step"] = torch.zeros((), dtype=torch.float32)
                        st["exp_avg"] = torch.zeros_like(mp)
                        st["exp_avg_sq"] = torch.zeros_like(mp)
                    st["step"] += 1
                    out = copies[i]
                    kernels.adamw_step(mp.view(-1), grads[i].reshape(-1), st["exp_avg"].view(-1),
                                       st["exp_avg_sq"].view(-1), step=int(st["step"].item()), lr=group["lr"],
                                       beta1=beta1, beta2=beta2, eps=group["eps"],
                                       weight_decay=group["weight_decay"],
                                       model_params=None if out is mp else out.view(-1))
            return
        for mp, g in zip(self.main_params, grads):
            mp.grad = g if g.dtype == torch.float32 else g.float()
        self.optimizer.step()
        for mp, out in zip(self.main_params, copies):
            mp.grad = None
            if out is not mp:
                out.copy_(mp)

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict(),
                "main_params": [m.detach() for m in self.main_params]}

    def load_state_dict(self, sd):
        self.optimizer.load_state_dict(sd["optimizer"])
        self.scaler.load_state_dict(sd["scaler"])
        with torch.no_grad():
            for m, s, out in zip(self.main_params, sd["main_params"], self.model_params):
                m.copy_(s)
                if out is not m:
                    out.copy_(m)  # the model computes with the loaded weights too
