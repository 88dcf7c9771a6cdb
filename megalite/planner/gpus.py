"""The GPUs a plan can be made for, and `--cluster` strings ("64xH100-80GB", "4xA100-80GB,4xRTX3090-24GB").

Figures are the vendors' published ones (datasheets and architecture whitepapers): memory, the dense
tensor-core peak for 16-bit inputs with fp32 accumulation (bf16 where the GPU has it, else fp16; GeForce
cards run fp32 accumulation at half their fp16-accumulate rate), the plain fp32 peak (fp32 runs: megalite
leaves TF32 off), and the link inside a node per GPU, one
direction (NVLink generation, else PCIe x16). `gemm_efficiency` is the fraction of that peak a large
GEMM reaches in cuBLAS, from public measurements; megalite has not measured it on these GPUs yet
(benchmarks/gpu_checks.sh will, on the GPU it is lent), so it is one number per GPU type, never per run.
`op_overhead_us`: the host's time to launch one operator from PyTorch's eager mode (a few microseconds).
"""

import dataclasses
import re

from megalite.config import ConfigError

PCIE3, PCIE4, PCIE5 = 16.0, 32.0, 64.0  # GB/s per direction, x16
INTER_NODE = 25.0  # GB/s per GPU across nodes (a 200 Gbit/s NIC per GPU)
MAX_GPUS = 1 << 20
# the fraction of a link's nominal bandwidth NCCL's ring collectives reach (nccl-tests' bus bandwidth: about
# 230 of NVLink3's 300 GB/s on A100 NVSwitch systems, 20 of 25 GB/s over 200 Gbit/s InfiniBand)
LINK_EFFICIENCY = {"intra": 0.77, "inter": 0.8}
LATENCY_US = 15.0  # an NCCL collective's start-up inside a node (nccl-tests: ~10-20 us for small messages)


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float  # device memory, GiB
    peak_tflops: float  # dense 16-bit tensor-core peak, fp32 accumulation
    bf16: bool  # whether it has bf16 (else fp16 with a loss scale)
    intra_node_gbps: float  # GB/s per GPU, one direction, to the GPUs of its node
    link: str
    gemm_efficiency: float  # achievable fraction of peak_tflops for large GEMMs (public figures)
    memory_gbps: float  # HBM / GDDR bandwidth, GB/s (element-wise kernels are bound by it)
    fp32_tflops: float = None  # dense fp32 peak without tensor cores (megalite leaves TF32 off): fp32 runs
    op_overhead_us: float = 8.0  # host time per operator (PyTorch eager launch); a small model is bound by it
    asynchronous: bool = True  # the device runs behind the host's launches (a CPU "device" does not)
    sms: int = None  # streaming multiprocessors: GEMM tiles run in waves over them (gemm.py); None: no waves
    host_gbps: float = PCIE4  # GB/s each way to host memory (PCIe x16): --optimizer-cpu-offload's copies
    # the host memory bandwidth one rank's CPU optimizer step reaches (a server's DDR, some 200-400 GB/s, shared
    # by its 8 GPUs' ranks; torch's element-wise CPU kernels at about half of a rank's part): an assumption for
    # GPU servers, measured for CPU ranks (benchmarks/plan_cpu.py --offload)
    host_step_gbps: float = 20.0
    # bytes a second the device's own optimizer step moves (None: memory_gbps x the element-wise efficiency, a
    # fused kernel's); a CPU rank's is measured, as its host step (torch's AdamW ops, several passes)
    optimizer_gbps: float = None


GPUS = {g.name: g for g in (
    GPU("V100-32GB", 32, 125.0, False, 150.0, "NVLink2", 0.70, 900, 15.7, sms=80, host_gbps=PCIE3),
    GPU("A100-40GB", 40, 312.0, True, 300.0, "NVLink3", 0.80, 1555, 19.5, sms=108),
    GPU("A100-80GB", 80, 312.0, True, 300.0, "NVLink3", 0.80, 2039, 19.5, sms=108),
    GPU("H100-80GB", 80, 989.0, True, 450.0, "NVLink4", 0.72, 3350, 67.0, sms=132, host_gbps=PCIE5),
    GPU("H200", 141, 989.0, True, 450.0, "NVLink4", 0.74, 4800, 67.0, sms=132, host_gbps=PCIE5),
    GPU("RTX2080Ti-11GB", 11, 53.8, False, PCIE3, "PCIe3", 0.80, 616, 13.4, sms=68, host_gbps=PCIE3),
    GPU("RTX3090-24GB", 24, 71.0, True, PCIE4, "PCIe4", 0.85, 936, 35.6, sms=82),
    GPU("RTX4090-24GB", 24, 165.2, True, PCIE4, "PCIe4", 0.80, 1008, 82.6, sms=128),
    GPU("L40S", 48, 362.0, True, PCIE4, "PCIe4", 0.70, 864, 91.6, sms=142),
)}


@dataclasses.dataclass(frozen=True)
class Cluster:
    """GPUs in rank order (the first `count` of the first type, then the next ...), `gpus_per_node` to a node;
    a node holds one type (a type's count must fill whole nodes unless it is the only one)."""
    gpus: tuple
    gpus_per_node: int
    intra_node_gbps: dict  # per type name (a --intra-node-bandwidth overrides every type)
    inter_node_gbps: float
    reach: dict = None  # what collectives reach of the links (default LINK_EFFICIENCY: NCCL's)
    latency_us: float = LATENCY_US  # a collective's start-up time, whatever its size

    @property
    def size(self):
        return len(self.gpus)

    @property
    def types(self):
        return list(dict.fromkeys(g.name for g in self.gpus))

    def node_of(self, rank):
        return rank // self.gpus_per_node

    def link_gbps(self, ranks):
        """The slowest link a ring over these ranks crosses, GB/s per direction that a collective reaches."""
        reach = self.reach or LINK_EFFICIENCY
        intra = min(self.intra_node_gbps[self.gpus[r].name] for r in ranks) * reach["intra"]
        if len({self.node_of(r) for r in ranks}) > 1:
            return min(intra, self.inter_node_gbps * reach["inter"])
        return intra

    def describe(self):
        parts = []
        for name in self.types:
            parts.append(f"{sum(g.name == name for g in self.gpus)}x{name}")
        return ",".join(parts)


def parse_cluster(text, gpus_per_node=8, intra_node_bandwidth=None, inter_node_bandwidth=None):
    """'64xH100-80GB' or '4xA100-80GB,4xRTX3090-24GB' -> Cluster. One line per mistake."""
    if gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node {gpus_per_node} must be >= 1")
    gpus = []
    for part in (p.strip() for p in str(text).split(",")):
        m = re.fullmatch(r"(\d+)\s*[xX]\s*(\S+)", part)
        if not m or not 1 <= int(m.group(1)) <= MAX_GPUS:
            raise ConfigError(f"--cluster {text!r}: each part is COUNTxGPU with 1 <= COUNT <= {MAX_GPUS} "
                              f"(e.g. 8xH100-80GB), got {part!r}")
        names = _canonical(m.group(2))
        if len(names) != 1:
            raise ConfigError(f"--cluster: {'ambiguous' if names else 'unknown'} GPU {m.group(2)!r}; "
                              f"{'one of' if names else 'known'}: {', '.join(names or GPUS)}")
        gpus += [GPUS[names[0]]] * int(m.group(1))
        if len(gpus) > MAX_GPUS:
            raise ConfigError(f"--cluster {text!r}: more than {MAX_GPUS} GPUs")
    counts = [sum(1 for g in gpus if g.name == n) for n in dict.fromkeys(g.name for g in gpus)]
    if len(counts) > 1 and any(c % gpus_per_node for c in counts):
        raise ConfigError(f"--cluster {text!r}: with mixed GPUs each type must fill whole nodes of "
                          f"--gpus-per-node {gpus_per_node} (got {counts})")
    for flag, v in (("--intra-node-bandwidth", intra_node_bandwidth), ("--inter-node-bandwidth", inter_node_bandwidth)):
        if v is not None and not 0 < v < float("inf"):
            raise ConfigError(f"{flag} {v} must be > 0 (GB/s per GPU, one direction)")
    intra = {g.name: intra_node_bandwidth or g.intra_node_gbps for g in gpus}
    return Cluster(tuple(gpus), min(gpus_per_node, len(gpus)), intra, inter_node_bandwidth or INTER_NODE)


def _canonical(name):
    """The table's names a --cluster name means: itself, or all that share its model (A100: both)."""
    key = name.replace("_", "-").upper()
    exact = [n for n in GPUS if n.upper() == key]
    return exact or [n for n in GPUS if n.upper().split("-")[0] == key]
