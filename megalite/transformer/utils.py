"""Small helpers shared by the transformer modules."""

import math
import zlib


def param_seed(seed, name):
    """A stable per-parameter init seed: the same weight whatever the topology."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63)


def output_init_std(config):
    """Megatron's scaled init for layers that write into the residual stream."""
    return config.init_method_std / math.sqrt(2.0 * config.num_layers)
