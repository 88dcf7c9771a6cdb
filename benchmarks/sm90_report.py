"""What every hot Triton kernel's sm_90 machine code says, at the production shapes, built on a machine without a GPU.

    python benchmarks/sm90_report.py [--json] [--only flash] [--triton-path DIR] [--kernels-from DIR]
                                     [--sass-dir DIR] [--results FILE]

The build is tests/kernels/gpu_compile.py's (its CASES are the shapes; a subprocess, as it must be),
for sm_90 only; the suite's background build (tests/support/kernels_compile_bg.py) is the same, and
its gate, tests/kernels/test_sm90_report.py, reads that build through report_rows() below.

Per kernel and shape: registers, spill bytes per thread, shared memory, and from its SASS (nvdisasm; see
tests/kernels/cubin_stats.py) the wgmma instructions (`hgmma`: HGMMA, and QGMMA for FP8) and mma.sync
ones (`hmma`: HMMA, and QMMA / IMMA), cp.async (LDGSTS) and TMA / bulk copies (UTMA*, UBLK*), and:

- instructions per MFLOP, for kernels with tensor-core instructions. A loop is a backward branch (a BRA
  to a lower address); a matmul loop is an innermost loop holding wgmma / mma.sync instructions. Its figure
  is its static instruction count (per warp, as the SASS lists them) divided by the MFLOP the CTA does
  in one iteration, which FLOP_PER_ITERATION gives from the block-size constexprs of the launch.
  `instr_per_mflop` is the loop with the fewest per MFLOP (the steady state: e.g. an attention kernel's
  unmasked loop over wholly visible key blocks beside its masked diagonal loop), `instr_per_mflop_max`
  the worst; `loops` lists them all. None when the kernel's constexprs are not in the table.
  Scale: an H100/H200 SM does about 4096 dense bf16 FLOP and issues 4 warp-instructions per clock, so
  244 clocks per MFLOP of tensor work; `issue_ratio` = instr_per_mflop x warps / 4 / 244 is the
  steady loop's issue time over its tensor time (above 1: the instructions, not the tensor cores, bound it;
  at the bf16/fp16 rate: FP8 tensor work is twice as fast, TF32 half).
- instructions per byte, for the others (memory-bound): the innermost loops that move global memory
  (or the whole kernel if it has none), instructions x warps / bytes the program moves in one iteration
  of each. The bytes are approximated from the SASS: each global load/store (LDG, STG, LDGSTS, RED,
  ATOM) moves its access width x 32 lanes, every lane taken as active (masked tails overcount) and TMA
  not counted. Informational: no budget rests on it.

--triton-path DIR runs the build under the Triton installed there (`pip install --target DIR
triton==3.6.0`, the GPU machine's), first on the build's PYTHONPATH. --kernels-from DIR builds the
kernels/ package of another checkout (e.g. `git worktree add /tmp/old <commit>`: a before/after table).
--results FILE tabulates a gpu_compile.py --json file instead of building.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILDER = os.path.join(ROOT, "tests", "kernels", "gpu_compile.py")
SM_MFLOP_CLOCKS = 1e6 / 4096  # clocks per MFLOP of dense bf16 tensor work on one Hopper SM
ISSUE_PER_CLOCK = 4  # warp-instructions an SM issues per clock (4 schedulers)


def _mnk(c, k):
    return c["BLOCK_M"] * c["BLOCK_N"] * c[k]


# FLOP one CTA does in one iteration of a kernel's matmul loop, from its launch's constexprs. Keep it in
# step with the kernels: a kernel missing here, or whose constexprs are renamed, reports None.
FLOP_PER_ITERATION = {
    "_attn_fwd": lambda c: 4 * _mnk(c, "BLOCK_D"),  # S = Q K^T, O += P V
    "_attn_bwd_dkdv": lambda c: 8 * _mnk(c, "BLOCK_D"),  # S, dP = dO V^T, dV += P^T dO, dK += dS^T Q
    "_attn_bwd_dq": lambda c: 6 * _mnk(c, "BLOCK_D"),  # S, dP, dQ += dS K
    "_gg_rows": lambda c: 2 * _mnk(c, "BLOCK_K"),
    "_gg_dw": lambda c: 2 * _mnk(c, "BLOCK_K"),
    "_blockwise_mm": lambda c: 2 * _mnk(c, "BLOCK_K"),
}


def mflop_per_iteration(kernel, constexprs):
    try:
        return FLOP_PER_ITERATION[kernel](constexprs) / 1e6
    except (KeyError, TypeError):
        return None


def _matmul(row, sass):
    mflop = mflop_per_iteration(row["kernel"], row["constexprs"])
    loops = [{"instructions": lp["instructions"], "hgmma": lp["wgmma"], "hmma": lp["mma_sync"],
              "instr_per_mflop": round(lp["instructions"] / mflop, 1) if mflop else None}
             for lp in sass["matmul_loops"]]
    figures = [lp["instr_per_mflop"] for lp in loops if lp["instr_per_mflop"] is not None]
    best = min(figures) if figures else None
    return {"mflop_per_iteration": mflop, "loops": loops, "instr_per_mflop": best,
            "instr_per_mflop_max": max(figures) if figures else None,
            "issue_ratio": round(best * row["warps"] / ISSUE_PER_CLOCK / SM_MFLOP_CLOCKS, 2) if best else None}


def _memory(sass):
    loops = sass["memory_loops"] or [sass]  # no loop: the whole kernel is one iteration
    instructions = sum(lp["instructions"] for lp in loops)
    moved = 32 * sum(lp["global_bytes"] for lp in loops)  # per warp; x warps / (x warps) cancels
    return {"loop_instructions": instructions, "bytes_per_warp": moved,
            "instr_per_byte": round(instructions / moved, 4) if moved else None}


def _row(r, case, res):
    sass = r["sass"]
    row = {"kernel": r["kernel"], "shape": case["case"], "hot": case["hot"], "group": case["group"],
           "arch": res["arch"], "triton": res["triton"], "regs": r["regs"], "spills": r["spill_bytes"],
           "smem": r["shared"], "warps": r["num_warps"], "stages": r["num_stages"], "constexprs": r["constexprs"],
           "hgmma": sass["wgmma"], "hmma": sass["mma_sync"], "ldgsts": sass["ldgsts"], "tma": sass["tma"]}
    row.update(_matmul(row, sass) if row["hgmma"] + row["hmma"] else _memory(sass))
    return row


def report_rows(results, arch=90):
    """One report row per case and kernel of gpu_compile.py's results (its --json) for sm_<arch>, in the
    order of its cases: a build that several cases launch (Triton compiles it once) is listed under each."""
    rows = []
    for res in results:
        if res["arch"] == arch:
            rows += [_row(res["rows"][i], case, res) for case in res["cases"] for i in case["rows"]]
    return rows


def _fmt(x):
    return "-" if x is None else f"{x:g}"


def table(rows):
    lines = ["| kernel | shape | regs | spill B | smem B | warps | HGMMA | HMMA "
             "| cp.async | TMA | matmul loops: instr (per MFLOP) | instr/MFLOP | issue/tensor | instr/B |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|--:|--:|"]
    for r in rows:
        loops = ", ".join(f"{lp['instructions']} ({_fmt(lp['instr_per_mflop'])})" for lp in r.get("loops", []))
        lines.append(f"| {r['kernel']} | {r['shape']} | {r['regs']} | {r['spills']} | {r['smem']} | {r['warps']} "
                     f"| {r['hgmma']} | {r['hmma']} | {r['ldgsts']} | {r['tma']} | {loops or '-'} "
                     f"| {_fmt(r.get('instr_per_mflop'))} | {_fmt(r.get('issue_ratio'))} "
                     f"| {_fmt(r.get('instr_per_byte'))} |")
    return "\n".join(lines)


def build(only=None, triton_path=None, kernels_from=None, sass_dir=None):
    """gpu_compile.py's results for sm_90, built in a subprocess (the target driver and the Triton on its path)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a real build, not the interpreter
    env["PYTHONPATH"] = os.pathsep.join(p for p in (triton_path, kernels_from or ROOT, env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        cmd = [sys.executable, BUILDER, "--arch", "90", "--json", out] + (["--only", only] if only else []) \
            + (["--sass-dir", sass_dir] if sass_dir else [])
        proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if not os.path.exists(out):
            raise SystemExit(f"sm90_report: the build failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
        with open(out) as f:
            return json.load(f)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object per kernel and shape")
    ap.add_argument("--only", help="only cases whose group or label contains this (e.g. flash, norm, d128)")
    ap.add_argument("--triton-path", help="a directory with another Triton (pip install --target DIR triton==3.6.0)")
    ap.add_argument("--kernels-from", help="a checkout whose kernels/ to build instead of this one's")
    ap.add_argument("--sass-dir", help="also write every kernel's SASS here")
    ap.add_argument("--results", help="a gpu_compile.py --json file to tabulate instead of building")
    a = ap.parse_args(argv)
    if a.results:
        with open(a.results) as f:
            results = json.load(f)
    else:
        results = build(a.only, a.triton_path and os.path.abspath(a.triton_path),
                        a.kernels_from and os.path.abspath(a.kernels_from), a.sass_dir)
    rows = report_rows(results)
    errors = [e for res in results if res["arch"] == 90 for e in res["errors"]]
    if a.json:  # a JSON array, one object a line
        print("[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]")
    else:
        print(f"sm_90, triton {results[0]['triton']}")
        print(table(rows))
    for e in errors:
        print(f"FAILED to build: {e['case']}: {e['error'][:500]}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
