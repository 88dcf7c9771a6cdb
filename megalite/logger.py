"""Training logs: Megatron's iteration line, validation lines, TensorBoard, Weights & Biases and
JSON lines.

The last rank logs (it holds the loss: last pipeline stage). W&B (--wandb-project) gets the
scalars TensorBoard gets, at the same steps, as Megatron's wandb writer does. `--log-json FILE` appends one
JSON object per logged iteration and per evaluation, which `tools/plot_metrics.py` draws.
"""

import json
import math
import os
import resource
import time

import torch

from megalite import parallel_state as ps
from megalite.config import fail


def print_rank_last(msg):
    """Megatron logs from the last rank: it holds the loss (last pipeline stage)."""
    if ps.global_rank() == ps.world_size() - 1:
        print(msg, flush=True)


def _tensorboard(cfg):
    """The writer on the last rank; the import is checked on every rank so all fail alike."""
    if not cfg.tensorboard_dir:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        fail("--tensorboard-dir needs the tensorboard package: pip install 'megalite[tensorboard]'")
    return SummaryWriter(log_dir=cfg.tensorboard_dir) if ps.global_rank() == ps.world_size() - 1 else None


def _wandb(cfg):
    """Megatron's W&B writer: wandb.init on the last rank with the run's arguments as its config;
    the import is checked on every rank so all fail alike."""
    if not cfg.wandb_project:
        return None
    try:
        import wandb
    except ImportError:
        fail("--wandb-project needs the wandb package: pip install 'megalite[wandb]' (or log with --tensorboard-dir "
             "/ --log-json)")
    if ps.global_rank() != ps.world_size() - 1:
        return None
    save_dir = cfg.wandb_save_dir or os.path.join(cfg.save or ".", "wandb")
    os.makedirs(save_dir, exist_ok=True)
    kwargs = {"dir": save_dir, "name": cfg.wandb_exp_name, "project": cfg.wandb_project,
              "config": {k: v if isinstance(v, (int, float, str, bool, type(None), list)) else str(v)
                         for k, v in cfg.flags.items()}}
    if cfg.wandb_entity:
        kwargs["entity"] = cfg.wandb_entity
    wandb.init(**kwargs)
    return wandb


def memory_mb():
    """Peak device memory on CUDA, else the process's peak resident set (MB)."""
    if torch.cuda.is_available() and ps.get_device().type == "cuda":
        return torch.cuda.max_memory_allocated() / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class MetricsLogger:
    def __init__(self, cfg):
        """cfg: its LoggingConfig (config/logging.py)."""
        self.cfg = cfg
        self.writer, self.wandb = _tensorboard(cfg), _wandb(cfg)
        self.last = ps.global_rank() == ps.world_size() - 1
        self.json = open(cfg.log_json, "a") if cfg.log_json and self.last else None

    def _scalars(self, it, values):
        if self.writer is not None:
            for k, v in values.items():
                if v is not None:
                    self.writer.add_scalar(k, v, it)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in values.items() if v is not None}, step=it)
        if self.json is not None:
            self.json.write(json.dumps({"iteration": it, **values}) + "\n")
            self.json.flush()

    def iteration(self, it, f):
        """f: iteration fields (losses dict, lr, grad_norm, elapsed, tflops, ...)."""
        a = self.cfg
        batch = f.get("batch_size", a.global_batch_size)  # this iteration's (a ramp-up changes it)
        losses = "".join(f" {k}: {v:.6E} |" for k, v in f["losses"].items() if "/" not in k)  # (per-layer: TB only)
        norm = float(f["grad_norm"]) if f["grad_norm"] is not None else None  # a device tensor: read here
        gn = f"{norm:.3f}" if norm is not None else "nan"
        extra = ""
        if f.get("params_norm") is not None:
            extra += f" params norm: {f['params_norm']:.3f} |"
        if f.get("num_zeros") is not None:
            extra += f" num zeros: {f['num_zeros']:.1f} |"
        if f.get("max_attention_logit") is not None:
            extra += f" max attention logit: {f['max_attention_logit']:.4f} |"
        print_rank_last(
            f" iteration {it:8d}/{a.train_iters:8d} | consumed samples: {f['consumed']:12d} | "
            f"elapsed time per iteration (ms): {f['elapsed'] * 1000:.1f} | "
            f"throughput per GPU (TFLOP/s/GPU): {f['tflops']:.3f} | learning rate: {f['lr']:.6E} | "
            f"global batch size: {batch:5d} |{losses} loss scale: {f['loss_scale']:.1f} | "
            f"grad norm: {gn} |{extra} number of skipped iterations: {f['skipped']:3d} |")
        values = {**f["losses"], "learning-rate": f["lr"], "batch-size": batch, "loss-scale": f["loss_scale"],
                  "grad-norm": norm, "throughput": f["tflops"], "iteration-time": f["elapsed"],
                  "params-norm": f.get("params_norm"), "num-zeros": f.get("num_zeros"),
                  "max-attention-logit": f.get("max_attention_logit")}
        if a.log_memory_to_tensorboard or self.json is not None:
            values["memory-mb"] = memory_mb()
        if a.log_timers_to_tensorboard and f.get("timers"):
            values.update({f"{k}-time": v for k, v in f["timers"].items()})
        self._scalars(it, {k: v for k, v in values.items() if v is not None})

    def evaluation(self, it, split, losses, final=False):
        """Megatron's line: `validation loss at iteration N | lm loss value: X | lm loss PPL: Y |`."""
        parts = "".join(f" {k} value: {v:.6E} | {k} PPL: {math.exp(min(v, 20)):.6E} |" for k, v in losses.items())
        where = f"the end of training for {'val' if split == 'validation' else split} data" if final else \
            f"iteration {it}"
        print_rank_last(f" validation loss at {where} |{parts}")
        values = {f"{split} {k}": v for k, v in losses.items()}
        if self.cfg.log_validation_ppl_to_tensorboard or self.json is not None:
            values.update({f"{split} {k} ppl": math.exp(min(v, 20)) for k, v in losses.items()})
        self._scalars(it, values)

    def close(self):
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.json is not None:
            self.json.close()


class TrainingWindow:
    """What the loop keeps between log lines: every iteration's lm loss (device tensors, read
    on the host once per logged iteration), the mean losses of the iterations whose update went
    through (Megatron's training_log: a skipped fp16 iteration's loss is not averaged) and the
    skipped count."""

    def __init__(self, start_iter):
        self.start_iter, self.window_start = start_iter, start_iter
        self.losses, self.pending, self.means, self.skipped = [], [], [], 0
        self.t0 = time.perf_counter()

    def add(self, loss, means, stepped):
        self.pending.append(loss)
        if stepped:
            self.means.append(means)
        else:
            self.skipped += 1

    def read_losses(self):
        """Append the pending losses to `losses` (one host read); (iteration, value) of the
        first non-finite one, or None."""
        if not self.pending:
            return None
        first = self.start_iter + len(self.losses) + 1
        vals = torch.cat(self.pending).tolist()
        self.pending.clear()
        self.losses.extend(vals)
        return next(((first + i, v) for i, v in enumerate(vals) if not math.isfinite(v)), None)

    def close(self, it):
        """The window ending at iteration `it`: {elapsed (s per iteration), losses, skipped}; the
        next window's clock starts at restart() (after the log line)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        # As Megatron: no loss is shown for a window whose every update was skipped.
        shown = {k: float(sum(w[k] for w in self.means)) / len(self.means) for k in self.means[-1]} \
            if self.means else {}
        out = {"elapsed": (time.perf_counter() - self.t0) / max(it - self.window_start, 1), "losses": shown,
               "skipped": self.skipped}
        self.window_start, self.means, self.skipped = it, [], 0
        return out

    def restart(self):
        self.t0 = time.perf_counter()
