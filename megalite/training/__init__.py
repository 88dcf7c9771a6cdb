"""pretrain(): set up the grid, model, optimizer and data, then train (trainer.Trainer).

Entry points (pretrain_gpt.py, pretrain_bert.py) supply three functions, as in Megatron:
    datasets_provider(args, num_samples) -> (train, valid, test)   (may set the vocab size on its draft)
    model_provider(model_config, pre_process, post_process) -> model
    forward_step_func(data_iterator, model) -> (output, loss_func)

The package: setup.py builds a run (prepare), trainer.py holds it and runs the loop, step.py is one iteration,
parts.py the loop's optional behaviours (saving, exit rules, logging, evaluation, replicas, ...), cursor.py the
training data's position, evaluation.py the forward-only passes.
"""

import gc
import time

from megalite import parallel_state as ps
from megalite.checkpoint.storage import CheckpointError
from megalite.config import ConfigError, fail
from megalite.config.loop import LoopConfig
from megalite.config.parallel import ParallelConfig
from megalite.config.run import freeze
from megalite.training.trainer import Trainer

# Words in the errors gloo / NCCL / the store raise when a peer is gone or too slow.
COMMUNICATION_ERRORS = ("Timed out", "timed out", "Connection closed", "Connection reset", "NCCL", "gloo",
                        "Broken pipe", "Socket Timeout")


def pretrain(datasets_provider, model_provider, forward_step_func, args=None, return_state=False, record=None):
    """Train per the run configuration `args` (the entry point's megalite.cli.parser.parse_args(): the command
    line is the outermost layer, parsed before this is called); returns the list of per-iteration lm losses (and,
    with return_state, the model chunks and optimizer too). record: a RunRecord (training/record.py) the run fills
    with what it decided and measured (the schedule's operations, an auto layout's or shares' choice, a memory
    budget's)."""
    if args is None:
        raise ConfigError("pretrain() needs the run configuration: pass args=megalite.cli.parser.parse_args()")
    args = freeze(args)  # the run configuration: nothing below changes it (config/run.py)
    started = time.time()
    parallel, manual_gc = ParallelConfig.of(args), LoopConfig.of(args).manual_gc
    owns = ps.initialize_distributed(parallel.distributed_backend, parallel.distributed_timeout_minutes * 60)
    gc_enabled = gc.isenabled()
    if manual_gc:  # as Megatron: collections at the same iterations on every rank
        gc.disable()
        gc.collect()
    try:
        losses, chunks, optimizer = Trainer(datasets_provider, model_provider, forward_step_func, args, started,
                                            owns, record).train()
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if not any(w in str(e) for w in COMMUNICATION_ERRORS):
            raise
        # A dead or hung peer: one line (which operation, how long we waited), not a wall of C++.
        if owns:
            ps.shutdown_distributed(barrier=False)
        fail(f"communication failed ({first[:300]}); a peer rank died or hung past "
             f"--distributed-timeout-minutes {parallel.distributed_timeout_minutes}")
    except CheckpointError as e:  # a save that failed during training (a full disk): one line, every rank
        if owns:
            ps.shutdown_distributed(barrier=False)
        fail(str(e))
    finally:
        if manual_gc and gc_enabled:
            gc.enable()
    if owns and not return_state:
        ps.shutdown_distributed()  # a finished job exits 0: no communication thread left behind
    return (losses, chunks, optimizer) if return_state else losses
