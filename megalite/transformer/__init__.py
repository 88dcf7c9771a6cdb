"""Transformer building blocks: attention, MLP, layer, block (one pipeline stage's layers)."""

from megalite.transformer.block import TransformerBlock
from megalite.transformer.layer import TransformerLayer

__all__ = ["TransformerBlock", "TransformerLayer"]
