"""Every Linear layer's matrix product, behind one function (``linear``): the hardware shortcuts in the math.

Float32 or bfloat16 on a CPU (no gradient to keep): dasspec's own product (``decode_kernel.linear``), whose every
output is a function of its own row and weight row alone, summed in float32 in an order fixed by the width (a
bfloat16 output rounded once) - so a row has the same bits alone or in a batch of any size, at any thread count, on
AVX-512, AVX2 and portable CPUs (docs/architecture.md, "One arithmetic").  It reads the weight in place; no copy,
no size threshold.  Where the kernels cannot be built, torch's ``F.linear`` runs instead (``decode_kernel.guarantee``
says what that costs), with this shortcut for bfloat16:

bfloat16 on a CPU without bfloat16 matrix units (no AMX, no AVX512-BF16: most laptops and many servers): torch
multiplies bfloat16 matrices at a fixed cost per activation row - a 32-row product costs 32 one-row products - so
neither a batch of requests nor a speculative draft gets cheaper per token there.  So a bfloat16 weight multiplying
WIDE_ROWS or more rows is converted to float32 a tile of output rows at a time (a tile small enough to stay in
cache) and multiplied in float32; the result is cast back to bfloat16.  Float32 accumulation is what the bfloat16
product does too, so the values agree to bfloat16 rounding; GPUs and CPUs with bfloat16 units never take it.
Figures: docs/performance-journal.md, "Batching".
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import decode_kernel

WIDE_ROWS = 4                 # activation rows from which the tiled float32 product beats bfloat16 (measured)
TILE_BYTES = 1 << 21          # float32 bytes of one converted weight tile (about an L2 cache)
MIN_WEIGHT_ELEMENTS = 1 << 16  # smaller weights: the per-tile loop is not worth it


@functools.lru_cache(maxsize=None)
def cpu_has_bf16_units() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AMX or AVX512-BF16, from /proc/cpuinfo's flags)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"amx_bf16", "avx512_bf16"})
    except OSError:
        pass
    return True               # unknown: leave torch's own kernels alone


def tiled_float32_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` for a bfloat16 weight, computed in float32 one cached tile at a time."""
    N, K = weight.shape
    xf = x.reshape(-1, K).float()
    rows = max(8, TILE_BYTES // (4 * K))
    out_t = torch.empty(N, xf.shape[0], dtype=torch.float32, device=x.device)     # [N, M]: tiles write whole rows
    tile = torch.empty(min(rows, N), K, dtype=torch.float32, device=x.device)
    xt = xf.t()
    for i in range(0, N, rows):
        n = min(rows, N - i)
        part = tile[:n]
        part.copy_(weight[i:i + n])
        torch.mm(part, xt, out=out_t[i:i + n])
    out = out_t.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype, memory_format=torch.contiguous_format).reshape(*x.shape[:-1], N)   # row-major, as F.linear


KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def kernel_takes(x: Tensor, weight: Tensor) -> bool:
    """Whether ``linear(x, weight)`` is dasspec's own CPU product: float32 or bfloat16 (no gradient to keep, not
    traced)."""
    return (x.dtype in KERNEL_DTYPES and weight.dtype == x.dtype and x.is_cpu and weight.is_cpu
            and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and decode_kernel.available())


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    if kernel_takes(x, weight):
        w = weight if weight.stride(-1) == 1 else weight.contiguous()     # (cpu_weight_layout keeps them so)
        out = decode_kernel.linear(x.reshape(-1, x.shape[-1]), w, bias)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], weight.shape[0])
    if (weight.dtype == torch.bfloat16 and x.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and x.numel() >= WIDE_ROWS * x.shape[-1] and weight.numel() >= MIN_WEIGHT_ELEMENTS
            and weight.is_contiguous() and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and not cpu_has_bf16_units()):
        return tiled_float32_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` whose product is ``linear`` (same parameters, names and checkpoints)."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
