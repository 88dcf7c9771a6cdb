"""The model converters (training/converter.py), found by name: a new one is its module and one line here."""

from megalite.training.fp8_training import Fp8Training

CONVERTERS = {c.name: c for c in (Fp8Training,)}


def converters_for(chunks):
    """The converters the chunks' model wants, each over these chunks, in the registry's order."""
    mcfg = chunks[0].module.config
    return [c(chunks) for c in CONVERTERS.values() if c.wanted(mcfg)]
