"""The planner (megalite/planner/) over a command line: a candidate layout's flags validated by megalite's own
checks (what megalite would refuse to launch, the search skips), and the search with that validation."""

from megalite.cli.parser import ModelFlags
from megalite.config import ConfigError
from megalite.config.plan import PlanConfig
from megalite.planner import search as layout_search
from megalite.planner.layout import strip_layout_flags


class Validator:
    """validated() over one search: each model command line's flags parsed once (cli/parser.py, ModelFlags)."""

    def __init__(self):
        self.models = {}

    def __call__(self, model_argv, layout, world_size):
        argv = strip_layout_flags(model_argv)
        if not layout.zero:
            argv = [a for a in argv if a != "--overlap-param-gather"]
        if layout.pp == 1 or layout.vp:  # (a split backward fills a plain pipeline's bubble: those layouts only)
            argv = _without_schedule(argv, "zb-h1")
        if layout.pp == 1 or not layout.vp:  # (zbv, dualpipev: the layouts of two chunks per rank, search's)
            argv = _without_schedule(_without_schedule(argv, "zbv"), "dualpipev")
        key = tuple(argv)
        if key not in self.models:
            self.models[key] = ModelFlags(argv)
        args = self.models[key].at(layout.flags(), world_size)
        if args.data_parallel_size != layout.dp:
            raise ConfigError(f"{layout.describe()}: {world_size} GPUs give DP {args.data_parallel_size}")
        return PlanConfig.of(args)


def _without_schedule(argv, schedule):
    """argv without --pipeline-schedule `schedule` (zb-h1: nor Megatron's --delay-wgrad-compute)."""
    out, skip = [], False
    dropped = (f"--pipeline-schedule={schedule}",) + (("--delay-wgrad-compute",) if schedule == "zb-h1" else ())
    for i, a in enumerate(argv):
        if skip:
            skip = False
        elif a == "--pipeline-schedule" and argv[i + 1:i + 2] == [schedule]:
            skip = True
        elif a not in dropped:
            out.append(a)
    return out


def validated(model_argv, layout, world_size):
    """The PlanConfig (config/plan.py) of the user's model flags at this layout; ConfigError where megalite
    would refuse to launch it. The user's --overlap-param-gather (ZeRO's) applies to the layouts with ZeRO; those
    without run without it (and --pipeline-schedule zb-h1 / --delay-wgrad-compute to plain pipelines, PP > 1
    without virtual stages; zbv and dualpipev to PP > 1 with virtual stages, which they take two per rank)."""
    return Validator()(model_argv, layout, world_size)


def search(model_argv, cluster, top=5, limit=None, **choices):
    """megalite.planner.search.search over this command line's validation (one Validator for the search)."""
    return layout_search.search(model_argv, cluster, top, limit, validate=Validator(), **choices)
