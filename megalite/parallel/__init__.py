"""The layout of a run as values: `grid.py` (a Grid: the sizes, this rank's coordinates and its groups, what
everything below the entry point is handed), `process_groups.py` (each group's rank lists, Megatron's order) and
`launch.py` (the torch.distributed process itself). `megalite.parallel_state` builds the global grid from these and
keeps Megatron's accessors. Imports nothing else of megalite."""
