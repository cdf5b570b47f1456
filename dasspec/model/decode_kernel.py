"""dasspec's CPU kernels (``dasspec/csrc``): one arithmetic for every row, whatever shares its call.

A row's value on a CPU in float32 (and bfloat16: widened exactly, summed in float32, rounded once) is computed here in an order fixed by that row's own inputs and length alone:

* ``linear``: every output is a 16-lane FMA chain along k followed by a fixed tree of additions - the same for a
  row alone or among 1,000, at any thread count (threads split rows and outputs, never a sum), and the same on
  AVX-512, AVX2 and the portable path (``isa``; ``DASSPEC_CPU_ISA`` forces one).  The weight is read in place
  ([out, in], rows contiguous): no packed copy, no size threshold, no budget.
* ``rows_attention``: query s [H, hd] attends rows ``rows[starts[s]: starts[s] + lengths[s]]`` of k, v
  [H_kv, pool rows, hd] in that order (the first ``prefix_lengths[s]`` from ``k_prefix`` / ``v_prefix``: a
  prefix read at another depth).  A decode row, a prompt row, a verification chain, a tree node, a draft window:
  each is a list of rows, so each takes this kernel, and a row sees the same sums whatever shape its call has.
* ``rms_norm``, ``rope_half``, ``store_rows``; the one-call sublayers ``attention_rows``, ``mlp_rows`` and
  ``loop_mix_rows``, layers ``peri_layer_rows`` and ``pre_layer_rows``, and core steps ``recur_rows`` and
  ``loop_recur_rows`` (the modules' ops in the modules' order, without a Python call per op).

The source lives in ``dasspec/csrc`` and is compiled for the portable target, with the AVX2 and AVX-512 bodies
behind the CPU's feature flags at run time, so one build serves every x86 CPU (and other CPUs on the portable path).
It is built once per source, flags and torch version - on first use, with a line on stderr, or ahead of time by
``dasspec kernels build`` (containers, Ray nodes) - into ``$DASSPEC_KERNEL_DIR`` (default
``~/.cache/dasspec/kernels``).  ``available()`` is False where it cannot be built (no compiler) or with
``DASSPEC_DECODE_KERNEL=0``; then a warning says once that torch's kernels run instead and a row's last bits may
depend on its batch and the thread count (``guarantee()``), and everything keeps working.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import threading
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import Tensor

try:
    import fcntl
except ImportError:          # optional: Windows has no flock (a killed build's lock is then removed by hand)
    fcntl = None

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = ("cpu_kernels.cpp", "bindings.cpp")
HEADERS = ("cpu_kernels.h", "isa_body.h")
# -ffp-contract=off: no FMA the source does not write (the paths agree); -fopenmp: ATen's parallel_for is a header
# template, threaded only when the extension is built with OpenMP.  No -march: the ISA bodies carry their targets.
CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-Wno-psabi"]
_lock = threading.Lock()
_module = None
_tried = False
_error: str | None = None

GUARANTEE_KERNELS = ("every float32 and bfloat16 CPU row is computed in an order fixed by its own length: the same "
                     "bits in any batch, at any thread count, for any verifier shape, on AVX-512, AVX2 and portable "
                     "CPUs - each request's tokens are its own batch-1 AR decode's")
GUARANTEE_STATIC = ("static shapes or torch.compile run torch's kernels, not dasspec's: a row's last bits may depend "
                    "on its batch, the thread count and the CPU; greedy outputs still equal AR's except at near-ties")
GUARANTEE_TORCH = ("the CPU kernels are not built: torch's kernels run, and a row's last bits may depend on its batch, "
                   "the thread count and the CPU; greedy outputs still equal AR's except at near-ties")


def build_tag() -> str:
    """What names a build: the sources, flags, torch and Python versions, and where torch is installed (a build's
    commands name torch's headers: environments sharing one folder would rebuild it in turn)."""
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update((CSRC / name).read_bytes())
    h.update(repr((CFLAGS, torch.__version__, sys.version_info[:2], os.path.dirname(torch.__file__))).encode())
    return h.hexdigest()[:12]


def build_dir() -> Path:
    """Where builds are kept: ``$DASSPEC_KERNEL_DIR``, else ``~/.cache/dasspec/kernels`` (a temporary folder of
    this user's when that cannot be written)."""
    env = os.environ.get("DASSPEC_KERNEL_DIR")
    if env:
        return Path(env)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dasspec" / "kernels"
    try:
        base.mkdir(parents=True, exist_ok=True)
        if os.access(base, os.W_OK):
            return base
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"dasspec-kernels-{os.getuid() if hasattr(os, 'getuid') else 0}"


def _build(verbose: bool = False):
    from torch.utils.cpp_extension import load  # optional: the compiler toolchain, only when a build is asked for
    tag = build_tag()
    name = f"dasspec_cpu_{tag}"
    folder = build_dir() / tag
    folder.mkdir(parents=True, exist_ok=True)
    if not any(f.suffix == ".so" for f in folder.iterdir()):
        print("dasspec: compiling the CPU kernels (once per machine, source and torch version; "
              "`dasspec kernels build` does it ahead of time)", file=sys.stderr, flush=True)
    with open(folder / ".building", "w") if fcntl else nullcontext() as held:
        # torch's own lock is a file (``lock``) that a killed build leaves behind, and every later load then waits
        # on it for good; whoever builds here holds this flock, which the system drops with its process, so a
        # ``lock`` found while holding it is such a leftover
        if fcntl:
            fcntl.flock(held, fcntl.LOCK_EX)
            (folder / "lock").unlink(missing_ok=True)
        src = _sources_in(folder / "src")
        return load(name, [str(src / s) for s in SOURCES], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                    extra_include_paths=[str(src)], build_directory=str(folder), verbose=verbose)


def _sources_in(dst: Path) -> Path:
    """The sources copied beside their build (the tag names their contents), so that every checkout or install of
    the same sources compiles the same paths: torch rebuilds an extension whose source paths changed, and two
    checkouts on one machine would otherwise rebuild it in turn."""
    dst.mkdir(exist_ok=True)
    for name in SOURCES + HEADERS:
        data = (CSRC / name).read_bytes()
        target = dst / name
        if not target.is_file() or target.read_bytes() != data:
            tmp = target.with_name(f".{name}.{os.getpid()}")
            tmp.write_bytes(data)
            os.replace(tmp, target)                  # atomic: a process building beside this one reads whole files
    return dst


def _load():
    """Build (once; cached on disk) and import the kernels; None where that fails, with one warning."""
    global _module, _tried, _error
    with _lock:                  # _tried is set last: a thread asking during the build waits here for its outcome
        if _tried:
            return _module
        if os.environ.get("DASSPEC_DECODE_KERNEL", "1") == "0":
            _error = "DASSPEC_DECODE_KERNEL=0"
        else:
            try:
                _module = _build()
            except Exception as e:                                  # no compiler, no ninja, a read-only cache
                _error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if _module is None:
            warnings.warn(f"dasspec: the CPU kernels could not be built ({_error}); {GUARANTEE_TORCH}",
                          stacklevel=3)
        _tried = True
        return _module


def available() -> bool:
    return (_module if _tried else _load()) is not None      # no lock once decided: asked per segment and layer


def build(verbose: bool = True) -> str:
    """Build the kernels now (``dasspec kernels build``) and return the ISA they run on; raises where that fails."""
    global _module, _tried, _error
    with _lock:
        if _module is None:
            _module, _error = _build(verbose), None
            _tried = True
    return _module.isa()


def error() -> str | None:
    """Why the kernels are not available (None: they are, or were not asked for yet)."""
    return _error


def guarantee() -> str:
    """What this process promises about a float32 CPU row's bits (the README's, ``/health``'s words)."""
    return GUARANTEE_KERNELS if available() else GUARANTEE_TORCH


GUARANTEE_OTHER = ("{dtype} on {device}: rows are computed by torch's kernels, whose sums may follow the batch and the "
                   "call's shape, so a token can differ from the request's own batch-1 AR decode at a near-tie; "
                   "float32 and bfloat16 on a CPU are exact")


def exactness(device: "torch.device | str", dtype: torch.dtype, static_shapes: bool = False) -> str:
    """What a model on ``device`` in ``dtype`` promises about each request's tokens against its own AR decode (the
    server's ``/health``, ``dasspec kernels info``); ``static_shapes``: the runtime's (``torch.compile`` sets it),
    whose fixed-shape attention and compiled products leave the kernels."""
    device = torch.device(device)
    if thread_invariant(device, dtype, static_shapes):
        return GUARANTEE_KERNELS
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        return GUARANTEE_STATIC if static_shapes and available() else GUARANTEE_TORCH
    return GUARANTEE_OTHER.format(dtype=str(dtype).removeprefix("torch."), device=device.type)


def thread_invariant(device: "torch.device | str", dtype: torch.dtype, static_shapes: bool = False) -> bool:
    """Whether a row's bits on ``device`` in ``dtype`` are the same at every torch thread count: eager CPU rows in
    float32 or bfloat16 through these kernels (threads split rows and outputs, never a sum)."""
    return (torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16) and not static_shapes
            and available())


def isa() -> str | None:
    """The instruction set the kernels run on ("avx512", "avx2", "portable"), or None without kernels."""
    return _module.isa() if available() else None


def isas_here() -> list[str]:
    """The kernel paths this CPU can run (every one gives the same bits)."""
    return list(_module.isas_here()) if available() else []


def set_isa(name: str) -> None:
    """Switch the kernels to another of ``isas_here()`` for the whole process (tests compare the paths)."""
    _module.set_isa(name)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [M, K] times weight [N, K] (+ bias [N]), float32 -> [M, N]."""
    return (_module if _tried else _load()).linear(x, weight, bias)


def rows_attention(q: Tensor, k: Tensor, v: Tensor, rows: Tensor, starts: Tensor, lengths: Tensor, scale: float,
                   k_prefix: Tensor | None = None, v_prefix: Tensor | None = None,
                   prefix_lengths: Tensor | None = None) -> Tensor:
    """Query s [H, hd] of q [S, H, hd] attends rows ``rows[starts[s]: starts[s] + lengths[s]]`` of k, v (the first
    ``prefix_lengths[s]`` of them of ``k_prefix`` / ``v_prefix`` where given)."""
    return (_module if _tried else _load()).rows_attention(q, k, v, rows, starts, lengths, scale, k_prefix, v_prefix,
                                                           prefix_lengths)


def store_rows(k_dst: Tensor, v_dst: Tensor, rows: Tensor, k: Tensor, v: Tensor) -> None:
    """``k_dst[:, rows] = k`` and ``v_dst[:, rows] = v`` ([H_kv, pool rows, hd] <- [H_kv, N, hd])."""
    (_module if _tried else _load()).store_rows(k_dst, v_dst, rows, k, v)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of float32 rows, each row's sum in a fixed order (the same bits whatever the row count)."""
    return (_module if _tried else _load()).rms_norm(x, weight, eps)


def argmax(x: Tensor) -> Tensor:
    """``x.argmax(-1)``, the same indices (the first largest value; the first NaN where a row has one), through the
    kernel for CPU float32 rows (logits: torch's reduction over (value, index) pairs is the slow part of a greedy
    step's choice), else torch's."""
    if (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() >= 1 and x.numel() > 0
            and not torch.compiler.is_compiling() and available()):
        return _module.argmax_rows(x)
    return x.argmax(-1)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up elementwise (float32 or bfloat16; torch's roundings), each value's bits its own: torch's
    elementwise kernels compute a call's tail - which values fall in it depends on the call's size and thread count -
    on another path than its vectors."""
    return (_module if _tried else _load()).pointwise(gate, up)


def sigmoid(x: Tensor) -> Tensor:
    """sigmoid(x) elementwise (float32 or bfloat16), each value's bits its own (``silu_mul``)."""
    return (_module if _tried else _load()).pointwise(x, None)


def rope_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE in HF's rotate_half form over x [B, W, n, hd] (float32) with cos / sin [W, hd]: torch's bits."""
    return (_module if _tried else _load()).rope_half(x, cos, sin)


def rope_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Huginn's interleaved RoPE over x [B, W, n, hd] (float32) with cos / sin [W, hd / 2]: pairs (2j, 2j + 1)
    rotated as complex numbers, torch's complex product's bits."""
    return (_module if _tried else _load()).rope_pairs(x, cos, sin)


def attention_rows(x: Tensor, wqkv: Tensor, wproj: Tensor, qk_bias: Tensor | None, cos: Tensor, sin: Tensor,
                   k_pool: Tensor, v_pool: Tensor, store_at: Tensor, rows: Tensor, starts: Tensor, lengths: Tensor,
                   scale: float, n_heads: int, n_kv_heads: int, k_prefix: Tensor | None = None,
                   v_prefix: Tensor | None = None, prefix_lengths: Tensor | None = None) -> Tensor:
    """The attention sublayer over rows x [M, d] in one call: QKV product, q/k bias, RoPE (halves or pairs, by the
    operands' width), K/V stores at pool rows ``store_at``, ``rows_attention`` (each query's first
    ``prefix_lengths`` rows from the prefix pools where given), output product."""
    return (_module if _tried else _load()).attention_rows(x, wqkv, wproj, qk_bias, cos, sin, k_pool, v_pool,
                                                           store_at, rows, starts, lengths, scale, n_heads,
                                                           n_kv_heads, k_prefix, v_prefix, prefix_lengths)


def loop_mix_rows(x: Tensor, *args) -> Tensor:
    """IQuest-Loop's attention at depths >= 2 over rows x [M, d] in one call (``LoopCoderBlock.mixed_rows``):
    ``attention_rows``' arguments after x (the depth's own pools, its windowed row lists), then depth 1's K and V
    pools and row lists (rows, starts, lengths), the block-diagonal gate weight [H, H * hd] and its bias [H]."""
    return (_module if _tried else _load()).loop_mix_rows(x, *args)


def mlp_rows(x: Tensor, wfc: Tensor, wproj: Tensor) -> Tensor:
    """The gated MLP over rows x [M, d] in one call: fc product, silu(gate) * up, proj product."""
    return (_module if _tried else _load()).mlp_rows(x, wfc, wproj)


def _layer_tail(attention_args: tuple, mlp_args: tuple) -> tuple:
    """A one-call layer's arguments after its norms: ``attention_rows``' up to the heads, ``mlp_rows``', then the
    prefix pools and counts of a two-source read (``Attention.row_args``; None for a one-source one)."""
    return (*attention_args[:14], *mlp_args, *(attention_args[14:] or (None, None, None)))


def peri_layer_rows(x: Tensor, norms: list[Tensor], eps: float, attention_args: tuple, mlp_args: tuple) -> Tensor:
    """Ouro's layer of a call's rows in one call (``PeriNormBlock.rows``): ``attention_args`` / ``mlp_args`` as
    ``attention_rows`` / ``mlp_rows`` take them after x."""
    return (_module if _tried else _load()).peri_layer_rows(x, norms, eps, *_layer_tail(attention_args, mlp_args))


def sandwich_layer_rows(x: Tensor, norms: list[Tensor], eps: float, attention_args: tuple, mlp_args: tuple) -> Tensor:
    """Huginn's sandwich layer of a call's rows in one call (``NormedBlock.rows``), with ``peri_layer_rows``'
    arguments (four norms, the RoPE operands as pairs)."""
    return (_module if _tried else _load()).sandwich_layer_rows(x, norms, eps, *_layer_tail(attention_args, mlp_args))


def pre_layer_rows(x: Tensor, norms: list[Tensor], eps: float, attention_args: tuple, mlp_args: tuple) -> Tensor:
    """Llama's pre-norm layer (Nanbeige's, Raven-Llama's, IQuest-Loop's at depth 1) of a call's rows in one call
    (``NormedBlock.rows``), with ``peri_layer_rows``' arguments (two norms)."""
    return (_module if _tried else _load()).pre_layer_rows(x, norms, eps, *_layer_tail(attention_args, mlp_args))


# attention_rows' arguments: wqkv, wproj, qk_bias, cos, sin, k_pool, v_pool, store_at, rows, starts, lengths, scale,
# H, Hkv (and with two sources k_prefix, v_prefix, prefix_lengths); mlp_rows': wfc, wdown.  Of these recur_rows takes
# per layer the weights and the bias (and the pools per layer and step); the rest once, from the first layer.
_PER_LAYER = (0, 1, 2, 5, 6, 14, 15)


def same(x: object, y: object) -> bool:
    """One argument the one-call paths take once for many layers: the same tensor object, or an equal plain value."""
    return x is y or (not isinstance(x, Tensor) and not isinstance(y, Tensor) and x == y)


def layers_agree(layers: list[tuple]) -> bool:
    """Whether every layer's one-call layer arguments that ``recur_rows`` takes once (RoPE tables, the call's rows,
    scale, heads) are the first layer's (the same for every layer of one config; asked, since a module may be
    changed)."""
    a0 = layers[0][2]
    return all(all(j in _PER_LAYER or same(x, y) for j, (x, y) in enumerate(zip(a, a0)))
               for _, _, a, m in layers[1:])


def recur_rows(x: Tensor, steps: int, style: str, layers: list[tuple], pools: list[tuple[Tensor, Tensor]],
               ln_weight: Tensor | None = None, ln_eps: float = 0.0, inj: Tensor | None = None,
               adapter: Tensor | None = None, prefix_pools: list[tuple[Tensor, Tensor]] | None = None) -> Tensor:
    """``steps`` core steps of a family's layers over a call's rows x [M, d] in one call (``recurrence.py``): each
    step, where ``inj`` is given (the prelude's output, Huginn's), the adapter's weight over concat[x, inj]; then the
    layers; then ln_f where ``ln_weight`` is given (Ouro, Nanbeige).  ``style``: "peri" (Ouro's layers), "pre"
    (Llama's: Nanbeige's) or "sandwich" (Huginn's); ``layers``: each layer's one-call arguments after x, as the
    block's ``layer_args`` gives them (``layers_agree``); ``pools``: the (K, V) pool of every layer of every step,
    step after step, in place of the layers' own.  ``prefix_pools``: a draft's steps that read the verified prefix at
    other depths - the prefix's (K, V) pools likewise, with the prefix counts of the first layer's arguments."""
    norms = [w for n, *_ in layers for w in n]
    a0 = layers[0][2]
    kp, vp = ([k for k, _ in prefix_pools], [v for _, v in prefix_pools]) if prefix_pools else ([], [])
    return (_module if _tried else _load()).recur_rows(
        x, steps, style, norms, [l[1] for l in layers], [l[2][0] for l in layers], [l[2][1] for l in layers],
        [l[2][2] for l in layers], a0[3], a0[4], [k for k, _ in pools], [v for _, v in pools], *a0[7:14],
        [l[3][0] for l in layers], [l[3][1] for l in layers], ln_weight, ln_eps, inj, adapter, kp, vp,
        a0[16] if prefix_pools else None)


def loop_recur_rows(x: Tensor, first: int, layers: list[tuple], steps: list[tuple], glob: tuple) -> Tensor:
    """IQuest-Loop's loops ``first``, ``first + 1``, ... over a call's rows x [M, d] in one call
    (``IQuestLoop.recur_rows``).  ``layers``: per layer (norm weights, eps, wqkv, wproj, qk_bias, wfc, wdown, depth 1's K
    and V pools, the block-diagonal gate weight, the gate bias); ``steps``: per loop (store rows, rows, starts,
    lengths, the layers' (K, V) pools); ``glob``: depth 1's row lists (rows, starts, lengths), then cos, sin, scale,
    H, H_kv."""
    rows, starts, lengths, cos, sin, scale, H, Hkv = glob
    return (_module if _tried else _load()).loop_recur_rows(
        x, first, [w for l in layers for w in l[0]], [l[1] for l in layers], [l[2] for l in layers],
        [l[3] for l in layers], [l[4] for l in layers], cos, sin, [k for s in steps for k, _ in s[4]],
        [v for s in steps for _, v in s[4]], [s[0] for s in steps], [s[1] for s in steps], [s[2] for s in steps],
        [s[3] for s in steps], scale, H, Hkv, [l[5] for l in layers], [l[6] for l in layers], [l[7] for l in layers],
        [l[8] for l in layers], rows, starts, lengths, [l[9] for l in layers], [l[10] for l in layers])
