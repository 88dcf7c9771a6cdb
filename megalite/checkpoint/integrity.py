"""A checkpoint's proof of itself, two of them.

Always: every file's size and xxh3-64 checksum, computed on the bytes as they are written (no second read; each
rank its own files, checksums/rank_<i>.json, merged by the coordinator into checksums.json, which carries its
own checksum, before the directory is renamed into place); a load verifies them before it reads anything else
(verify_checksums), and a file that is missing, truncated, longer or changed is named in one line
(IntegrityError: the load then falls back to the newest earlier checkpoint that verifies, checkpoint/manager.py).
A checkpoint without checksums.json (saved before they were recorded; the converters') is loaded unverified.

--verify-integrity (Megatron's): a save also records the SHA-256 of every file (integrity.json, by the
coordinator once all ranks' files exist, reading them again); a load checks them before reading any tensor.
Either way the ranks split the files between them and share what they found, so every rank reports the same
one line."""

import hashlib
import json
import os
import shutil

import torch.distributed as dist
import xxhash

from megalite.checkpoint.storage import CheckpointError, checksum, fsync_write, read_json

INTEGRITY = "integrity.json"
CHECKSUMS = "checksums.json"
RANK_CHECKSUMS = "checksums"  # (the per-rank records' folder during a save)
CHECKSUM_FORMAT = "megalite-checksums"


class IntegrityError(CheckpointError):
    """A checkpoint whose files are not those it recorded (corrupted, truncated, missing)."""


def written(sums, root, rel, data):
    """fsync_write `data` to root/rel, its size and checksum recorded in `sums` (rel -> [bytes, xxh3])."""
    fsync_write(os.path.join(root, rel), data)
    sums[rel] = [len(data), checksum(data)]


def write_rank_checksums(root, rank, sums):
    os.makedirs(os.path.join(root, RANK_CHECKSUMS), exist_ok=True)
    fsync_write(os.path.join(root, RANK_CHECKSUMS, f"rank_{rank:05d}.json"), json.dumps(sums).encode())


def merge_checksums(root, sums):
    """On the coordinator, every rank's records written: checksums.json (with `sums`, its own), the folder gone."""
    files = dict(sums)
    folder = os.path.join(root, RANK_CHECKSUMS)
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        files.update(read_json(os.path.join(folder, name), "checksum record"))
    shutil.rmtree(folder, ignore_errors=True)
    body = json.dumps(files, sort_keys=True)
    doc = {"format": CHECKSUM_FORMAT, "algorithm": "xxh3_64", "files": files, "self": checksum(body.encode())}
    fsync_write(os.path.join(root, CHECKSUMS), json.dumps(doc, indent=0).encode())


def _file_problem(full, rel, size, digest):
    """What is wrong with one recorded file, or None."""
    if not os.path.exists(full):
        return f"{rel} is missing"
    have, h = os.path.getsize(full), xxhash.xxh3_64()
    with open(full, "rb") as f:
        head = f.read(1)
        if head == b"\x80" and have != size:  # (none of the files megalite writes starts so)
            return f"{rel} was replaced (it looks like a pickle payload; refusing to load it)"
        if have < size:
            return f"{rel} is truncated ({have} of its {size} bytes)"
        if have > size:
            return f"{rel} is longer than it was saved ({have} bytes, not {size})"
        h.update(head)
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    if h.hexdigest() != digest:
        hint = " (it looks like a pickle payload; refusing to load it)" if head == b"\x80" else ""
        return f"{rel} changed since it was saved{hint}"
    return None


def verify_checksums(path, group=None):
    """IntegrityError (the same line on every rank of `group`) unless every file checksums.json records is there
    with its size and checksum; False where the checkpoint has no checksums.json (nothing verified), else True."""
    record = os.path.join(path, CHECKSUMS)
    if not os.path.exists(record):
        return False
    try:
        doc = read_json(record, "checksum record")
        files = doc["files"]
        ok = doc.get("format") == CHECKSUM_FORMAT and doc["self"] == checksum(json.dumps(files, sort_keys=True)
                                                                                .encode())
    except (CheckpointError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise IntegrityError(f"{path}: {CHECKSUMS} is corrupted (its own checksum differs)")
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    bad = [why for rel in sorted(files)[rank::world]
           if (why := _file_problem(os.path.join(path, rel), rel, *files[rel]))]
    _raise_shared(bad, group, world, IntegrityError, f"{path}: ")
    return True


def _raise_shared(bad, group, world, error, prefix):
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, bad, group=group)  # a few strings over the checkpoint's gloo group
        bad = [b for part in every for b in part]
    if bad:
        raise error(f"{prefix}{', '.join(sorted(bad)[:3])}{f' (and {len(bad) - 3} more)' if len(bad) > 3 else ''}")


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
    _raise_shared(bad, group, world, IntegrityError, f"--verify-integrity: {path}: ")


def newest_verified(candidates, group, sha, fallback, say):
    """(iteration, directory) of the first of `candidates` (newest first) whose files verify (checksums; sha:
    --verify-integrity's SHA-256 too); with `fallback` a newer one that does not is skipped, said in one line by
    `say`, else its IntegrityError stops the load. IntegrityError if none verifies."""
    skipped = []
    for it, path in candidates if fallback else candidates[:1]:
        try:
            verify_checksums(path, group)
            if sha:
                verify_integrity(path, group)
        except IntegrityError as e:
            skipped.append((it, e))
            continue
        if skipped:
            say(f"megalite: checkpoint iteration {skipped[0][0]} does not verify ({skipped[0][1]}); "
                + (f"{len(skipped) - 1} more skipped; " if len(skipped) > 1 else "")
                + f"loading iteration {it}, the newest that does (--no-checkpoint-fallback: stop instead)")
        return it, path
    first = skipped[0][1]
    if len(candidates) > 1 and fallback:
        raise IntegrityError(f"{first}; no earlier checkpoint beside it verifies either") from None
    raise first
