"""The PyTorch-native peer of `pretrain_gpt.py` for the peers benchmark: a plain Llama-shaped `nn.Module`
(Hugging Face LlamaForCausalLM's parameter names, so a `save_pretrained` directory loads into it as is)
trained on CPU ranks (gloo) or GPUs (NCCL, --device cuda) and parallelised only with PyTorch's own APIs,
composed the way torchtitan's documentation shows:

  fsdp   DP4, `fully_shard` (FSDP2) on every block and on the root, resharded after forward (ZeRO-3)
  tp_sp  TP2 + sequence parallel (`parallelize_module`) x DP2 (`fully_shard` over "dp")
  pp     PP2 (`PipelineStage` + `Schedule1F1B`, split by hand) x DP2 (`fully_shard` over "dp")
  tp_pp  TP2 x PP2
  cp     CP2 (`context_parallel`) x DP2 (`fully_shard` over the flattened dp x cp ranks); on CPU it exits 2
         with PyTorch's error (torch 2.13's ring attention covers only the CUDA SDPA kernels)
  one    one rank (one GPU: NCCL takes one GPU per rank), `fully_shard` on it as torchtitan applies it there

    python -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/peers_native.py \
        --layout fsdp --init HF_DIR --batches batches.pt --micro-batch-size 1 --lr 1e-3 ...

Training: AdamW (foreach=True, as torchtitan builds it), constant learning rate, weight decay on parameters
with ndim >= 2 only, no clipping, no dropout, fp32. A step's loss is the mean token cross-entropy over the
global batch: each micro-batch's mean, averaged over micro-batches and data-parallel (and CP) ranks.
Rank 0 prints one JSON line per step: {"iteration", "loss", "step_ms"}; nothing else goes to stdout.
`save_initial(...)` writes the seeded Hugging Face starting point; importing this file starts nothing.
"""

import argparse
import copy
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

LAYOUTS = {"fsdp": {"dp": 4}, "tp_sp": {"dp": 2, "tp": 2}, "pp": {"pp": 2, "dp": 2},
           "tp_pp": {"pp": 2, "tp": 2}, "cp": {"dp": 2, "cp": 2}, "one": {"dp": 1}}


def save_initial(directory, hidden, layers, heads, kv_heads, ffn, vocab, seq, seed):
    """A seeded random fp32 `transformers.LlamaForCausalLM` saved with `save_pretrained` (safetensors)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(directory, safe_serialization=True)


# ---------------------------------------------------------------------------------------------- model

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Causal GQA self-attention. Head counts come from the projections' (local) widths, so the same code
    runs on the whole model and on a tensor-parallel shard of its heads."""

    def __init__(self, hidden, heads, kv_heads, head_dim):
        super().__init__()
        self.head_dim, self.n_rep = head_dim, heads // kv_heads
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x, cos, sin):
        b, s = x.shape[0], x.shape[1]
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(self.n_rep, dim=1), v.repeat_interleave(self.n_rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden"], c["eps"])
        self.self_attn = Attention(c["hidden"], c["heads"], c["kv_heads"], c["head_dim"])
        self.post_attention_layernorm = RMSNorm(c["hidden"], c["eps"])
        self.mlp = MLP(c["hidden"], c["ffn"])

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab"], c["hidden"])
        self.layers = nn.ModuleDict({str(i): Block(c) for i in range(c["layers"])})  # names survive a PP split
        self.norm = RMSNorm(c["hidden"], c["eps"])
        inv_freq = 1.0 / (c["theta"] ** (torch.arange(0, c["head_dim"], 2, dtype=torch.int64).float() / c["head_dim"]))
        freqs = torch.outer(torch.arange(c["seq"], dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [seq, head_dim], Hugging Face's non-interleaved layout
        self.register_buffer("rope_cos", emb.cos(), persistent=False)
        self.register_buffer("rope_sin", emb.sin(), persistent=False)


class Llama(nn.Module):
    """Token ids [b, s] -> logits [b, s, vocab]. A pipeline stage is a copy with the parts it does not own
    set to None: without `embed_tokens` it takes hidden states, without `lm_head` it returns them."""

    def __init__(self, c):
        super().__init__()
        self.model = Body(c)
        self.lm_head = nn.Linear(c["hidden"], c["vocab"], bias=False)

    def forward(self, x):
        m = self.model
        h = m.embed_tokens(x) if m.embed_tokens is not None else x
        for layer in m.layers.values():
            h = layer(h, m.rope_cos, m.rope_sin)
        if m.norm is not None:
            h = m.norm(h)
        return self.lm_head(h) if self.lm_head is not None else h


def read_config(directory):
    with open(os.path.join(directory, "config.json")) as f:
        j = json.load(f)
    theta = (j.get("rope_parameters") or {}).get("rope_theta", j.get("rope_theta", 10000.0))
    return {"hidden": j["hidden_size"], "layers": j["num_hidden_layers"], "heads": j["num_attention_heads"],
            "kv_heads": j.get("num_key_value_heads") or j["num_attention_heads"], "ffn": j["intermediate_size"],
            "vocab": j["vocab_size"], "seq": j["max_position_embeddings"], "eps": j["rms_norm_eps"],
            "theta": float(theta), "head_dim": j.get("head_dim") or j["hidden_size"] // j["num_attention_heads"]}


def load_model(directory):
    from safetensors.torch import load_file
    model = Llama(read_config(directory))
    model.load_state_dict(load_file(os.path.join(directory, "model.safetensors")), strict=True)
    return model


# ---------------------------------------------------------------------------------------------- parallelism

def pipeline_stage(model, stage, stages):
    """Stage `stage` of `stages`: its share of the blocks, plus the embedding (first) or norm + head (last)."""
    part = copy.deepcopy(model)
    n = len(part.model.layers)
    keep = range(stage * n // stages, (stage + 1) * n // stages)
    for name in list(part.model.layers):
        if int(name) not in keep:
            del part.model.layers[name]
    if stage != 0:
        part.model.embed_tokens = None
    if stage != stages - 1:
        part.model.norm, part.lm_head = None, None
    return part


def apply_tp(model, tp_mesh):
    """torchtitan's Llama plan: vocab-sharded embedding and head, heads split (q/k/v colwise, o rowwise),
    gate/up colwise and down rowwise, norms sequence-parallel; the residual stream is sharded on sequence."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    m = model.model
    top = {}
    if m.embed_tokens is not None:
        top["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if m.norm is not None:
        top["model.norm"] = SequenceParallel()
    if model.lm_head is not None:
        # loss parallel (torchtitan's default with TP): logits stay sharded over the vocabulary
        top["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    # every rank loaded the same weights, so each keeps its own slice: no scatter from rank 0
    parallelize_module(model, tp_mesh, top, src_data_rank=None)
    for block in m.layers.values():
        parallelize_module(block, tp_mesh, {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        }, src_data_rank=None)


def apply_fsdp(model, dp_mesh, reshard_after_forward):
    from torch.distributed.fsdp import fully_shard
    for block in model.model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)


def make_optimizer(model, a):
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": a.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=a.lr, betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_eps, foreach=True)


def cross_entropy(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


# ---------------------------------------------------------------------------------------------- training

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    p.add_argument("--init", required=True, help="Hugging Face LlamaForCausalLM save_pretrained directory")
    p.add_argument("--batches", required=True, help="torch.save'd int64 [iterations, global_batch, seq+1]")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--adam-beta1", type=float, default=0.9)
    p.add_argument("--adam-beta2", type=float, default=0.999)
    p.add_argument("--adam-eps", type=float, default=1e-8)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: NCCL, a GPU per rank")
    p.add_argument("--iterations", type=int, default=None, help="train on the first N steps' batches (default: all)")
    return p.parse_args(argv)


def unsupported(why):
    """Exit 2 on every rank; rank 0 says why in one line (PyTorch's own error where there is one)."""
    import torch.distributed as dist
    if os.environ.get("RANK", "0") == "0":
        print(why.replace("\n", " "), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(2)


def _value(loss):
    """A loss as a plain tensor (under loss parallel it is a replicated DTensor)."""
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


def forward_backward(a, model, mesh, schedule, stage_is_last, stage, inputs, labels, n_micro):
    """One step's forward and backward over its micro-batches; -> this rank's share of the step's loss."""
    if schedule is not None:
        losses = []
        if stage == 0:
            schedule.step(inputs, return_outputs=False)
        else:
            schedule.step(target=labels, losses=losses, return_outputs=False)
        return torch.stack([_value(x) for x in losses]).mean().detach() if stage_is_last else \
            torch.zeros((), device=inputs.device)
    local = torch.zeros((), device=inputs.device)
    for x, y in zip(inputs.split(a.micro_batch_size), labels.split(a.micro_batch_size)):
        if a.layout == "cp":
            from torch.distributed.tensor.experimental import context_parallel
            x, y = x.clone(), y.clone()
            body = model.model
            try:
                with context_parallel(mesh["cp"], buffers=[x, y, body.rope_cos, body.rope_sin],
                                      buffer_seq_dims=[1, 1, 0, 0], no_restore_buffers={x, y}):
                    loss = cross_entropy(model(x), y)
                    (loss / n_micro).backward()
            except Exception as e:  # noqa: BLE001 -- reported, never hidden: see unsupported()
                unsupported(f"context_parallel on CPU/gloo fails in torch {torch.__version__}: "
                            f"{type(e).__name__}: {e}")
        else:
            loss = cross_entropy(model(x), y)
            (loss / n_micro).backward()
        local += _value(loss).detach() / n_micro
    return local


def main(argv=None):
    a = parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dims = LAYOUTS[a.layout]
    device = torch.device(a.device)
    if a.device == "cuda":
        if not torch.cuda.is_available():
            unsupported("--device cuda: no GPU is visible")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo")
    size = math.prod(dims.values())
    if dist.get_world_size() != size:
        unsupported(f"--layout {a.layout} runs on {size} ranks, got {dist.get_world_size()}")
    rank = dist.get_rank()
    mesh = init_device_mesh(a.device, tuple(dims.values()), mesh_dim_names=tuple(dims))
    dp, pp = dims.get("dp", 1), dims.get("pp", 1)
    dp_rank = mesh["dp"].get_local_rank() if "dp" in dims else 0

    batches = torch.load(a.batches).to(device)
    iterations, global_batch = batches.shape[0], batches.shape[1]
    if a.iterations is not None:
        if not 0 < a.iterations <= iterations:
            unsupported(f"--iterations {a.iterations}: the batches file holds {iterations} steps")
        iterations = a.iterations
    if global_batch % (a.micro_batch_size * dp):
        unsupported(f"global batch {global_batch} is not a multiple of micro-batch {a.micro_batch_size} x dp {dp}")
    n_micro = global_batch // (a.micro_batch_size * dp)
    per_dp = global_batch // dp

    model = load_model(a.init).to(device)
    schedule, stage_is_last = None, True
    if pp > 1:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B
        stage = mesh["pp"].get_local_rank()
        stage_is_last = stage == pp - 1
        model = pipeline_stage(model, stage, pp)
    if "tp" in dims:
        apply_tp(model, mesh["tp"])
    if a.layout == "cp":
        apply_fsdp(model, mesh["dp", "cp"]._flatten("dp_cp"), reshard_after_forward=True)
    elif "dp" in dims:
        apply_fsdp(model, mesh["dp"], reshard_after_forward=pp == 1)  # torchtitan keeps params unsharded under PP
    if pp > 1:
        pstage = PipelineStage(model, stage, pp, device, group=mesh["pp"].get_group())
        schedule = Schedule1F1B(pstage, n_microbatches=n_micro, loss_fn=cross_entropy)  # scales grads by 1/n_micro
    optimizer = make_optimizer(model, a)
    # with TP the loss runs on vocabulary-sharded logits, its backward too (torchtitan's train context)
    if "tp" in dims:
        from torch.distributed.tensor.parallel import loss_parallel
    else:
        import contextlib
        loss_parallel = contextlib.nullcontext
    for it in range(iterations):
        mine = batches[it, dp_rank * per_dp:(dp_rank + 1) * per_dp]
        inputs, labels = mine[:, :-1].contiguous(), mine[:, 1:].contiguous()
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with loss_parallel():
            local = forward_backward(a, model, mesh, schedule, stage_is_last, stage if pp > 1 else 0, inputs, labels,
                                     n_micro)
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        step_ms = (time.perf_counter() - t0) * 1e3
        # the global-batch mean: ranks holding a loss (all but the non-last PP stages) average equal shares
        total = local.clone()
        dist.all_reduce(total)
        if rank == 0:
            print(json.dumps({"iteration": it + 1, "loss": total.item() / (dist.get_world_size() // pp),
                              "step_ms": step_ms}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
