"""The process's global grid: the one layout the training entry point builds (parallel_state.
initialize_model_parallel) and Megatron's accessors read (parallel/megatron_accessors.py); nothing below the entry
point reads it but through a grid it is handed (parallel/grid.py)."""

_GRID = None


def set_global_grid(grid):
    """Make `grid` the process's global grid (None: forget it); returns the one it replaces."""
    global _GRID
    old, _GRID = _GRID, grid
    return old


def global_grid_or_none():
    return _GRID


def global_grid():
    if _GRID is None:
        raise RuntimeError("megalite.parallel_state is not initialised: call initialize_model_parallel() first")
    return _GRID
