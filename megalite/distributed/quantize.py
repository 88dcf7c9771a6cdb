"""Low-precision payloads with per-row scales (Streaming DiLoCo's quantized pseudo-gradients,
--semi-sync-quantize): a 1-D tensor is cut into rows of ROW elements; bf16 rounds each element (its range
is fp32's: no scale needed), fp8 (e4m3) first divides each row by its largest magnitude / 448, so that every
row uses the format's whole range. Payloads travel as bytes (uint8), which every backend gathers.

Error of one element x (round to nearest), with s its row's scale:
    bf16: |x - q(x)| <= |x| 2^-8          (8 significant bits)
    fp8:  |x - q(x)| <= max(|x| 2^-4, s 2^-10)   (4 significant bits; below 2^-6 s the subnormals' step 2^-9 s)
"""

import torch

ROW = 256
FP8_MAX = 448.0
KINDS = ("bf16", "fp8")


def quantize(x, kind):
    """(payload bytes [rows * ROW * itemsize] uint8, scales [rows] fp32 or None) of 1-D x."""
    pad = (-x.numel()) % ROW
    rows = torch.nn.functional.pad(x.float(), (0, pad)).view(-1, ROW)
    if kind == "bf16":
        return rows.to(torch.bfloat16).view(torch.uint8).reshape(-1), None
    scale = rows.abs().amax(dim=1) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (rows / scale[:, None]).to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1), scale


def dequantize(payload, scale, kind, n):
    """x's n values (float64) back from quantize's output."""
    if kind == "bf16":
        return payload.view(torch.bfloat16).double()[:n]
    rows = payload.view(torch.float8_e4m3fn).view(-1, ROW).double() * scale.double()[:, None]
    return rows.reshape(-1)[:n]


def error_bound(x, kind):
    """The largest |x - dequantize(quantize(x))| per element (module docstring)."""
    if kind == "bf16":
        return x.abs().double() * 2.0 ** -8
    pad = (-x.numel()) % ROW
    rows = torch.nn.functional.pad(x.double(), (0, pad)).view(-1, ROW)
    scale = (rows.abs().amax(dim=1) / FP8_MAX)[:, None].expand_as(rows)
    return torch.maximum(rows.abs() * 2.0 ** -4, scale * 2.0 ** -10).reshape(-1)[:x.numel()]


def payload_bytes(n, kind):
    """Bytes one rank sends for n values (payload and scales)."""
    rows = -(-n // ROW)
    return rows * ROW * (2 if kind == "bf16" else 1) + (0 if kind == "bf16" else 4 * rows)
