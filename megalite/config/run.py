"""The run configuration: every flag of a run after validation, under Megatron's names, frozen.

The command line (megalite/cli) parses and validates; what it hands below is a RunConfig, which refuses every
assignment, so nothing in training, the iteration plan or the planner can change a flag after validation (a
value that is decided later, such as a measured pipeline layout, lives in the run's state instead). The one
exception is the data: an entry point's datasets_provider learns the tokenizer's vocabulary (and, without
--data-path, the built-in corpus's paths), as Megatron's providers do; it works on a draft, and those fields come
back in a new RunConfig (`with_data`) before the model is built. Containers inside (lists such as --data-path)
are the parser's own; nothing below the command line changes them either."""

import argparse
import types

from megalite.errors import ConfigError

# What a datasets_provider may decide: the vocabulary its tokenizer has, and where the built-in corpus lives.
DATA_FIELDS = ("vocab_size", "data_path", "tokenizer_type", "tokenizer_model")


class FrozenConfigError(AttributeError):
    pass


class RunConfig(types.SimpleNamespace):
    """A validated run's flags; read like argparse's namespace (getattr, vars), never written."""

    def __setattr__(self, name, value):
        raise FrozenConfigError(f"the run configuration is frozen after validation: cannot set {name!r} (a value "
                                "decided later belongs in the run's state; a flag is validated in megalite/cli)")

    def __delattr__(self, name):
        raise FrozenConfigError(f"the run configuration is frozen after validation: cannot delete {name!r}")

    def replace(self, **changes):
        """A new RunConfig with these fields changed (a planner's layouts, a replica's own precision)."""
        unknown = sorted(set(changes) - set(vars(self)))
        if unknown:
            raise FrozenConfigError(f"the run configuration has no field {', '.join(unknown)}")
        return RunConfig(**{**vars(self), **changes})

    def draft(self):
        """A mutable copy for a datasets_provider (Megatron's contract: it may set the vocab size)."""
        return argparse.Namespace(**vars(self))

    def with_data(self, draft):
        """This configuration with what a datasets_provider decided on its draft (DATA_FIELDS); a provider that
        changed any other flag is refused in one line."""
        mine, theirs = vars(self), vars(draft)
        changed = sorted(k for k in set(mine) | set(theirs) if k not in DATA_FIELDS
                         and (k not in mine or k not in theirs or mine[k] is not theirs[k] and mine[k] != theirs[k]))
        if changed:
            raise ConfigError(f"the datasets provider changed {', '.join(changed)}; it may set only "
                              f"{', '.join(DATA_FIELDS)} (every other flag is fixed by validation)")
        return self.replace(**{k: theirs[k] for k in DATA_FIELDS if k in mine})


def freeze(args):
    """The RunConfig of validated args (a RunConfig is returned as it is)."""
    return args if isinstance(args, RunConfig) else RunConfig(**vars(args))
