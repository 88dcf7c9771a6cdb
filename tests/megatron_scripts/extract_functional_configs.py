"""Write functional_configs.json.gz: the MODEL_ARGS of every GPT and BERT functional-test config
of a Megatron-LM checkout (tests/functional_tests/test_cases/{gpt,bert}/*/model_config.yaml), as
the argv its launcher passes (true: the bare switch; false: left out; ${VARS} kept for the test
to fill in). tests/test_megatron_configs.py parses each one.

    python tests/megatron_scripts/extract_functional_configs.py MEGATRON_GIT_DIR [COMMIT]
"""

import gzip
import json
import os
import subprocess
import sys

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))


def _git(repo, *args):
    return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, check=True).stdout


def argv_of(model_args):
    argv = []
    for flag, value in (model_args or {}).items():
        if value is True or value == "true":
            argv.append(flag)
        elif value is False or value == "false":
            continue
        elif isinstance(value, list):
            argv += [flag] + [str(v) for v in value]
        else:
            argv += [flag] + (str(value).split() if flag in ("--data-path", "--rampup-batch-size") else [str(value)])
    return argv


def main(repo, commit="HEAD"):
    root = "tests/functional_tests/test_cases"
    names = _git(repo, "ls-tree", "-r", "--name-only", commit, f"{root}/gpt", f"{root}/bert").split()
    configs = {}
    for path in sorted(n for n in names if n.endswith("/model_config.yaml")):
        kind, name = path.split("/")[-3:-1]
        doc = yaml.safe_load(_git(repo, "show", f"{commit}:{path}"))
        configs[f"{kind}/{name}"] = argv_of(doc.get("MODEL_ARGS"))
    out = {"_source": f"Megatron-LM {_git(repo, 'rev-parse', commit).strip()} {root}/{{gpt,bert}}", "configs": configs}
    text = json.dumps(out, indent=0, sort_keys=True).encode()
    with gzip.GzipFile(os.path.join(HERE, "functional_configs.json.gz"), "wb", mtime=0) as f:  # same bytes each run
        f.write(text)
    print(f"{len(configs)} configs")


if __name__ == "__main__":
    main(*sys.argv[1:])
