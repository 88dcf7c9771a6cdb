"""The elementwise rules of the optimizers other than AdamW (whose rule is kernels.adamw_step), over a
param group's flat fp32 buffers: main values, gradient and the optimizer's state, in place.

Each follows the implementation Megatron-LM runs for its `--optimizer`: SGD is torch.optim.SGD
(momentum without dampening, weight decay added to the gradient); Lion and Muon are Megatron's
emerging_optimizers rules (weight decay decoupled: p -= lr * wd * p, before the update). Muon's
elementwise half is its momentum; the orthogonalisation of whole matrices is megalite/optimizer/muon.py.
"""

import torch

# torch.optim's state names per optimizer ("step" besides, for every kind)
STATE_KEYS = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",), "lion": ("exp_avg",),
              "muon": ("momentum_buffer",)}


def sgd_(main, grad, buf, lr, weight_decay, momentum):
    g = grad.add(main, alpha=weight_decay) if weight_decay else grad
    if momentum:
        g = buf.mul_(momentum).add_(g)  # the first step: 0 * momentum + g = g, torch's clone of g
    main.add_(g, alpha=-lr)


def lion_(main, grad, exp_avg, lr, weight_decay, beta1, beta2):
    if weight_decay:
        main.add_(main, alpha=-weight_decay * lr)
    update = torch.sign(exp_avg.lerp(grad, 1 - beta1))
    exp_avg.lerp_(grad, 1 - beta2)
    main.add_(update, alpha=-lr)


def muon_momentum_(grad, buf, momentum, nesterov):
    """The momentum Muon orthogonalises (EMA-style, as Megatron's and torch.optim.Muon's)."""
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf


def muon_apply_(main, update, lr, weight_decay):
    if weight_decay:
        main.add_(main, alpha=-weight_decay * lr)
    main.add_(update, alpha=-lr)


def step_(kind, group, main, grad, states, orthogonal=None):
    """One param group's update by its optimizer's rule (not AdamW's); Muon's `orthogonal`: its matrices'
    orthogonalised update, flat as main."""
    lr, wd = group["lr"], group["weight_decay"]
    if kind == "sgd":
        sgd_(main, grad, states["momentum_buffer"], lr, wd, group["momentum"])
    elif kind == "lion":
        lion_(main, grad, states["exp_avg"], lr, wd, *group["betas"])
    else:
        muon_apply_(main, orthogonal, lr, wd)
