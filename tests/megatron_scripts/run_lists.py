"""Under torchrun: train each Megatron launch script's argv (a JSON list of [name, argv]) with
pretrain_gpt.py's own providers, one after the other on the same ranks (one interpreter start
per rank for all scripts: the 2-core machine pays torch's import once). Prints, on the last
rank, writes {name: losses} to <argv json>.losses (a file: the ranks' interleaved stdout can split
a printed line); a script that fails stops the run non-zero. A run still going after <stack seconds>
(argv[2]) is hung: each rank writes its Python stacks to <argv json>.stacks.<rank> and exits, so the
test reports where every rank waited instead of only a timeout."""

import faulthandler
import gc
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import pretrain_gpt  # noqa: E402
from megalite import parallel_state as ps  # noqa: E402
from megalite.cli.parser import parse_args  # noqa: E402
from megalite.training import pretrain  # noqa: E402


def main(path, stack_after_s):
    stacks = open(f"{path}.stacks.{os.environ['RANK']}", "w")  # (kept open: the dump writes it)
    faulthandler.dump_traceback_later(stack_after_s, exit=True, file=stacks)
    runs, done = json.load(open(path)), {}
    ps.initialize_distributed("gloo", 600)  # held across the scripts; each pretrain() builds its grid
    for name, argv in runs:
        print(f"megalite-test: {name}", flush=True)
        args = parse_args(argv)
        losses = pretrain(pretrain_gpt.datasets_provider, pretrain_gpt.model_provider, pretrain_gpt.forward_step,
                          args)
        ps.destroy_model_parallel()
        # the finished script's cyclic garbage (loaders, process groups) collected now, on every rank at once:
        # left to an arbitrary allocation in the middle of the next script, such a collection hung its final
        # evaluation (a full collection at every pretrain() instead cost the suite minutes: 0.2 s each)
        gc.collect()
        if ps.global_rank() == ps.world_size() - 1:
            done[name] = losses
            with open(path + ".losses", "w") as f:
                json.dump(done, f)
    ps.shutdown_distributed()  # (the dump stays armed: a hang at the interpreter's exit is reported too)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
