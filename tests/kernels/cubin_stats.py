"""What the machine code of a Triton cubin says: resources (cuobjdump) and SASS statistics (nvdisasm).

resources(cubin) -> (registers, spill bytes per thread).
sass_stats(cubins, arch) -> one dict per cubin: whole-kernel counts of warpgroup MMA (`wgmma`: HGMMA, and
QGMMA / IGMMA for FP8 / int8), warp MMA (`mma_sync`: HMMA, QMMA, IMMA, ...), LDGSTS (cp.async) and TMA /
bulk-copy instructions (UTMA*, UBLK*), and its loops.

A loop is a backward branch (a BRA whose target address is lower than its own); its body is every
instruction from the target to the branch, counted statically as the SASS lists them (per warp). Not
loops: a backward branch whose range crosses an earlier loop's (starts inside it, ends after it), which
is an out-of-line block jumping back into the loop (a slow path, e.g. an mbarrier retry), and the
farther of two back edges to one target. `matmul_loops` are the innermost loops that hold MMA
instructions (no loop with them nested inside: a spin-wait loop nested in a matmul loop leaves it
innermost); `memory_loops` likewise for global loads/stores. Each loop reports its instructions,
wgmma / mma_sync counts, the bytes its global memory instructions move per thread (access width from
the opcode: .128 = 16 B, .64 = 8, .U16 = 2, .U8 = 1, else 4; predicates ignored, so an upper bound for
masked tails) and its opcode mix.

nvdisasm costs about half a second of start-up per call, so every cubin of a build is disassembled in
one call: their code sections (.text.<kernel>) are concatenated into one raw instruction image
(`nvdisasm -b SM90a`), whose listing has absolute addresses, and split back by offset.
"""
import os
import re
import struct
import subprocess
import tempfile

import triton

GLOBAL_MEMORY = {"LDG", "STG", "LDGSTS", "RED", "REDG", "ATOM", "ATOMG", "LD", "ST"}
_WIDTH = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}
_TARGETED = {"BRA", "BSSY", "CALL", "JMP"}  # instructions whose last operand is a code address
_TARGET = re.compile(r"0x([0-9a-f]+)\s*$")
_LINE = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)(\S*)\s*(.*?)\s*;?\s*$")


def tool(name):
    """A CUDA binary utility from Triton's wheel (the one matching its ptxas), else from PATH."""
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.path.exists(path) else name


def resources(cubin):
    """(registers, local-memory bytes per thread: stack frame + local = spills) of one cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", out)
    if m is None:
        raise RuntimeError(f"cannot parse cuobjdump output: {out!r}")
    return int(m.group(1)), int(m.group(2)) + int(m.group(3))


def _code(cubin):
    """The bytes of the cubin's kernel code section (.text.<name>; Triton emits one), from its ELF64 headers."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = heads[shstrndx][4]
    for name, _, _, _, off, size in heads:
        if cubin[names + name:cubin.index(b"\0", names + name)].startswith(b".text."):
            return cubin[off:off + size]
    raise ValueError("no .text section in this cubin")


def disassemble(cubins, arch):
    """One list of (address, opcode, modifiers, operands, predicate) per cubin, addresses from its own start."""
    codes = [_code(c) for c in cubins]
    with tempfile.NamedTemporaryFile(suffix=".bin") as f:
        f.write(b"".join(codes))
        f.flush()
        name = f"SM{arch}" + ("a" if arch >= 90 else "")  # Triton builds sm_90a (wgmma needs the a)
        out = subprocess.run([tool("nvdisasm"), "-b", name, f.name], capture_output=True, text=True,
                             check=True).stdout
    starts, at = [], 0
    for code in codes:
        starts.append(at)
        at += len(code)
    listings = [[] for _ in codes]
    k = 0
    for line in out.splitlines():
        m = _LINE.match(line)
        if m is None:
            continue
        addr = int(m.group(1), 16)
        while k + 1 < len(starts) and addr >= starts[k + 1]:
            k += 1
        pred, op, mods, operands = m.group(2, 3, 4, 5)
        if op in _TARGETED:  # a code address in the image: make it the kernel's own
            operands = _TARGET.sub(lambda t: f"0x{int(t.group(1), 16) - starts[k]:x}", operands)
        listings[k].append((addr - starts[k], op, mods, operands, (pred or "").strip()))
    return listings


def _bytes(op, mods):
    if op not in GLOBAL_MEMORY:
        return 0
    widths = [_WIDTH[m] for m in mods.split(".") if m in _WIDTH]
    return widths[0] if widths else 4


def _loops(listing):
    """(first, last) address of every loop, nested or not, per the module docstring."""
    ends = {}
    for addr, op, _, operands, _ in listing:
        m = _TARGET.search(operands) if op == "BRA" else None
        if m and int(m.group(1), 16) < addr:  # of two back edges to one target the farther is out of line
            target = int(m.group(1), 16)
            ends[target] = min(ends.get(target, addr), addr)
    kept = []
    for first, last in sorted(ends.items()):
        if not any(f < first <= l < last for f, l in kept):  # crosses an earlier loop: out-of-line block
            kept.append((first, last))
    return kept


def _summary(listing, first=0, last=None):
    body = [i for i in listing if first <= i[0] and (last is None or i[0] <= last)]
    ops = {}
    for _, op, _, _, _ in body:
        ops[op] = ops.get(op, 0) + 1
    return {"instructions": len(body), "wgmma": sum(n for op, n in ops.items() if op.endswith("GMMA")),
            "mma_sync": sum(n for op, n in ops.items() if op.endswith("MMA") and not op.endswith("GMMA")),
            "global_bytes": sum(_bytes(op, mods) for _, op, mods, _, _ in body), "ops": ops}


def _innermost(loops, has):
    """The loops holding what `has` says that have no such loop strictly inside them."""
    with_it = [lp for lp in loops if has(lp)]
    return [lp for lp in with_it if not any(o is not lp and lp["first"] <= o["first"] and o["last"] <= lp["last"]
                                            for o in with_it)]


def stats(listing):
    """The statistics of one disassembled kernel (see the module docstring)."""
    whole = _summary(listing)
    loops = [{"first": f, "last": l, **_summary(listing, f, l)} for f, l in _loops(listing)]
    ops = whole.pop("ops")
    return {**whole,
            "ldgsts": ops.get("LDGSTS", 0),
            "tma": sum(n for op, n in ops.items() if op.startswith(("UTMA", "UBLK"))),
            "matmul_loops": _innermost(loops, lambda lp: lp["wgmma"] + lp["mma_sync"]),
            "memory_loops": _innermost(loops, lambda lp: lp["global_bytes"])}


def sass_stats(cubins, arch):
    return [stats(listing) for listing in disassemble(cubins, arch)]


def listing_text(listing):
    """A disassembled kernel back as text (for --sass-dir)."""
    return "\n".join(f"/*{a:04x}*/ {pred:>5} {op}{mods} {operands}".rstrip() + " ;"
                     for a, op, mods, operands, pred in listing)
