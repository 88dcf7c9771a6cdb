"""megalite's command-line programs run in an already started interpreter (every process start
re-imports torch: seconds on the 2-core machine).

- tool(name), run_tool(name, *argv), convert(*argv): a tools/ script as a module, a tools/ script's main and
  tools/convert_checkpoint.py's run in the calling process ((exit status, stdout, stderr)).
- run_case(world_size, argv): one `pretrain_gpt.py` command line in the calling process ((exit code, stderr)).
- As a script, many `pretrain_gpt.py` command lines one after the other in one process, each as
  `python pretrain_gpt.py ...` would run (its own argv, WORLD_SIZE as given, stderr captured):
      python tests/support/cli_batch.py CASES.json OUT.json
  CASES.json: {name: [world_size, argv]}; OUT.json: {name: [exit code, stderr]}.
"""

import contextlib
import importlib.util
import io
import json
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRETRAIN = os.path.join(ROOT, "pretrain_gpt.py")


def tool(name):
    """A tools/ script as a module."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_tool(name, *argv):
    """A tools/ script's main(argv) in process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = tool(name).main(list(argv))
        except SystemExit as e:  # argparse
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def convert(*argv):
    """tools/convert_checkpoint.py in process: (exit status, stdout, stderr)."""
    return run_tool("convert_checkpoint", *argv)


def run_case(world_size, argv):
    import torch.distributed as dist

    from megalite import parallel_state as ps
    saved = os.environ.get("WORLD_SIZE"), sys.argv  # put back after: a test process runs on
    os.environ["WORLD_SIZE"] = str(world_size)
    sys.argv = [PRETRAIN] + argv
    err, code = io.StringIO(), 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            runpy.run_path(PRETRAIN, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException as e:  # noqa: BLE001 - an uncaught error is a finding, reported as such
            code = f"uncaught {type(e).__name__}: {e}"
        finally:
            ps.destroy_model_parallel()
            if dist.is_initialized():
                dist.destroy_process_group()
            if saved[0] is None:
                del os.environ["WORLD_SIZE"]
            else:
                os.environ["WORLD_SIZE"] = saved[0]
            sys.argv = saved[1]
    return code, err.getvalue()


def main(cases_path, out_path):
    cases = json.load(open(cases_path))
    out = {name: run_case(n, argv) for name, (n, argv) in cases.items()}
    json.dump(out, open(out_path, "w"))


if __name__ == "__main__":
    os.environ.pop("RANK", None)  # plain `python pretrain_gpt.py`: one process, no groups
    sys.path.insert(0, ROOT)
    main(*sys.argv[1:])
