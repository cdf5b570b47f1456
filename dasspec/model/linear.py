"""Every Linear layer's matrix product, behind one function (``linear``): the hardware shortcuts in the math.

On a CPU without bfloat16 matrix units (no AMX, no AVX512-BF16: most laptops and many servers) torch multiplies
bfloat16 matrices at a fixed cost per activation row - a 32-row product costs 32 one-row products - so neither a
batch of requests nor a speculative draft gets cheaper per token there.  Float32 GEMMs do get cheaper per row as
rows are added.  So a bfloat16 weight multiplying WIDE_ROWS or more rows is converted to float32 a tile of output rows
at a time (a tile small enough to stay in cache) and multiplied in float32; the result is cast back to bfloat16.
Float32 accumulation is what the bfloat16 product does too, so the values agree to bfloat16 rounding; float32
models, GPUs and CPUs with bfloat16 units never take it.  Figures: docs/performance.md, "Batching".

Float32 on a CPU, two rows or more: oneDNN with the weight packed once (``packed_float32_linear``).  torch's
float32 ``F.linear`` on a CPU is MKL's sgemm, which on x86 with AVX-512 neither batches well at a few rows nor
gives a row the same bits at every row count: rows of a 1-3 row product, of an odd row count and of a multiple of
4 are summed in different orders.  A packed oneDNN product is faster at a few rows and gives a row the same bits at
every count from 2 up (its one-row kernel sums some shapes differently).  A single row takes it too when torch
runs more than one thread (``one_row_packed``: MKL's one-row product loses time to its threading there) and keeps
MKL's product on one thread, where that is faster; so a batch-1 decode's last bits may differ between one thread
and more, and a row decoded alone and the same row in a batch may differ in the last bits on such a host, while
rows of batches of any two sizes agree.  Where the CPU kernels are built with AVX-512, a product of at most 16 rows
reads a second copy of the weight in 16-column panels instead (``decode_kernel.register_panels``): oneDNN's own
arithmetic - each output element a chain of FMAs over k from zero in oneDNN's k-blocks, registered only where a
test product agrees with oneDNN's bit for bit at the thread count of the call - streamed faster than oneDNN's
few-row kernels do, and a single row taking the packed product (two threads or more) then gets the bits it has among
others.  The packed copies (oneDNN's, then the panels where they fit) are made on a
weight's first product without autograd and kept beside it (``PACK_BUDGET_BYTES`` in all, each copy at most
``MEMORY_SHARE`` of the free memory; a weight past that keeps ``F.linear`` for good, so each weight always takes one
kernel).  Figures: docs/performance.md, "Batched AR
against vLLM".
"""

from __future__ import annotations

import functools
import os
import threading
import weakref

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


PACK_BUDGET_BYTES = int(os.environ.get("DASSPEC_PACK_BUDGET_BYTES", 4 << 30))   # packed float32 copies, in all
PACK_MIN_ELEMENTS = 1 << 18   # smaller weights keep F.linear: oneDNN's per-call cost outweighs what it saves there
MEMORY_SHARE = 0.25           # and a copy is made only while it takes at most this share of the free host memory


def _available_bytes() -> float:
    """MemAvailable of /proc/meminfo (unknown: no limit)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return float("inf")


@functools.lru_cache(maxsize=None)
def onednn_packing() -> bool:
    """Whether torch's oneDNN linear with a packed weight works here (x86 CPU builds; checked once)."""
    try:
        w = torch.ones(8, 16)
        p = torch.ops.mkldnn._reorder_linear_weight(w, 8)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 16), p, None, "none", [], "")
        return bool(torch.equal(y, torch.full((2, 8), 16.0)))
    except (RuntimeError, AttributeError):
        return False


class _Packs:
    """Packed copies of float32 weights, keyed by the weight tensor's identity (dropped with it; remade if it is
    written in place).  One thread decides and packs at a time; a thread asking meanwhile waits for the copy, so
    no call takes another kernel because a copy was being made."""

    def __init__(self):
        self.table: dict[int, tuple | None] = {}      # id(weight) -> (packed, version, data_ptr); None: refused
        self.panel_bytes: dict[int, int] = {}          # id(weight) -> bytes of its panels (registered ones only)
        self.bytes = 0
        self._lock = threading.Lock()

    def get(self, weight: Tensor) -> Tensor | None:
        key = id(weight)
        hit = self.table.get(key, False)
        if hit is None:
            return None
        if hit is not False and hit[1] == weight._version and hit[2] == weight.data_ptr():
            return hit[0]
        with self._lock:
            hit = self.table.get(key, False)
            if hit is None:
                return None
            if hit is not False and hit[1] == weight._version and hit[2] == weight.data_ptr():
                return hit[0]
            if hit is False:                                  # first sight: decide once, for good
                size = weight.numel() * 4
                refused = (weight.dim() != 2 or weight.numel() < PACK_MIN_ELEMENTS
                           or self.bytes + size > PACK_BUDGET_BYTES or size > MEMORY_SHARE * _available_bytes())
                weakref.finalize(weight, self._freed, key, 0 if refused else size)
                if refused:
                    self.table[key] = None
                    return None
                self.bytes += size
            try:
                with torch.inference_mode(False), torch.no_grad():
                    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 8)
            except RuntimeError:
                self.table[key] = None                         # cannot be packed: F.linear for good
                raise
            if hit is not False:                               # written in place: the old copy's panels go
                self._drop_panels(key, hit[0])
            self._add_panels(key, packed, weight)
            self.table[key] = (packed, weight._version, weight.data_ptr())
            return packed

    def _add_panels(self, key: int, packed: Tensor, weight: Tensor) -> None:
        """Panels for products of few rows beside oneDNN's copy (``decode_kernel.register_panels``: the same bits),
        where they fit what is left of the budget; an optional copy, so any failure leaves oneDNN's product alone."""
        size = -(-weight.shape[0] // 16) * 16 * weight.shape[1] * 4
        if (self.bytes + size > PACK_BUDGET_BYTES or size > MEMORY_SHARE * _available_bytes()
                or not decode_kernel.available()):
            return
        try:
            with torch.inference_mode(False), torch.no_grad():
                registered = decode_kernel.register_panels(packed, weight.detach()) > 0
        except RuntimeError:
            registered = False
        if registered:
            self.panel_bytes[key] = size
            self.bytes += size

    def _drop_panels(self, key: int, packed: Tensor) -> None:
        if decode_kernel.available():
            decode_kernel.unregister_panels(packed)
        self.bytes -= self.panel_bytes.pop(key, 0)

    def _freed(self, key: int, size: int) -> None:
        hit = self.table.pop(key, None)
        if hit:
            self._drop_panels(key, hit[0])
        self.bytes -= size


_PACKS = _Packs()


def packed_float32_linear(x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """``F.linear(x, weight, bias)`` for a float32 weight packed by oneDNN; a row's value is the same in every call
    of two or more rows (a single row takes oneDNN's one-row kernel, which may round differently, unless the weight
    has panels: ``decode_kernel.register_panels``, oneDNN's arithmetic for every row count up to 16).  The one-call
    sublayers (``decode_kernel``'s ``packed_product``) make the same call with the same padding."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    rows = padded_rows(M)
    if decode_kernel.available():       # the same call as the one-call sublayers' (panels for a few rows)
        out = decode_kernel.packed_linear(x2, packed, rows)
    elif rows != M:
        out = torch.ops.mkldnn._linear_pointwise(torch.cat((x2, x2.new_zeros(rows - M, K))), packed, None, "none",
                                                 [], "")[:M]
    else:
        out = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), packed, None, "none", [], "")
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], out_features) if x.dim() != 2 else out


def padded_rows(M: int) -> int:
    """The row count a packed product of M rows runs at (zero rows past M): a few counts, since oneDNN builds a
    kernel per shape; one row keeps oneDNN's own one-row kernel."""
    step = 8 if M <= 64 else 16 if M <= 512 else 64
    return 1 if M == 1 else -(-M // step) * step


def one_row_packed() -> bool:
    """Whether a single row takes the packed product too: with more than one thread, where MKL's one-row product
    loses time to its threading; on one thread MKL's is the faster (docs/performance.md, "Batched AR against
    vLLM")."""
    return torch.get_num_threads() > 1


def refused(weight: Tensor) -> bool:
    """Whether ``weight`` was refused a packed copy for good (too small to pay, over budget)."""
    return _PACKS.table.get(id(weight), False) is None


def packed_weight(x: Tensor, weight: Tensor) -> Tensor | None:
    """The packed copy of ``weight`` that ``linear`` multiplies x by (None: it takes another product)."""
    if (x.dtype == torch.float32 and weight.dtype == torch.float32 and not torch.compiler.is_compiling()
            and x.device.type == "cpu" and weight.device.type == "cpu"
            and (x.numel() > x.shape[-1] or one_row_packed())
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and onednn_packing()):
        return _PACKS.get(weight)           # None: a weight too small to pay or over budget
    return None


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    packed = packed_weight(x, weight)
    if packed is not None:
        return packed_float32_linear(x, packed, bias, weight.shape[0])
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
