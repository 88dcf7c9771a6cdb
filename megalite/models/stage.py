"""What GPTModel and BertModel set up alike as one pipeline stage's (and virtual chunk's) model: its grid, its share
of the layers, whether it holds the embedding (pre_process) and the head (post_process), its padded vocabulary."""

from megalite import parallel_state as ps
from megalite.tensor_parallel import padded_vocab_size
from megalite.transformer.pipeline_layers import chunk_layers


def set_up_stage(model, config, pre_process, post_process, num_layers, layer_offset, grid, vp_stage, check=None):
    """Sets model.grid (default the global one), .config, .pre_process, .post_process, .padded_vocab_size and
    .input_tensor (set_input_tensor's); returns (num_layers, layer_offset): those given, else this pipeline stage's
    (and virtual chunk's) share. check(config), a model's own refusals, runs between the shape checks and the layer
    split, where each model checked before (the first error a user meets stays the same)."""
    model.grid = grid = ps.current_grid(grid)
    config.check_parallel(grid.tp)
    if check is not None:
        check(config)
    if num_layers is None:
        num_layers, layer_offset = chunk_layers(config, vrank=vp_stage, grid=grid)
    model.config = config
    model.pre_process, model.post_process = pre_process, post_process
    model.padded_vocab_size = padded_vocab_size(config.vocab_size, config.make_vocab_size_divisible_by, grid.tp)
    model.input_tensor = None
    return num_layers, layer_offset or 0
