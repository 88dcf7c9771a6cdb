"""The error every user mistake raises: one line naming the values and what to change (a leaf: it imports
nothing of megalite, so any module can raise it). `megalite.config.ConfigError` is this class."""


class ConfigError(ValueError):
    pass


def fail(msg):
    """A user error: one line on stderr naming the rank, then a non-zero exit (every rank
    reaches this on its own, before any collective, so nothing hangs)."""
    import os
    import sys
    print(f"megalite: error (rank {os.environ.get('RANK', '0')}): {msg}", file=sys.stderr, flush=True)
    sys.exit(2)
