"""Fused AdamW over one flat fp32 buffer per param group (megalite/optimizer/optimizer.py):
the same numbers as torch.optim.AdamW stepping tensor by tensor, one kernels.adamw_step per
group per step, no host read in the update, and state dicts that round-trip with their
entries still views of the flat buffers. In process (DP = 1), no spawned ranks."""

import io

import pytest
import torch
from torch import nn

import kernels
from megalite import parallel_state as ps
from megalite.config import TrainingConfig
from megalite.distributed import DistributedDataParallel
from megalite.distributed import DistributedDataParallelConfig as DDPConfig
from megalite.optimizer import MixedPrecisionOptimizer
from megalite.optimizer.distributed_optimizer import DistributedOptimizer
from megalite.optimizer.optimizer import no_weight_decay
from sync_count import SyncCounter

HP = dict(lr=1e-2, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6)
STEPS = 4


@pytest.fixture(autouse=True)
def single():
    ps.initialize_model_parallel(1, 1)
    yield
    ps.destroy_model_parallel()


class Mixed(nn.Module):
    """Odd shapes in both groups: matrices and a 3-D tensor (decay), biases, a norm weight and a
    1-D vector (no decay). nobias: matrices only, so a single (decay) group."""

    def __init__(self, dtype, nobias=False):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(37, 100, bias=not nobias)
        self.b = nn.Linear(100, 13, bias=not nobias)
        self.c = nn.Parameter(torch.randn(3, 5, 7))
        if not nobias:
            self.norm = nn.LayerNorm(100)
            self.d = nn.Parameter(torch.randn(1000))
        self.to(dtype)


def _build(dtype=torch.float32, wrap=None, nobias=False, **tkw):
    """wrap: None (grads in p.grad), "ddp" (main_grad in the DDP buffer) or "zero" (ZeRO-1, DP 1)."""
    model = Mixed(dtype, nobias)
    kw = {"clip_grad": 0.0, "check_for_nan_in_grad": False, **HP, **tkw}
    tcfg = TrainingConfig(global_batch_size=1, bf16=dtype == torch.bfloat16, **kw)
    if wrap is None:
        return model, model, MixedPrecisionOptimizer([model], tcfg)
    ddp = DistributedDataParallel(model, DDPConfig(bucket_size=1500, use_distributed_optimizer=wrap == "zero"))
    return model, ddp, (DistributedOptimizer if wrap == "zero" else MixedPrecisionOptimizer)([ddp], tcfg)


def _grads(model, step):
    """Values exact in bf16 (so every path holds the same gradient), growing with the step."""
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=g).bfloat16().float() * 2.0 ** step for n, p in model.named_parameters()}


def _set_grads(model, grads):
    for n, p in model.named_parameters():
        if getattr(p, "main_grad", None) is not None:
            p.main_grad.copy_(grads[n])
        else:
            p.grad = grads[n].to(p.dtype)


class Reference:
    """torch.optim.AdamW, one tensor at a time (foreach=False), on fp32 copies, same groups."""

    def __init__(self, model):
        named = list(model.named_parameters())
        self.params = {n: p.detach().float().clone().requires_grad_() for n, p in named}
        groups = [{"params": [self.params[n] for n, p in named if not no_weight_decay(n, p)],
                   "weight_decay": HP["weight_decay"]},
                  {"params": [self.params[n] for n, p in named if no_weight_decay(n, p)], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=HP["lr"], eps=HP["adam_eps"],
                                     betas=(HP["adam_beta1"], HP["adam_beta2"]), foreach=False)

    def step(self, grads):
        for n, r in self.params.items():
            r.grad = grads[n].clone()
        self.opt.step()


def _check_equal(model, opt, ref, dtype):
    """Bit-identical main params, Adam states and steps; model params = main params rounded."""
    mains = {n.removeprefix("module."): m for n, m in zip(opt.names, opt.main_params)}
    for n, p in model.named_parameters():
        r = ref.params[n]
        st, rst = opt.optimizer.state[mains[n]], ref.opt.state[r]
        assert torch.equal(mains[n].view(r.shape), r.detach()), n
        assert torch.equal(p.detach(), r.detach().to(dtype)), n
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[k].view(r.shape), rst[k]), f"{n}.{k}"
        assert float(st["step"]) == float(rst["step"]), n


@pytest.mark.parametrize("dtype,wrap", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, "ddp"),
                                        (torch.bfloat16, "ddp"), (torch.float32, "zero"), (torch.bfloat16, "zero")])
def test_flat_update_equals_torch_adamw_per_tensor(dtype, wrap):
    model, _, opt = _build(dtype, wrap)
    ref = Reference(model)
    assert len(opt.param_groups) == 2
    for step in range(STEPS):
        grads = _grads(model, step)
        _set_grads(model, grads)
        assert opt.step()[0]
        ref.step(grads)
        _check_equal(model, opt, ref, dtype)
    _assert_views_of_flat_buffers(opt)


def _record_launches(monkeypatch):
    calls, real = [], kernels.adamw_step

    def adamw_step(params, grads, *a, **k):
        calls.append({"numel": params.numel(), "grad_storage": grads.untyped_storage().data_ptr(),
                      "model_params": k.get("model_params") is not None})
        return real(params, grads, *a, **k)
    monkeypatch.setattr(kernels, "adamw_step", adamw_step)
    return calls


@pytest.mark.parametrize("dtype,wrap", [(torch.float32, None), (torch.bfloat16, "ddp"), (torch.bfloat16, "zero")])
def test_one_launch_per_param_group(monkeypatch, dtype, wrap):
    model, _, opt = _build(dtype, wrap)
    calls = _record_launches(monkeypatch)
    sizes = [sum(p.numel() for p in g["params"]) for g in opt.param_groups]
    for step in range(2):
        _set_grads(model, _grads(model, step))
        opt.step()
    # one call per group covering all of it, not one per tensor
    assert [c["numel"] for c in calls] == sizes * 2 and len(sizes) == 2 < len(list(model.parameters())), calls


@pytest.mark.parametrize("wrap", ["ddp", "zero"])
def test_single_group_reads_the_buffers_in_place(monkeypatch, wrap):
    """Matrices only, so one group whose grads lie back to back in the DDP grad buffer: the
    kernel reads them through one view (no gather); under ZeRO the bf16 parameter buffer is
    contiguous too and takes the new values in the kernel's own pass."""
    model, ddp, opt = _build(torch.bfloat16, wrap, nobias=True)
    ref = Reference(model)
    calls = _record_launches(monkeypatch)
    for step in range(2):
        grads = _grads(model, step)
        _set_grads(model, grads)
        opt.step()
        ref.step(grads)
    assert len(calls) == 2 and {c["grad_storage"] for c in calls} == {ddp.grad_data.untyped_storage().data_ptr()}
    assert [c["model_params"] for c in calls] == [wrap == "zero"] * 2, calls
    _check_equal(model, opt, ref, torch.bfloat16)


@pytest.mark.parametrize("wrap", [None, "zero"])
def test_update_reads_nothing_on_the_host(wrap):
    model, _, opt = _build(torch.bfloat16, wrap, clip_grad=1.0)
    for step in range(3):
        _set_grads(model, _grads(model, step))
        with SyncCounter() as sc:
            stepped, norm = opt.step()
        assert sc.count == 0, sc.calls
    assert stepped and float(opt.optimizer.state[opt.main_params[0]]["step"]) == 3.0


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf)


def _assert_views_of_flat_buffers(opt):
    """Every group's exp_avg and exp_avg_sq entries are views of its flat buffers (after a load
    too: torch.load alone gives views of *a* shared storage), its main params (an fp32 model's
    own parameters) views of one storage."""
    for grp, g in zip(opt._flat, opt.param_groups):
        for k in ("exp_avg", "exp_avg_sq"):
            flat = grp.states[k].untyped_storage().data_ptr()
            assert {opt.optimizer.state[p][k].untyped_storage().data_ptr() for p in g["params"]} == {flat}, k
        assert len({p.untyped_storage().data_ptr() for p in g["params"]}) == 1


@pytest.mark.parametrize("dtype,wrap", [(torch.float32, None), (torch.bfloat16, "ddp"), (torch.bfloat16, "zero")])
def test_state_dict_round_trip(dtype, wrap):
    model, _, opt = _build(dtype, wrap)
    ref = Reference(model)
    for step in range(3):
        grads = _grads(model, step)
        _set_grads(model, grads)
        opt.step()
        ref.step(grads)
    sd = _roundtrip(opt.state_dict())
    if wrap != "zero":  # torch's own state-dict format, entry for entry
        rsd = ref.opt.state_dict()
        keys = ("params", "lr", "betas", "eps", "weight_decay")
        assert [{k: g[k] for k in keys} for g in sd["optimizer"]["param_groups"]] == \
            [{k: g[k] for k in keys} for g in rsd["param_groups"]]
        assert {i: sorted(st) for i, st in sd["optimizer"]["state"].items()} == \
            {i: sorted(st) for i, st in rsd["state"].items()}
    model2, _, opt2 = _build(dtype, wrap)
    opt2.load_state_dict(sd)
    _assert_views_of_flat_buffers(opt2)
    for step in range(3, 5):
        grads = _grads(model, step)
        for m, o in ((model, opt), (model2, opt2)):
            _set_grads(m, grads)
            o.step()
        ref.step(grads)
    _check_equal(model2, opt2, ref, dtype)
    _check_equal(model, opt, ref, dtype)


def test_step_replaced_from_outside_is_adopted():
    """Checkpoint loading (megalite/checkpoint/state.py) sets new "step" tensors in
    optimizer.state: the next update's bias correction must count from them."""
    model, _, opt = _build()
    ref = Reference(model)
    grads = _grads(model, 0)
    _set_grads(model, grads)
    opt.step()
    ref.step(grads)
    for o in (opt.optimizer, ref.opt):
        for p in o.state:
            o.state[p]["step"] = torch.tensor(6.0)
    grads = _grads(model, 1)
    _set_grads(model, grads)
    opt.step()
    ref.step(grads)
    _check_equal(model, opt, ref, torch.float32)
    _assert_views_of_flat_buffers(opt)
