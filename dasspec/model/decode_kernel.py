"""One-row attention for every decoding sequence of a call at once, on CPU: a small C++ kernel built on first use.

A decode step of the batched engine has one query row per sequence.  Attending per sequence costs a kernel call
each (torch's SDPA: 256 calls a step for 8 sequences of a 32-deep model); padding the sequences into one SDPA call
would change the order of its sums with the batch's longest sequence, so a row's value would depend on what else is
in the call.  This kernel reads each sequence's keys and values in place through its pool rows (no gather) and
computes every (sequence, head) alone, in an order fixed by that sequence's own length: a row's value never
depends on the batch, the thread count or where its blocks lie - and a sequence decoding alone takes the same
kernel, so it gets the same bits.

    out = decode_attention(q [S, H, hd], k, v [H_kv, pool rows, hd], rows [N] int64, offsets [S + 1] int64, scale)

Sequence s attends to pool rows ``rows[offsets[s]:offsets[s + 1]]`` in that order.  Float32 arithmetic for every
input dtype.  ``available()`` is False where the kernel cannot be built (no compiler or ninja) or
``DASSPEC_DECODE_KERNEL=0``; callers then attend per sequence, and the choice holds for the whole process.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import threading
import warnings

import torch
from torch import Tensor

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

// Built with -ffp-contract=off: a vectorised loop and its scalar remainder then round alike, so each value depends
// only on its own inputs, never on where a buffer lies or how a loop was split.
namespace {
constexpr int LANES = 16;   // partial sums of a dot product, added up in a fixed tree

inline float dot(const float* q, const float* k, int64_t D) {
  float part[LANES] = {0};
  int64_t d = 0;
  for (; d + LANES <= D; d += LANES)
    for (int l = 0; l < LANES; ++l) part[l] += q[d + l] * k[d + l];
  for (int l = 0; d < D; ++d, ++l) part[l] += q[d] * k[d];
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) part[l] += part[l + w];
  return part[0];
}

// exp(x) for x <= 0 (Cephes' single-precision polynomial, about 2 ulp), in plain arithmetic so a loop of it
// vectorises; underflows to 0 below -87.
inline float exp_nonpositive(float x) {
  const bool tiny = x < -87.0f;
  x = tiny ? -87.0f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return tiny ? 0.0f : p * scale;
}

template <typename T>
void one_head(const T* q, const T* k, const T* v, const int64_t* rows, int64_t L, int64_t D, int64_t k_row,
              int64_t v_row, float scale, float* sc, float* buf, T* out) {
  float* qf = buf;          // [D]
  float* acc = buf + D;     // [D]
  float* kf = buf + 2 * D;  // [D]
  for (int64_t d = 0; d < D; ++d) qf[d] = static_cast<float>(q[d]) * scale;
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < L; ++j) {
    const T* kr = k + rows[j] * k_row;
    float s;
    if constexpr (std::is_same_v<T, float>) {
      s = dot(qf, kr, D);
    } else {
      for (int64_t d = 0; d < D; ++d) kf[d] = static_cast<float>(kr[d]);
      s = dot(qf, kf, D);
    }
    sc[j] = s;
    m = s > m ? s : m;
  }
  for (int64_t j = 0; j < L; ++j) sc[j] = exp_nonpositive(sc[j] - m);
  float total = 0.f;
  for (int64_t j = 0; j < L; ++j) total += sc[j];
  for (int64_t d = 0; d < D; ++d) acc[d] = 0.f;
  for (int64_t j = 0; j < L; ++j) {
    const T* vr = v + rows[j] * v_row;
    const float p = sc[j];
    for (int64_t d = 0; d < D; ++d) acc[d] += p * static_cast<float>(vr[d]);
  }
  const float inv = 1.0f / total;
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<T>(acc[d] * inv);
}
}  // namespace

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor rows,
                               torch::Tensor offsets, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q [S, H, hd], k / v [H_kv, rows, hd]");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k and v: contiguous rows");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "one dtype");
  TORCH_CHECK(rows.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong, "int64 rows and offsets");
  q = q.contiguous(); rows = rows.contiguous(); offsets = offsets.contiguous();
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(0);
  TORCH_CHECK(H % Hkv == 0 && k.size(2) == D && v.size(2) == D && v.size(0) == Hkv && offsets.numel() == S + 1,
              "shapes do not match");
  auto out = torch::empty_like(q);
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* rw = rows.data_ptr<int64_t>();
  int64_t L_max = 1;
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(off[s + 1] > off[s], "every sequence needs a row");
    L_max = std::max(L_max, off[s + 1] - off[s]);
  }
  TORCH_CHECK(off[0] == 0 && off[S] == rows.numel(), "offsets do not cover rows");
  const int64_t P = std::min(k.size(1), v.size(1));
  for (int64_t j = 0; j < rows.numel(); ++j) TORCH_CHECK(rw[j] >= 0 && rw[j] < P, "row ", rw[j], " outside the cache");
  const int64_t g = H / Hkv;
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, S * H, 1, [&](int64_t a, int64_t b) {
      std::vector<float> sc(L_max), buf(3 * D);
      for (int64_t i = a; i < b; ++i) {
        const int64_t s = i / H, kvh = (i % H) / g;
        one_head<scalar_t>(qp + i * D, kp + kvh * ks0, vp + kvh * vs0, rw + off[s], off[s + 1] - off[s], D, ks1,
                           vs1, static_cast<float>(scale), sc.data(), buf.data(), op + i * D);
      }
    });
  });
  return out;
}
"""

_FUNCTIONS = ["decode_attention"]
# -fopenmp: ATen's parallel_for is a header template, threaded only when the extension is built with OpenMP
_CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]
_lock = threading.Lock()
_module = None
_tried = False


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _say_when_building(name: str) -> None:
    try:
        from torch.utils.cpp_extension import _get_build_directory
        built = any(f.endswith(".so") for f in os.listdir(_get_build_directory(name, verbose=False)))
    except Exception:
        return
    if not built:
        print("dasspec: compiling the CPU decode-attention kernel (once per machine and torch version)",
              file=sys.stderr, flush=True)


def _load():
    """Build (once per machine and source; torch caches it) and import the kernel; None where that fails."""
    global _module, _tried
    with _lock:
        if _tried:
            return _module
        _tried = True
        if os.environ.get("DASSPEC_DECODE_KERNEL", "1") == "0":
            return None
        tag = hashlib.sha256(repr((_SOURCE, _CFLAGS, _cpu_id(), torch.__version__)).encode()).hexdigest()[:12]
        name = f"dasspec_decode_{tag}"
        _say_when_building(name)
        try:
            from torch.utils.cpp_extension import load_inline
            # -march=native: the build is keyed by this CPU's flags (tag), so it never runs on another kind of CPU
            _module = load_inline(name, cpp_sources=_SOURCE, functions=_FUNCTIONS,
                                  extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as e:                                        # no compiler, no ninja, a read-only cache
            warnings.warn(f"dasspec: the CPU decode-attention kernel could not be built ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); one-row attention runs per sequence",
                          stacklevel=3)
            _module = None
        return _module


def available() -> bool:
    return (_module if _tried else _load()) is not None      # no lock once decided: asked per segment and layer


def decode_attention(q: Tensor, k: Tensor, v: Tensor, rows: Tensor, offsets: Tensor, scale: float) -> Tensor:
    return (_module if _tried else _load()).decode_attention(q, k, v, rows, offsets, scale)
