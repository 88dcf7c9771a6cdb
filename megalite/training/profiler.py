"""--profile (Megatron's): iterations --profile-step-start + 1 to --profile-step-end profiled on --profile-ranks, by
torch.profiler into --tensorboard-dir (--use-pytorch-profiler: Megatron's schedule, a warm-up iteration before the
first active one) or as nsys' capture range (cudaProfilerStart at the start, Stop after the end, NVTX ranges
between). Profiling only watches: the run's values are the same."""

import torch

from megalite.training.parts import Part


class Profiler(Part):
    def __init__(self, cfg, rank):
        self.cfg, self.prof, self.nvtx = cfg, None, None
        if not cfg.use_pytorch_profiler:
            return
        start, end = cfg.profile_step_start, cfg.profile_step_end
        self.prof = torch.profiler.profile(
            schedule=torch.profiler.schedule(wait=max(start - 1, 0), warmup=1 if start > 0 else 0,
                                             active=end - start, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(cfg.tensorboard_dir, worker_name=f"rank{rank}"),
            record_shapes=cfg.pytorch_profiler_collect_shapes, with_stack=cfg.pytorch_profiler_collect_callstack)
        self.prof.start()

    def before(self, it):
        # (Megatron opens the range once `start` iterations are done, as the torch.profiler schedule's first active
        # step is iteration start + 1)
        if self.prof is None and it == self.cfg.profile_step_start + 1:
            torch.cuda.cudart().cudaProfilerStart()
            self.nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=self.cfg.pytorch_profiler_collect_shapes)
            self.nvtx.__enter__()

    def after(self, it, step):
        if self.prof is not None:
            self.prof.step()
        elif it == self.cfg.profile_step_end:
            self._close_nvtx()

    def _close_nvtx(self):
        if self.nvtx is not None:
            self.nvtx.__exit__(None, None, None)
            torch.cuda.cudart().cudaProfilerStop()
            self.nvtx = None

    def finish(self, last):
        self._close_nvtx()  # (a run that ends inside the range)
        if self.prof is not None:  # (a run shorter than the schedule: what was recorded is still written)
            self.prof.stop()
            self.prof = None
        return last
