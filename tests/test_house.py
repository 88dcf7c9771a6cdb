"""The house's measures as a ratchet (DESIGN, "Where the layout is going"): reads of the global grid outside the
grid's own modules, per package or top-level module, may fall but never rise (the goal: none outside the entry
point, which builds the grid and hands it down); so may the flag namespace's fields read below the command line
and the grid's `None -> global` fallbacks where the grid is a layout fact (goal for both: none); no function over
100 lines and no file over 400 lines, except those named here with their reason, which may only shrink; at most 8
top-level modules; no line over 120 characters in the project's Python; module-global state (a module's name, or a
class's attribute, written from inside a function) only where named here with its reason, which may only shrink."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRID = re.compile(r"\b(ps|parallel_state|mpu)\.(get_|is_|has_|world_size\b|global_rank\b)")
OWN = {"megalite/parallel_state.py", "megalite/parallel/grid.py", "megalite/parallel/process_groups.py",
       "megalite/parallel/global_grid.py", "megalite/parallel/megatron_accessors.py"}
# global-grid reads per package / top-level module, as of the redesign's first step (2026-11-28): lower an entry
# when its count falls
GRID_READS = {"training": 8,  # the entry point: builds the global grid and the run on it
              "logger.py": 4, "rerun.py": 3}  # the process's own rank (who prints, who injects a fault), not the grid
# The run configuration's (the flag namespace's) fields read per package / top-level module below the command line,
# each module's distinct fields counted once (an alias of it too: `a = self.args`), as of the house's second step
# (2026-12-02; goal: none, each component built from its own typed section, config/section.py): lower an entry when
# its count falls
NAMESPACE = re.compile(r"\b(?:args|rank_args)\.([a-z_][a-z_0-9]*)|getattr\((?:args|rank_args), \"([a-z_0-9]+)\"")
NAMESPACE_OWN = ("megalite/cli/", "megalite/config/")  # the flags and the values made of them
# (checkpoint: what megatron_*.py read is a Megatron-LM checkpoint's own saved arguments, not this run's flags)
NAMESPACE_READS = {"checkpoint": 8}
# `grid=None -> the global grid` fallbacks in the packages where the grid is a layout fact (models, transformer,
# tensor_parallel and moe keep theirs: a user's own model built from the parallel layers runs on the global grid,
# as Megatron's do); as of 2026-12-02, goal: none
FALLBACK = re.compile(r"current_grid\((?:self\.)?grid\)|\bgrid is None\b|\bgrid if grid is not None\b")
FALLBACK_PACKAGES = ("distributed", "pipeline", "optimizer", "checkpoint", "training", "batching")
# the two left are Megatron's API, which takes no grid: DistributedDataParallel(module) around a user's own module,
# get_forward_backward_func()
GRID_FALLBACKS = {"distributed": 1, "pipeline": 1}
TOP_LEVEL_MODULES = 8  # besides __init__.py: the rest live in packages that say what they hold
LONGEST_LINE = 120
LONG_FUNCTIONS = {}  # function: its reason to be long
LONG_FILES = {}  # file: its reason to be long
# Module-global state, as of 2026-12-02 (goal: only the process's own facts, the registry, caches of pure functions
# and the counters benchmarks read): module -> {name: why it is still there}
MODULE_STATE = {
    "megalite/parallel/global_grid.py": {"_GRID": "the global grid Megatron's accessors read (the entry point's)"},
    "megalite/parallel_state.py": {"_BUILD_ON_META": "models built on the meta device (the planner's sizes)"},
    "megalite/parallel/launch.py": {"_TIMEOUT": "the process group's timeout, the process's own"},
    "megalite/tensor_parallel/random.py": {"_TRACKER": "Megatron's CUDA RNG tracker (get_cuda_rng_tracker)"},
    "megalite/distributed/comm.py": {n: "the process's communication counters (benchmarks)"
                                     for n in ("_CALLS", "_PAYLOAD", "_WIRE")},
    "megalite/planner/memory.py": {n: "caches of meta builds: pure functions of their keys"
                                   for n in ("_BUILT", "_COUNTS", "_PLANS", "_ROUTERS", "_SHAPE_FIELDS", "_STATES")},
    "megalite/data/preprocess.py": {"_W": "a preprocessing worker process's tokenizer"},
    "megalite/moe/decisions.py": {"_hooks": "a parity test's tie replay (tests/support/decision_replay.py)",
                                  "_about": "the same"},
}
MUTATORS = {"update", "append", "clear", "pop", "setdefault", "extend", "add", "remove", "insert", "popitem"}


def _sources():
    for path in sorted((ROOT / "megalite").rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), path.read_text()


def test_global_grid_reads_never_rise():
    def reads(pattern, src):
        return sum(1 for line in src.splitlines()
                   if pattern.search(line) and "current_grid" not in line and "get_device" not in line)
    _ratchet(_counts(GRID, lambda rel: rel not in OWN, reads), GRID_READS, "global-grid reads",
             "take the grid as an argument instead")


def test_no_long_functions_or_files_but_the_named():
    functions, files = set(), set()
    for rel, src in _sources():
        if src.count("\n") > 400:
            files.add(rel)
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 100:
                functions.add(f"{rel}:{node.name}")
    assert functions <= set(LONG_FUNCTIONS), f"functions over 100 lines: {sorted(functions - set(LONG_FUNCTIONS))}"
    assert files <= set(LONG_FILES), f"files over 400 lines: {sorted(files - set(LONG_FILES))}"


def _counts(pattern, keep, count):
    counts = {}
    for rel, src in _sources():
        if keep(rel) and (n := count(pattern, src)):
            key = rel.split("/")[1]
            counts[key] = counts.get(key, 0) + n
    return counts


def _ratchet(counts, allowed, what, instead):
    risen = {k: (n, allowed.get(k, 0)) for k, n in counts.items() if n > allowed.get(k, 0)}
    assert not risen, f"{what} rose (now, allowed): {risen}; {instead}"
    fallen = {k: (counts.get(k, 0), n) for k, n in allowed.items() if counts.get(k, 0) < n}
    if fallen:
        print(f"\n{what} fell (now, recorded): {fallen}: lower the entry")


def _aliases(src):
    """Names a function binds to the namespace (`a = args`, `a, b = self.args, x`): their reads count too."""
    def is_args(v):
        return isinstance(v, ast.Name) and v.id in ("args", "rank_args") or \
            isinstance(v, ast.Attribute) and v.attr == "args"
    names = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                pairs = zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple) and isinstance(
                    node.value, ast.Tuple) else [(target, node.value)]
                names |= {t.id for t, v in pairs if isinstance(t, ast.Name) and is_args(v)}
    return names - {"args", "rank_args"}


def test_flag_namespace_reads_below_the_command_line_never_rise():
    def fields(pattern, src):
        found = {a or b for a, b in pattern.findall(src)}
        for alias in _aliases(src):  # (an alias's reads: `a.train_iters` after `a = self.args`)
            found |= set(re.findall(rf"\b{alias}\.([a-z_][a-z_0-9]*)", src))
        return len(found - {"replace", "draft", "with_data"})
    counts = _counts(NAMESPACE, lambda rel: not rel.startswith(NAMESPACE_OWN), fields)
    probe = "def f(self, args):\n    a = self.args\n    return args.train_iters, a.lr, getattr(args, \"seed\")\n"
    assert fields(NAMESPACE, probe) == 3  # (the pattern finds what it counts)
    _ratchet(counts, NAMESPACE_READS, "flag-namespace reads below the command line",
             "build the component from its configuration section instead")


def test_grid_fallbacks_never_rise():
    counts = _counts(FALLBACK, lambda rel: rel.split("/")[1] in FALLBACK_PACKAGES,
                     lambda pattern, src: len(pattern.findall(src)))
    assert counts.get("distributed", 0) > 0 or not GRID_FALLBACKS.get("distributed")
    _ratchet(counts, GRID_FALLBACKS, "grid fallbacks (grid=None -> the global grid)",
             "take the grid as a required argument instead")


def test_few_top_level_modules():
    top = sorted(p.name for p in (ROOT / "megalite").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= TOP_LEVEL_MODULES, f"{len(top)} top-level modules (at most {TOP_LEVEL_MODULES}): {top}"


def test_no_line_over_120_characters():
    paths = [p for d in ("megalite", "kernels", "tests", "tools", "benchmarks") for p in (ROOT / d).rglob("*.py")]
    paths += list(ROOT.glob("*.py"))
    assert len(paths) > 200
    long = [f"{p.relative_to(ROOT)}:{i}" for p in paths for i, line in enumerate(p.read_text().splitlines(), 1)
            if len(line) > LONGEST_LINE]
    assert not long, f"{len(long)} lines over {LONGEST_LINE} characters: {long[:20]}"


def _module_state(src):
    """Module-level names (and imported ones) written inside a function: `global`, item or attribute assignment,
    or a mutating method (MUTATORS) called on them; a function's own parameters are not module state."""
    tree = ast.parse(src)
    names = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    names |= {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    names |= {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    names |= {(a.asname or a.name).split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
              for a in n.names}
    found = set()
    for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))):
        own = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
        for node in ast.walk(fn):
            if isinstance(node, ast.Global):
                found |= set(node.names)
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                if isinstance(t, (ast.Subscript, ast.Attribute)) and isinstance(t.value, ast.Name) \
                        and t.value.id in names - own:
                    found.add(t.value.id if isinstance(t, ast.Subscript) else f"{t.value.id}.{t.attr}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in names - own:
                found.add(node.func.value.id)
    return found


def test_module_global_state_only_where_named():
    found = {rel: state for rel, src in _sources() if rel.startswith("megalite/") and (state := _module_state(src))}
    assert "megalite/parallel_state.py" in found  # (the check finds what it looks for)
    new = {rel: sorted(state - set(MODULE_STATE.get(rel, {}))) for rel, state in found.items()
           if state - set(MODULE_STATE.get(rel, {}))}
    assert not new, f"module-global state (module: names): {new}; hand an object to what needs it instead"
    gone = {rel: sorted(set(allowed) - found.get(rel, set())) for rel, allowed in MODULE_STATE.items()
            if set(allowed) - found.get(rel, set())}
    if gone:
        print(f"\nmodule-global state gone (module: names): {gone}: remove them from MODULE_STATE")
