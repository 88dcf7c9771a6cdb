"""megalite: compact Megatron-style 3D-parallel transformer training."""

__version__ = "0.1.0"
