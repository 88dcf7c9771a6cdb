"""CI runs exactly the README's two set-up commands."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_setup_commands():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Set up\s*```bash\n(.*?)```", readme, re.S)
    assert block, "README.md lost its Set up block"
    commands = [ln.strip() for ln in block.group(1).splitlines() if ln.strip()]
    assert len(commands) == 2, commands
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()
          if ln.strip() and not ln.startswith("#") and not ln.startswith(("set ", "cd "))]
    assert ci == commands, f".ci/run runs {ci}, README says {commands}"
