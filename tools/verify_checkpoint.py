"""Check a megalite checkpoint directory offline: every checkpoint in it (or one iteration directory) against the
sizes and xxh3 checksums it recorded as it was written (and its SHA-256 record, where it was saved with
--verify-integrity), one line each; exit 1 if the newest (the tracker's) does not verify, 0 otherwise.

    python tools/verify_checkpoint.py DIR            # every iter_* under DIR, newest first
    python tools/verify_checkpoint.py DIR/iter_0000010
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.checkpoint.commit import TRACKER, read_tracker  # noqa: E402
from megalite.checkpoint.integrity import INTEGRITY, verify_checksums, verify_integrity  # noqa: E402
from megalite.checkpoint.storage import CheckpointError  # noqa: E402


def check(path):
    """One line's verdict on one checkpoint directory, and whether it verified (True), could not (None) or
    failed (False)."""
    try:
        recorded = verify_checksums(path)
        if os.path.exists(os.path.join(path, INTEGRITY)):
            verify_integrity(path)
    except CheckpointError as e:
        return str(e).replace("--verify-integrity: ", "SHA-256: ").replace(f"{path}: ", ""), False
    return ("verified" if recorded else "no checksums recorded (saved by an older megalite, or a converter): "
            "unverified"), (True if recorded else None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", help="a --save directory, or one iteration directory in it")
    path = ap.parse_args().path.rstrip("/")
    if not os.path.isdir(path):
        raise SystemExit(f"{path} is not a directory")
    if os.path.exists(os.path.join(path, TRACKER)):
        names = sorted((n for n in os.listdir(path) if n.startswith("iter_") and n[5:].isdigit()), reverse=True)
        names += ["release"] if os.path.isdir(os.path.join(path, "release")) else []
        newest = read_tracker(path)
        newest = "release" if newest == "release" else f"iter_{newest:07d}"
        dirs = [(n, os.path.join(path, n)) for n in names]
    else:
        newest, dirs = os.path.basename(path), [(os.path.basename(path), path)]
    failed = False
    for name, d in dirs:
        line, ok = check(d)
        print(f"{name}: {line}" + (" (the tracker's)" if name == newest else ""))
        failed |= name == newest and ok is False
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
