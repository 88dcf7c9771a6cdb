"""Dynamic loss scaling for fp16 (Megatron's DynamicGradScaler semantics)."""

import torch


def unscale_and_find_inf_(grads, inv_scale, found_inf=None):
    """grads *= inv_scale in place and a 1-element fp32 device tensor that is 1.0 when any of
    them holds inf/NaN: one fused pass per device/dtype group
    (torch._amp_foreach_non_finite_check_and_unscale_), no host sync, no kernel per parameter."""
    groups = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    if found_inf is None:
        found_inf = torch.zeros(1, dtype=torch.float32, device=grads[0].device if grads else "cpu")
    for (dev, _), group in groups.items():
        flag = found_inf if dev == found_inf.device else torch.zeros(1, dtype=torch.float32, device=dev)
        inv = torch.full((), float(inv_scale), dtype=torch.float32, device=dev) \
            if not isinstance(inv_scale, torch.Tensor) else inv_scale.reshape(()).float().to(dev)
        torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv)
        if flag is not found_inf:
            found_inf.copy_(torch.maximum(found_inf, flag.to(found_inf.device)))
    return found_inf


class ConstantLossScaler:
    def __init__(self, scale=1.0):
        self.scale = float(scale)

    def update(self, found_inf):
        pass

    def state_dict(self):
        return {"scale": self.scale}

    def load_state_dict(self, sd):
        self.scale = sd["scale"]


class DynamicLossScaler:
    """Halve the scale after `hysteresis` overflowing steps; double it after
    `growth_interval` clean steps in a row; never below `min_scale`."""

    def __init__(self, initial_scale=2.0 ** 32, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=1000, hysteresis=2):
        self.scale = float(initial_scale)
        self.min_scale, self.growth_factor, self.backoff_factor = min_scale, growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self._growth_tracker, self._hysteresis_tracker = 0, hysteresis

    def update(self, found_inf):
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self):
        return {"scale": self.scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, sd):
        self.scale = sd["scale"]
        self._growth_tracker, self._hysteresis_tracker = sd["growth_tracker"], sd["hysteresis_tracker"]
