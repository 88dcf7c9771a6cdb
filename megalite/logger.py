"""Training logs: Megatron's iteration line, validation lines, TensorBoard and JSON lines.

The last rank logs (it holds the loss: last pipeline stage). `--log-json FILE` appends one
JSON object per logged iteration and per evaluation, which `tools/plot_metrics.py` draws.
"""

import json
import math
import resource

import torch

from megalite import parallel_state as ps
from megalite.config import fail


def print_rank_last(msg):
    """Megatron logs from the last rank: it holds the loss (last pipeline stage)."""
    if ps.global_rank() == ps.world_size() - 1:
        print(msg, flush=True)


def _tensorboard(args):
    """The writer on the last rank; the import is checked on every rank so all fail alike."""
    if not args.tensorboard_dir:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        fail("--tensorboard-dir needs the tensorboard package: pip install 'megalite[tensorboard]'")
    return SummaryWriter(log_dir=args.tensorboard_dir) if ps.global_rank() == ps.world_size() - 1 else None


def memory_mb():
    """Peak device memory on CUDA, else the process's peak resident set (MB)."""
    if torch.cuda.is_available() and ps.get_device().type == "cuda":
        return torch.cuda.max_memory_allocated() / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class MetricsLogger:
    def __init__(self, args):
        self.args = args
        self.writer = _tensorboard(args)
        self.last = ps.global_rank() == ps.world_size() - 1
        self.json = open(args.log_json, "a") if args.log_json and self.last else None

    def _scalars(self, it, values):
        if self.writer is not None:
            for k, v in values.items():
                if v is not None:
                    self.writer.add_scalar(k, v, it)
        if self.json is not None:
            self.json.write(json.dumps({"iteration": it, **values}) + "\n")
            self.json.flush()

    def iteration(self, it, f):
        """f: iteration fields (losses dict, lr, grad_norm, elapsed, tflops, ...)."""
        a = self.args
        losses = "".join(f" {k}: {v:.6E} |" for k, v in f["losses"].items())
        norm = float(f["grad_norm"]) if f["grad_norm"] is not None else None  # a device tensor: read here
        gn = f"{norm:.3f}" if norm is not None else "nan"
        extra = ""
        if f.get("params_norm") is not None:
            extra += f" params norm: {f['params_norm']:.3f} |"
        if f.get("num_zeros") is not None:
            extra += f" num zeros: {f['num_zeros']:.1f} |"
        print_rank_last(
            f" iteration {it:8d}/{a.train_iters:8d} | consumed samples: {f['consumed']:12d} | "
            f"elapsed time per iteration (ms): {f['elapsed'] * 1000:.1f} | "
            f"throughput per GPU (TFLOP/s/GPU): {f['tflops']:.3f} | learning rate: {f['lr']:.6E} | "
            f"global batch size: {a.global_batch_size:5d} |{losses} loss scale: {f['loss_scale']:.1f} | "
            f"grad norm: {gn} |{extra} number of skipped iterations: {f['skipped']:3d} |")
        values = {**f["losses"], "learning-rate": f["lr"], "loss-scale": f["loss_scale"],
                  "grad-norm": norm, "throughput": f["tflops"], "iteration-time": f["elapsed"],
                  "params-norm": f.get("params_norm"), "num-zeros": f.get("num_zeros")}
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
        if self.args.log_validation_ppl_to_tensorboard or self.json is not None:
            values.update({f"{split} {k} ppl": math.exp(min(v, 20)) for k, v in losses.items()})
        self._scalars(it, values)

    def close(self):
        if self.writer is not None:
            self.writer.close()
        if self.json is not None:
            self.json.close()
