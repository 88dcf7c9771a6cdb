"""AdamW over fp32 main parameters, with Megatron's weight-decay groups.

fp32 models step their own parameters. bf16/fp16 models keep fp32 master copies (the
"main params"); gradients are read from the fp32 `main_grad` buffer the DDP wrapper
fills, so low-precision gradients are never accumulated. fp16 scales the loss and skips
a step (counted) whenever any rank of the model-parallel group saw inf/nan.

The update runs over flat buffers: per param group (decay / no decay) the fp32 main params,
exp_avg and exp_avg_sq are views into one contiguous buffer each, so one `kernels.adamw_step`
updates the whole group (Triton on CUDA; on CPU the torch fallback runs torch.optim.AdamW's
single-tensor ops, elementwise, so the numbers are bit-identical to stepping tensor by tensor).
An fp32 model's parameters move into that buffer (`.data` becomes a view); ZeRO's fp32 pieces
stay in the DDP parameter buffer and are gathered / scattered around the launch. Gradients are
read through one view where they lie back to back in the grad buffer, else gathered by one
torch.cat; bf16/fp16 copies come from the kernel's own pass or one foreach copy. The step count
is a Python int per group (no host read); `optimizer.state[p]` keeps torch's entries ("step",
"exp_avg", "exp_avg_sq", as views), so state dicts and checkpoints are unchanged.
"""

import contextlib
import itertools
import math

import torch
import torch.distributed as dist

from megalite import mup, parallel_state as ps
from megalite.optimizer import offload
from megalite.optimizer import updates
from megalite.optimizer.clip_grads import clip_grads, grad_norm_tensor
from megalite.optimizer.muon import Holding, MuonMatrices, is_muon_matrix
from megalite.optimizer.param_groups import AdamWState
from megalite.optimizer.loss_scaler import ConstantLossScaler, DynamicLossScaler, unscale_and_find_inf_


class NonFiniteGradError(RuntimeError):
    """The global grad norm is NaN/Inf (outside fp16 loss scaling); `param` names this rank's
    first non-finite gradient, or is None when the bad values live on another rank."""

    def __init__(self, grad_norm, param):
        super().__init__(f"grad norm {grad_norm}")
        self.grad_norm, self.param = grad_norm, param


def no_weight_decay(name, param, qk_decayed=False):
    """Megatron's rule: biases and norm weights (all 1-D parameters) are not decayed; qk_decayed
    (--apply-wd-to-qk-layernorm, Megatron's qwen3_next condition): the q/k layernorms' are."""
    if qk_decayed and ("q_layernorm" in name or "k_layernorm" in name):
        return False
    return param.ndim < 2 or name.endswith(".bias")


def _hyper(c, opt):
    """A param group's hyper-parameters of its optimizer (AdamW's are the container's defaults)."""
    if opt == "sgd":
        return {"momentum": c.sgd_momentum}
    if opt == "lion":
        return {"betas": (c.lion_beta1, c.lion_beta2)}
    if opt == "muon":
        return {"momentum": c.muon_momentum, "nesterov": c.muon_nesterov}
    return {}


def build_loss_scaler(c):
    if c.scaled and c.loss_scale:
        return ConstantLossScaler(c.loss_scale)
    if c.scaled:
        return DynamicLossScaler(c.initial_loss_scale, c.min_loss_scale,
                                 growth_interval=c.loss_scale_window, hysteresis=c.hysteresis)
    return ConstantLossScaler(1.0)


class _FlatGroup:
    """One param group on flat fp32 buffers. idx: positions in main_params / grads / copies, in
    buffer order; kind: its optimizer (adam, sgd, lion, muon); states: {torch's state name: flat
    buffer}; mains, views[name]: per position, views of main / of each state (mains are the model's
    own tensors when `own`; `main` is None for ZeRO's fp32 pieces)."""

    def __init__(self, idx, sizes, own, main, kind, states):
        self.idx, self.sizes, self.own, self.main, self.kind, self.states = idx, sizes, own, main, kind, states
        self.mains, self.views = [], {k: [] for k in states}
        self.step = 0  # a Python int: bias correction needs no host read
        self.step_t = torch.zeros((), dtype=torch.float32)  # torch's state["step"], shared by the group
        self.grad, self.group_index = None, 0  # a host group's gradient buffer (offload); its param group


def _flat_view(ts):
    """A 1-D view over tensors lying back to back, in this order, in one storage; else None."""
    first = ts[0]
    base, ptr, size = first.untyped_storage().data_ptr(), first.data_ptr(), first.element_size()
    for t in ts:
        if (t.dtype != first.dtype or t.data_ptr() != ptr or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != base):
            return None
        ptr += t.numel() * size
    return first.detach().as_strided(((ptr - first.data_ptr()) // size,), (1,), first.storage_offset())


def _flat_or_cat(ts):
    flat = _flat_view(ts)
    return flat if flat is not None else torch.cat([t.reshape(-1) for t in ts])


class MixedPrecisionOptimizer:
    def __init__(self, model_chunks, config):
        c = config
        self.config = c
        named = [(n, p) for m in model_chunks for n, p in m.named_parameters() if p.requires_grad]
        self.grid = ps.grid_of(model_chunks)
        self._mup_width = mup.width_mult(model_chunks)
        self.model_params = [p for _, p in named]
        self.names = [n for n, _ in named]  # aligned with _grads(), for error messages
        own = not (c.bf16 or c.fp16) and all(p.dtype == torch.float32 for p in self.model_params)
        self._build_groups(list(zip(self.names, self.model_params, self.model_params)), own, movable=True)

    def _holdings(self):
        """Muon's view of this rank's parameters: each whole."""
        return [Holding(p, [(0, p.numel())]) for p in self.model_params if is_muon_matrix(p)]

    def _held(self):
        """The model parameter behind each main param (ZeRO: behind each piece)."""
        return self.model_params

    def state_keys(self, main):
        """torch's state names of a main parameter's optimizer (besides "step")."""
        return updates.STATE_KEYS[self._kind_of[id(main)]]

    def _build_groups(self, triples, own, movable):
        """Megatron's decay / no-decay groups (per optimizer: --optimizer muon puts the hidden matrices
        in Muon's, the rest in --muon-scalar-optimizer's) over flat fp32 buffers, AdamWState (torch.optim's
        layout) as the container of groups and state, the loss scaler.
        triples: (name, model param (picks the group), tensor holding the values).
        own: the values are fp32 and are stepped in place (fp32 models); movable: they are whole
        parameters that may move into the flat buffer (ZeRO pieces live in the DDP buffer)."""
        c = self.config
        self.main_params, self._flat, groups = [None] * len(triples), [], []
        order = self._layout_order(len(triples))
        # --decoupled-lr: the input embedding and output layer form groups of their own, which
        # the LR scheduler steps to their own peak and floor (Megatron's param-group override).
        # muP: hidden matrices form groups whose peak / floor LR and Adam eps are x 1/m (megalite/mup.py).
        split = getattr(c, "decoupled_lr", None) is not None
        width = self._mup_width
        mults = sorted({mup.lr_mult(*triples[i][:2], width) for i in order}, reverse=True)

        muon = c.optimizer == "muon"
        kinds = ("muon", c.muon_scalar_optimizer) if muon else (c.optimizer,)

        def kind(name, param):
            decoupled = split and getattr(param, "is_embedding_or_output_parameter", False)
            opt = kinds[0] if not muon or is_muon_matrix(param) else kinds[1]
            decay = not no_weight_decay(name, param, getattr(c, "apply_wd_to_qk_layernorm", False))
            return opt, decay, decoupled, mup.lr_mult(name, param, width)
        fraction, device = offload.fraction_for_rank(c, self.grid), triples[0][2].device if triples else ps.get_device()
        self.offload, self._host = offload.OffloadStats(), None
        with torch.no_grad():
            for key in itertools.product(kinds, (True, False), (False, True) if split else (False,), mults):
                idx = [i for i in order if kind(*triples[i][:2]) == key]
                if idx:
                    opt, decay, decoupled, mult = key
                    on_host, on_device = offload.host_split(idx, [triples[i][2].numel() for i in idx], fraction)
                    for part, host in ((on_device, False), (on_host, True)):  # --optimizer-cpu-offload: F on the host
                        if part:
                            grp = self._flat_group(part, [triples[i][2] for i in part], own and not host, movable,
                                                   opt, host)
                            grp.group_index = len(groups)
                            self._flat.append(grp)
                    groups.append({"params": [self.main_params[i] for i in sorted(idx)],
                                   "weight_decay": c.weight_decay if decay else 0.0, "decay": decay,
                                   "decoupled": decoupled, "optimizer": opt, **_hyper(c, opt),
                                   **({"mup_lr_mult": mult, "eps": c.adam_eps * mult} if mult != 1.0 else {})})
        self.optimizer = AdamWState(groups, lr=c.lr, betas=(c.adam_beta1, c.adam_beta2), eps=c.adam_eps)
        self._kind_of = {id(mp): grp.kind for grp in self._flat for mp in grp.mains}
        for grp in self._flat:  # torch's state entries, as views: state dicts and checkpoints read them
            for j, mp in enumerate(grp.mains):
                self.optimizer.state[mp] = {"step": grp.step_t, **{k: v[j] for k, v in grp.views.items()}}
        self.scaler = build_loss_scaler(c)
        self._muon = MuonMatrices(self._holdings(), c) if muon else None
        self._host = offload.HostSteps(self.offload, c.overlap_cpu_optimizer_d2h_h2d, device) \
            if self.offload.host_elements else None

    def _flat_group(self, idx, values, own, movable, kind="adam", host=False):
        """host: the group lives in host memory (--optimizer-cpu-offload): its main values are
        copies there (never the model's tensors), with a host buffer for its gradients."""
        sizes = [t.numel() for t in values]
        total = sum(sizes)

        def buffer():
            if host:
                return offload.host_buffer(total, values[0].device)
            return torch.zeros(total, dtype=torch.float32, device=values[0].device)
        grp = _FlatGroup(idx, sizes, own, None if own and not movable else buffer(), kind,
                         {k: buffer() for k in updates.STATE_KEYS[kind]})
        grp.grad = buffer() if host else None
        if host:
            self.offload.host_elements += total
        else:
            self.offload.device_elements += total
        for i, t, off, n in zip(idx, values, itertools.accumulate([0] + sizes), sizes):
            for k, buf in grp.states.items():
                grp.views[k].append(buf[off:off + n].view(t.shape))
            mp = t
            if grp.main is not None:
                mp = grp.main[off:off + n].view(t.shape)
                mp.copy_(t)
                if own:  # an fp32 parameter moves into the buffer and stays its own main param
                    t.data, mp = mp, t
            grp.mains.append(mp)
            self.main_params[i] = mp
        return grp

    def _layout_order(self, n):
        """Flat-buffer order: the grad buffer's where all grads live in one (then a group whose
        grads lie back to back is read through one view, no gather); else parameter order."""
        grads = self._grads()
        if all(g is not None for g in grads) and len({g.untyped_storage().data_ptr() for g in grads}) == 1:
            return sorted(range(n), key=lambda i: grads[i].data_ptr())
        return list(range(n))

    def release_model_params(self):
        """The fp32 parameters this optimizer moved into its flat buffers get storages of their own
        again, before another optimizer is built over the same model (one that keeps some of them on the
        host would otherwise keep this one's whole buffer alive through them)."""
        with torch.no_grad():
            for grp in self._flat:
                if grp.own and grp.main is not None:
                    for t in grp.mains:
                        t.data = t.detach().clone()

    @property
    def param_groups(self):  # torch's load_state_dict replaces the list: always read it through
        return self.optimizer.param_groups

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
        return (self.grid.mp_group,)

    def _grad_norm(self, grads):
        return grad_norm_tensor(self.model_params, grads)

    def _copies(self):
        """Where the updated values go: the model's parameters."""
        return self.model_params

    def _after_step(self):
        pass

    @torch.no_grad()
    def publish_main_params(self):
        """The main params were set from outside the step (the semi-synchronous outer step): the model's
        copies take them, and are gathered as after a step."""
        pairs = [(out, m) for out, m in zip(self._copies(), self.main_params) if out is not m]
        if pairs:
            torch._foreach_copy_([o for o, _ in pairs], [m for _, m in pairs])
        self._after_step()

    @torch.no_grad()
    def step(self):
        """Returns (stepped, grad_norm); stepped is False for a skipped fp16 iteration."""
        grads = self._grads()
        c = self.config
        found_inf = self._unscale_found_inf(grads, 1.0 / self.scaler.scale) if c.scaled else None
        grad_norm = self._grad_norm(grads)  # a device tensor: clipping needs no host read
        if c.scaled or c.check_for_nan_in_grad:
            # The iteration's one host read: fp16's skip decision and the NaN check together.
            inf, norm = torch.cat([found_inf if found_inf is not None else torch.zeros_like(grad_norm.reshape(1)),
                                   grad_norm.reshape(1).float()]).tolist()
            if c.scaled:
                self.scaler.update(bool(inf))
                if inf:
                    return False, None
            if c.check_for_nan_in_grad and not math.isfinite(norm):
                # Before the update: a NaN norm would disable clipping and write NaN into every weight.
                bad = next((n for n, g in zip(self.names, grads) if not torch.isfinite(g).all()), None)
                raise NonFiniteGradError(norm, bad)
        clip_grads(grads, c.clip_grad, grad_norm)
        self._update(grads, self._copies())
        self._after_step()
        return True, grad_norm

    def _update(self, grads, copies):
        """One update per param group over its flat buffers (AdamW: one kernels.adamw_step, Triton on
        CUDA, torch ops on CPU), model copies written in the same pass or by one foreach copy. Muon's
        matrices are orthogonalised first, all at once (a collective under ZeRO and TP)."""
        import kernels
        with contextlib.nullcontext() if self.config.fused_kernels else kernels.use_backend("torch"):
            groups = self.optimizer.param_groups
            for grp in self._flat:
                self._adopt_state(grp)
                grp.step += 1
                grp.step_t.fill_(grp.step)  # torch's state["step"], for state dicts (host tensor)
                if grp.grad is not None:  # offloaded: its gradients go down first (overlapped: while
                    self._host.down(grp, _flat_or_cat([grads[i] for i in grp.idx]))  # the device steps)
            flat_grads = {id(grp): _flat_or_cat([grads[i] for i in grp.idx]) for grp in self._flat if grp.grad is None}
            # Muon's matrices: every momentum first, then all orthogonalised at once (collectives under ZeRO, TP)
            orthogonal = self._muon.group_updates(self._flat, groups, self._held(), flat_grads) if self._muon else {}

            def adamw(grp, main, grad, out=None):
                group = groups[grp.group_index]
                beta1, beta2 = group["betas"]
                kernels.adamw_step(main, grad, grp.states["exp_avg"], grp.states["exp_avg_sq"], step=grp.step,
                                   lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                                   weight_decay=group["weight_decay"], model_params=out)
            for grp in self._flat:
                if grp.grad is not None:
                    continue
                scatter, out, outs = False, None, None
                if grp.own:  # the model's fp32 tensors: in the buffer unless they are ZeRO pieces
                    main = _flat_view(grp.mains)
                    if main is None:
                        main, scatter = torch.cat([t.reshape(-1) for t in grp.mains]), True
                else:
                    main, outs = grp.main, [copies[i] for i in grp.idx]
                    out = _flat_view(outs)
                if grp.kind == "adam":
                    adamw(grp, main, flat_grads[id(grp)], out)
                else:
                    updates.step_(grp.kind, groups[grp.group_index], main, flat_grads[id(grp)], grp.states,
                                  orthogonal.get(id(grp)))
                    if out is not None:
                        out.copy_(main)
                if scatter:
                    torch._foreach_copy_([t.view(-1) for t in grp.mains], main.split(grp.sizes))
                elif outs is not None and out is None:
                    torch._foreach_copy_(outs, grp.mains)
            if self._host is not None:
                for grp in self._flat:
                    if grp.grad is not None:
                        self._host.step(grp, [copies[i] for i in grp.idx], lambda main, grad: adamw(grp, main, grad))
                self._host.end()

    def _adopt_state(self, grp):
        """Keep optimizer.state's entries on the flat buffers and the step in grp.step. Loading
        replaces them (checkpoint loading sets new "step" tensors, torch's load_state_dict whole
        entries): their values are copied in, once; otherwise this reads nothing."""
        state = self.optimizer.state
        if all(state[mp].get("step") is grp.step_t and all(state[mp].get(k) is v[j] for k, v in grp.views.items())
               for j, mp in enumerate(grp.mains)):
            return
        steps = []
        for j, mp in enumerate(grp.mains):
            st = state[mp]
            for k, views in grp.views.items():
                if k not in st:
                    views[j].zero_()
                elif st[k] is not views[j]:
                    views[j].copy_(st[k])
            steps.append(float(st["step"]) if "step" in st else 0.0)  # a host tensor, as torch keeps it
            state[mp] = {"step": grp.step_t, **{k: v[j] for k, v in grp.views.items()}}
        grp.step = int(max(steps))  # one count per group: its tensors are always stepped together
        grp.step_t.fill_(grp.step)

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict(),
                "main_params": [m.detach() for m in self.main_params]}

    def load_state_dict(self, sd):
        self.optimizer.load_state_dict(sd["optimizer"])
        for grp in self._flat:
            self._adopt_state(grp)  # the loaded values into the flat buffers
        self.scaler.load_state_dict(sd["scaler"])
        with torch.no_grad():
            for m, s, out in zip(self.main_params, sd["main_params"], self.model_params):
                m.copy_(s)
                if out is not m:
                    out.copy_(m)  # the model computes with the loaded weights too
