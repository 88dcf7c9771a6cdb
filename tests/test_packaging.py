"""What `pip install .` (not editable) ships: the wheel built from this tree holds every module of megalite/ and
kernels/ and the data files the code opens (megatron_flags.json, tuned_configs.json). A package missing from
setup.py is invisible to an editable install and to every other test: tools/plan.py failed for anyone who
installed the wheel (no megalite/planner)."""

import glob
import os
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_FILES = ("megalite/cli/megatron_flags.json", "kernels/tuned_configs.json")


def test_every_source_directory_is_a_package():
    """find_packages finds a directory only by its __init__.py: one without it ships nothing."""
    missing = []
    for top in ("megalite", "kernels"):
        for d, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            if any(f.endswith(".py") for f in files) and "__init__.py" not in files:
                missing.append(os.path.relpath(d, ROOT))
    assert not missing, f"directories with modules but no __init__.py (not shipped): {missing}"


def test_the_wheel_holds_every_module_and_data_file(tmp_path):
    src = tmp_path / "src"  # a copy: building in the tree would leave build/ and egg-info behind
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "tests", "__pycache__", "*.egg-info", "build",
                                                              "dist", "runs", "checkpoints"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = glob.glob(str(tmp_path / "dist" / "megalite-*.whl"))
    shipped = set(zipfile.ZipFile(wheel).namelist())
    want = {os.path.relpath(f, ROOT) for top in ("megalite", "kernels")
            for f in glob.glob(os.path.join(ROOT, top, "**", "*.py"), recursive=True)} | set(DATA_FILES)
    assert not want - shipped, f"the wheel lacks {sorted(want - shipped)}"


def test_no_other_installed_distribution_ships_our_top_level_names():
    """Two distributions with one import name overwrite each other's files on install and shadow each other on
    sys.path: transformers 5.25 pulled in Hugging Face's `kernels`, and transformers then imported our `kernels`
    as its own and failed (setup.py caps transformers below it)."""
    import importlib.metadata as md
    clashes = []
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name and name.lower() != "megalite":
            tops = (dist.read_text("top_level.txt") or "").split()
            tops += [f.parts[0] for f in (dist.files or ()) if len(f.parts) > 1 and f.parts[1] == "__init__.py"]
            clashes += [f"{name} ships `{t}`" for t in {"megalite", "kernels"} & set(tops)]
    assert not clashes, f"installed distributions that clash with megalite's packages: {sorted(set(clashes))}"
