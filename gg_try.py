import importlib, sys, os
sys.path.insert(0, os.path.join(os.getcwd(), "tests", "kernels"))
sys.path.insert(0, os.getcwd())
import gpu_compile
arch, stages, bk = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
gg = importlib.import_module("kernels.grouped_gemm")
orig = gg._config
def cfg(dtype):
    bm, bn, k, w, s = orig(dtype)
    return (bm, bn, bk, w, stages) if str(dtype) == "torch.float32" else (bm, bn, k, w, s)
gg._config = cfg
res = gpu_compile.build(arch, "grouped")
for r in res["rows"]:
    print(arch, stages, bk, r["kernel"], r["case"][:40], "regs", r["regs"], "spill", r["spill_bytes"])
print("errors", res["errors"])
