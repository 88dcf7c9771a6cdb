"""--verify-integrity (Megatron's): a save records the SHA-256 of every file of the checkpoint
(integrity.json, written by the coordinator once all ranks' files exist, before the directory is
renamed into place); a load checks them before reading any tensor. The ranks split the files
between them and share what they found, so every rank reports the same one line."""

import hashlib
import json
import os

import torch.distributed as dist

from megalite.checkpoint.storage import CheckpointError, fsync_write, read_json

INTEGRITY = "integrity.json"


def _files(path):
    out = []
    for d, _, names in os.walk(path):
        out += [os.path.relpath(os.path.join(d, n), path) for n in names]
    return sorted(f for f in out if f != INTEGRITY)


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_integrity(path):
    """On the coordinator, after every rank's files are written."""
    digests = {f: sha256(os.path.join(path, f)) for f in _files(path)}
    fsync_write(os.path.join(path, INTEGRITY), json.dumps(digests, indent=0).encode())


def verify_integrity(path, group=None):
    """Raises CheckpointError (the same line on every rank of `group`) unless every file recorded
    at save time is there with its recorded hash."""
    if not os.path.exists(os.path.join(path, INTEGRITY)):
        raise CheckpointError(f"--verify-integrity: {path} has no {INTEGRITY} (it was saved without "
                              "--verify-integrity); load it without the flag")
    recorded = read_json(os.path.join(path, INTEGRITY), "checkpoint integrity record")
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    bad = []
    for f in sorted(recorded)[rank::world]:
        full = os.path.join(path, f)
        if not os.path.exists(full):
            bad.append(f"{f} is missing")
        elif sha256(full) != recorded[f]:
            bad.append(f"{f} changed since it was saved")
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, bad, group=group)  # a few strings over the checkpoint's gloo group
        bad = [b for part in every for b in part]
    if bad:
        raise CheckpointError(f"--verify-integrity: {path}: {', '.join(sorted(bad)[:3])}"
                              f"{f' (and {len(bad) - 3} more)' if len(bad) > 3 else ''}")
