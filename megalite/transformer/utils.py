"""Small helpers shared by the transformer modules."""

import math

from megalite import mup
from megalite.moe.activation import kernel_backend  # noqa: F401 (re-exported)
from megalite.tensor_parallel.init import param_seed  # noqa: F401 (re-exported)


def output_init_std(config):
    """Megatron's scaled init for layers that write into the residual stream (muP: also / sqrt(m))."""
    if getattr(config, "use_mup", False):
        return mup.output_std(config)
    return config.init_method_std / math.sqrt(2.0 * config.num_layers)
