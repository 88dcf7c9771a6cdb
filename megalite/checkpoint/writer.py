"""A run's checkpoint I/O resources, owned by the run (training/setup.py makes one; loading, the Saver and the
end of the run use it): a gloo group for the checkpoint collectives, made on first use (CPU tensors, and safe to
use from the writer thread while training uses the default group), and --async-save's writer thread with the one
save in flight. A process that trains twice (or a forked rank) has one per run, never its parent's."""

from concurrent.futures import ThreadPoolExecutor

import torch.distributed as dist

from megalite import parallel_state as ps


class CheckpointIO:
    def __init__(self):
        self._group = self._executor = self._future = None

    def group(self):
        """The checkpoint group (None on one process without torch.distributed); every rank makes it together."""
        if self._group is None and dist.is_initialized():
            self._group = ps.new_group(backend="gloo")
        return self._group

    def submit(self, fn, *args, **kw):
        """Run fn in the writer thread (--async-save); the save before it must have been waited for."""
        assert self._future is None, "a save is still in flight: wait() first"
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megalite-ckpt")
        self._future = self._executor.submit(fn, *args, **kw)

    def wait(self):
        """The save in flight finished; its error (if any) re-raised here."""
        fut, self._future = self._future, None
        if fut is not None:
            fut.result()

    def close(self):
        """Wait for the save in flight and release the writer thread and the group (the run's end)."""
        self.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None
