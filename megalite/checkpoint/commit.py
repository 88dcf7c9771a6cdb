"""A save's commit (checkpoint/manager.py's save_checkpoint): where a checkpoint's iteration lives and the tracker
that names the newest complete one; the writer that, on the coordinator once every rank's data is written, records
the checksums, renames the directory into place and moves the tracker; and a failed save cleaned up (its partial
directory removed, the previous checkpoint and the tracker left as they were), in one line."""

import errno
import os
import shutil

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megalite.checkpoint.integrity import merge_checksums, write_integrity, write_rank_checksums
from megalite.checkpoint.storage import CheckpointError, SafetensorsWriter, fsync_dir, fsync_write

TRACKER = "latest_checkpointed_iteration.txt"


def iteration_dir(root, iteration):
    return os.path.join(root, "release" if iteration == "release" else f"iter_{iteration:07d}")


def read_tracker(root):
    """The newest complete checkpoint's iteration (int or "release"), or None."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if text == "release":
        return text
    if not text.isdigit():
        raise CheckpointError(f"{path} holds {text[:40]!r}, not an iteration number")
    return int(text)


class CommittingWriter(SafetensorsWriter):
    """Runs on the coordinator once every rank's data is written: index, rename, tracker, and
    with --save-retain-interval R the previous checkpoint goes unless its iteration is a
    multiple of R (Megatron's rule: the newest is always kept)."""

    def __init__(self, tmp, root, iteration, hash_files=False, retain_interval=None):
        super().__init__(tmp)
        self.root, self.iteration, self.hash_files = root, iteration, hash_files
        self.retain_interval = retain_interval

    def write_data(self, plan, planner):
        try:
            fut = super().write_data(plan, planner)
            rank = int(plan.storage_data.split("_")[2])  # (__<rank>_0.safetensors)
            write_rank_checksums(self.path, rank, self.sums)  # (its meta, RNG, FP8 and tensor files')
        except OSError as e:
            raise _write_failed(e, self.path) from None
        return fut

    def finish(self, metadata, results):
        try:
            super().finish(metadata, results)
            merge_checksums(self.path, self.sums)
        except OSError as e:
            raise _write_failed(e, self.path) from None
        if self.hash_files:  # --verify-integrity
            write_integrity(self.path)
        final, tmp = iteration_dir(self.root, self.iteration), self.path
        for d in (os.path.join(tmp, "rng"), os.path.join(tmp, "fp8"), tmp):
            fsync_dir(d)
        if os.path.exists(final):  # the same iteration saved again: replace it
            old = final + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fsync_dir(self.root)
        previous = read_tracker(self.root) if self.retain_interval else None
        fsync_write(os.path.join(self.root, TRACKER + ".tmp"), f"{self.iteration}\n", mode="w")
        os.replace(os.path.join(self.root, TRACKER + ".tmp"), os.path.join(self.root, TRACKER))
        fsync_dir(self.root)
        if isinstance(previous, int) and 0 < previous != self.iteration and previous % self.retain_interval:
            old = iteration_dir(self.root, previous)
            if not os.path.islink(old):  # as Megatron: a linked checkpoint is the user's
                shutil.rmtree(old, ignore_errors=True)


def _write_failed(e, tmp):
    """A save's failed write as one line (a full disk named so; the partial directory removed by save_checkpoint)."""
    why = "no space left on device" if e.errno == errno.ENOSPC else (e.strerror or str(e))
    return CheckpointError(f"saving {os.path.basename(tmp)[:-4]} failed: {why} ({e.filename or tmp})")


def removing_partial(save, tmp, root, group):
    """Run `save` (DCP's); if it fails, the partial directory goes (every rank agrees it failed: DCP raises on all)
    and the one line says that the previous checkpoint and the tracker are as they were."""
    try:
        save()
    except (CheckpointException, CheckpointError) as e:
        err = unwrap_checkpoint_error(e) if isinstance(e, CheckpointException) else e
        raise _removed(err, tmp, root, group) from None


def agreed_writes(write, tmp, root, group):
    """Run this rank's `write` (the files before DCP's: metadata, RNG, FP8 state); every rank of `group` learns
    whether any failed (one all-reduce, which also orders them as a barrier would), so a full disk on one rank
    ends the save on all with the partial directory removed, not a rank waiting in DCP for ever."""
    try:
        write()
        mine = None
    except OSError as e:
        mine = _write_failed(e, tmp)
    failed = mine is not None
    if group is not None:
        flag = torch.tensor([int(failed)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        failed = bool(flag.item())
    if failed:
        err = mine or CheckpointError(f"saving {os.path.basename(tmp)[:-4]} failed on another rank's write")
        raise _removed(err, tmp, root, group)


def _removed(err, tmp, root, group):
    """The partial directory removed (by the group's first rank), and the one line saying so."""
    if group is None or dist.get_rank(group) == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    kept = read_tracker(root)
    return CheckpointError(f"{err}; removed the partial {tmp}, "
                           f"{f'the previous checkpoint (iteration {kept})' if kept else 'no earlier checkpoint'}"
                           f" and {TRACKER} left as they were")


def unwrap_checkpoint_error(exc):
    """DCP reports failures as CheckpointException(rank -> (exception, traceback)); give the
    first user-facing CheckpointError back (or a one-line summary)."""
    for err, _ in exc.failures.values():
        if isinstance(err, CheckpointError):
            return err
    err = next(iter(exc.failures.values()))[0]
    first = str(err).splitlines()[0] if str(err) else ''
    return CheckpointError(f"checkpoint I/O failed: {type(err).__name__}: {first}")
