"""AdamW's param groups and per-parameter state, in torch.optim's layout, without torch.optim.

megalite's optimizers step flat fp32 buffers themselves (optimizer.py); they need only the
container part of an optimizer: `param_groups` (hyper-parameters, read by the LR scheduler
and the update), `state` ({main param: {"step", "exp_avg", "exp_avg_sq"}}, read by
checkpoints), and `state_dict()` / `load_state_dict()` in torch's format ({"state": {index:
...}, "param_groups": [{..., "params": [index, ...]}]}). Building a torch.optim optimizer
for that imports torch._dynamo, 3.5 s of start-up on every rank of every job.
"""

import collections

import torch


class AdamWState:
    def __init__(self, groups, lr, betas, eps):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0, "amsgrad": False, "maximize": False}
        self.param_groups = [{**defaults, **g, "params": list(g["params"])} for g in groups]
        self.state = collections.defaultdict(dict)

    def _params(self):
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self):
        index = {id(p): i for i, p in enumerate(self._params())}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
                  for g in self.param_groups]
        return {"state": {index[id(p)]: dict(st) for p, st in self.state.items() if id(p) in index and st},
                "param_groups": groups}

    def load_state_dict(self, sd):
        """As torch.optim.Optimizer.load_state_dict: groups matched in order and by size; state
        tensors copied to each parameter's device (float moments in the parameter's dtype)."""
        saved = sd["param_groups"]
        if len(saved) != len(self.param_groups) or \
                any(len(s["params"]) != len(g["params"]) for s, g in zip(saved, self.param_groups)):
            raise ValueError("loaded state dict has a different number of parameter groups or parameters "
                             "per group than this optimizer")
        by_index = {i: p for s, g in zip(saved, self.param_groups) for i, p in zip(s["params"], g["params"])}
        self.state = collections.defaultdict(dict)
        for i, st in sd["state"].items():
            p = by_index[int(i)]
            self.state[p] = {k: (v.detach().clone() if k == "step" else v.detach().to(p.device, p.dtype, copy=True))
                             if torch.is_tensor(v) else v for k, v in st.items()}
        for s, g in zip(saved, self.param_groups):
            g.update({k: v for k, v in s.items() if k != "params"})
