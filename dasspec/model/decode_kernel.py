"""Causal-row attention, K/V stores, RMSNorm and RoPE on a CPU: a small C++ extension built on first use.

A decode step of the batched engine has one query row per sequence, and a prefill one per prompt row.  Attending
per sequence (or per prompt block) costs a kernel call each (torch's SDPA: 256 calls a step for 8 sequences of a
32-deep model); padding the sequences into one SDPA call would change the order of its sums with the batch's
longest sequence, so a row's value would depend on what else is in the call.  ``rows_attention`` reads each
query's keys and values in place through its pool rows (no gather) and computes every (query row, head) alone, in
an order fixed by its own row list: a row's value never depends on the batch, the other rows of its block, the
thread count or where its blocks lie - and a sequence decoding alone takes the same kernel, so it gets the same
bits.

    out = rows_attention(q [S, H, hd], k, v [H_kv, pool rows, hd], rows [N], starts [S], lengths [S], scale)

Query s attends to pool rows ``rows[starts[s]: starts[s] + lengths[s]]`` in that order.  Float32 arithmetic for
every input dtype.
Beside it, each one call instead of several torch ops: ``store_rows`` (K/V rows into the pool: a copy),
``rms_norm`` (float32 rows, each row's sum in a fixed order) and ``rope_half`` (torch's roundings in torch's order);
and two whole sublayers whose products are oneDNN's packed ones, ``attention_rows`` and ``mlp_rows`` (the modules'
ops on the same views in the same order: their bits, without a Python call per op), and Ouro's whole layer of
both with its four norms and residual adds, ``peri_layer_rows``.
The kernels release the GIL.  ``available()`` is False where the extension cannot be built (no compiler or ninja)
or ``DASSPEC_DECODE_KERNEL=0``; callers then use torch's ops, and the choice holds for the whole process (threads
asking while it is built wait for it).  The build (about 30 s, cached per machine, source, flags and torch
version) happens on the first CPU float32 forward without gradients - a decode, an evaluation, ``model(ids)``.
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
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <unordered_map>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// Built with -ffp-contract=off: a vectorised loop and its scalar remainder then round alike, so each value depends
// only on its own inputs, never on where a buffer lies or how a loop was split.
namespace {
constexpr int LANES = 16;   // partial sums of a dot product, added up in a fixed tree

typedef float f16v __attribute__((vector_size(16 * sizeof(float))));   // GCC / Clang vectors, lowered per target
typedef float f8v __attribute__((vector_size(8 * sizeof(float))));
typedef float f4v __attribute__((vector_size(4 * sizeof(float))));
typedef float f2v __attribute__((vector_size(2 * sizeof(float))));

// Lanes l and l + n/2 added: one level of the fixed tree, in registers where the compiler has vector shuffles.
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
inline f8v halves_sum(const f16v& x) {
  return __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
}
inline f4v halves_sum(const f8v& x) {
  return __builtin_shufflevector(x, x, 0, 1, 2, 3) + __builtin_shufflevector(x, x, 4, 5, 6, 7);
}
inline f2v halves_sum(const f4v& x) { return __builtin_shufflevector(x, x, 0, 1) + __builtin_shufflevector(x, x, 2, 3); }
#else
template <typename Whole>
inline auto halves_sum(const Whole& x) {
  typedef float Half __attribute__((vector_size(sizeof(Whole) / 2)));
  Half lo, hi;
  std::memcpy(&lo, &x, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&x) + sizeof lo, sizeof hi);
  return lo + hi;
}
#endif

inline float dot(const float* q, const float* k, int64_t D) {
  f16v part = {0};
  int64_t d = 0;
  for (; d + LANES <= D; d += LANES) {
    f16v a, b;
    std::memcpy(&a, q + d, sizeof a);
    std::memcpy(&b, k + d, sizeof b);
    part += a * b;
  }
  if (d < D) {
    float rest[LANES];
    std::memcpy(rest, &part, sizeof rest);
    for (int l = 0; d < D; ++d, ++l) rest[l] += q[d] * k[d];
    std::memcpy(&part, rest, sizeof rest);
  }
  const f2v two = halves_sum(halves_sum(halves_sum(part)));
  return two[0] + two[1];
}

// exp(x) for x <= 0 of 16 values at once (Cephes' single-precision polynomial, about 2 ulp), in plain vector
// arithmetic, the same operations lane by lane; underflows to 0 below -87.  floor as truncation corrected by one
// below zero (exact here: |y| < 2^23).
typedef int32_t i16v __attribute__((vector_size(16 * sizeof(int32_t))));

inline f16v exp_nonpositive16(f16v x) {
  const i16v tiny = x < -87.0f;
  x = tiny ? f16v{} - 87.0f : x;
  const f16v y = x * 1.44269504088896341f + 0.5f;
  const i16v yi = __builtin_convertvector(y, i16v);
  f16v n = __builtin_convertvector(yi, f16v);
  n = n > y ? n - 1.0f : n;
  f16v r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  f16v p = f16v{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const i16v bits = (__builtin_convertvector(n, i16v) + 127) << 23;
  f16v scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return tiny ? f16v{} : p * scale;
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
  for (int64_t j0 = 0; j0 < L; j0 += LANES) {          // the last group padded with m (its lanes dropped)
    const int64_t n = std::min<int64_t>(LANES, L - j0);
    float x[LANES];
    std::fill(x, x + LANES, m);
    std::memcpy(x, sc + j0, n * sizeof(float));
    f16v e;
    std::memcpy(&e, x, sizeof e);
    e = exp_nonpositive16(e - m);
    std::memcpy(sc + j0, &e, n * sizeof(float));
  }
  float total = 0.f;
  for (int64_t j = 0; j < L; ++j) total += sc[j];
  // sum_j p_j v_j, each lane over j in order; a 16-lane slice of the row at a time so its sum stays in a register
  int64_t d0 = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; d0 + LANES <= D; d0 += LANES) {
      f16v a = {0};
      for (int64_t j = 0; j < L; ++j) {
        f16v x;
        std::memcpy(&x, v + rows[j] * v_row + d0, sizeof x);
        a += sc[j] * x;
      }
      std::memcpy(acc + d0, &a, sizeof a);
    }
  }
  if (d0 < D) {                                          // what is left of the row, and other dtypes
    for (int64_t d = d0; d < D; ++d) acc[d] = 0.f;
    for (int64_t j = 0; j < L; ++j) {
      const T* vr = v + rows[j] * v_row;
      const float p = sc[j];
      for (int64_t d = d0; d < D; ++d) acc[d] += p * static_cast<float>(vr[d]);
    }
  }
  const float inv = 1.0f / total;
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<T>(acc[d] * inv);
}
}  // namespace

torch::Tensor rows_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor rows,
                             torch::Tensor starts, torch::Tensor lengths, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q [S, H, hd], k / v [H_kv, rows, hd]");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && rows.device().is_cpu() &&
              starts.device().is_cpu() && lengths.device().is_cpu(), "CPU tensors");
  TORCH_CHECK(k.size(0) > 0, "no key heads");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k and v: contiguous rows");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "one dtype");
  TORCH_CHECK(rows.scalar_type() == at::kLong && starts.scalar_type() == at::kLong &&
              lengths.scalar_type() == at::kLong, "int64 rows, starts and lengths");
  q = q.contiguous(); rows = rows.contiguous(); starts = starts.contiguous(); lengths = lengths.contiguous();
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(0), N = rows.numel();
  TORCH_CHECK(H % Hkv == 0 && k.size(2) == D && v.size(2) == D && v.size(0) == Hkv && starts.numel() == S &&
              lengths.numel() == S, "shapes do not match");
  auto out = torch::empty_like(q);
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* ln = lengths.data_ptr<int64_t>();
  const int64_t* rw = rows.data_ptr<int64_t>();
  int64_t L_max = 1;
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(ln[s] > 0, "query ", s, " needs a row");
    TORCH_CHECK(st[s] >= 0 && st[s] + ln[s] <= N, "query ", s, ": rows outside the row list");
    L_max = std::max(L_max, ln[s]);
  }
  const int64_t P = std::min(k.size(1), v.size(1));
  for (int64_t j = 0; j < N; ++j) TORCH_CHECK(rw[j] >= 0 && rw[j] < P, "row ", rw[j], " outside the cache");
  const int64_t g = H / Hkv;
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rows_attention", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, S * H, 1, [&](int64_t a, int64_t b) {
      std::vector<float> sc(L_max), buf(3 * D);
      for (int64_t i = a; i < b; ++i) {
        const int64_t s = i / H, kvh = (i % H) / g;
        one_head<scalar_t>(qp + i * D, kp + kvh * ks0, vp + kvh * vs0, rw + st[s], ln[s], D, ks1, vs1,
                           static_cast<float>(scale), sc.data(), buf.data(), op + i * D);
      }
    });
  });
  return out;
}

// dst[h, rows[i], :] = src[h, i, :] for the K and V of one layer application: a plain copy per (head, row), so a
// row's bits are the source's (what index_copy_ writes), without index_copy_'s per-element indexing.
void store_rows(torch::Tensor k_dst, torch::Tensor v_dst, torch::Tensor rows, torch::Tensor k, torch::Tensor v) {
  TORCH_CHECK(k_dst.dim() == 3 && v_dst.dim() == 3 && k.dim() == 3 && v.dim() == 3, "[H_kv, rows, hd] tensors");
  TORCH_CHECK(k_dst.stride(2) == 1 && v_dst.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "contiguous rows");
  TORCH_CHECK(k_dst.scalar_type() == k.scalar_type() && v_dst.scalar_type() == v.scalar_type() &&
              k.scalar_type() == v.scalar_type(), "one dtype");
  TORCH_CHECK(rows.scalar_type() == at::kLong, "int64 rows");
  TORCH_CHECK(k_dst.device().is_cpu() && v_dst.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() &&
              rows.device().is_cpu(), "CPU tensors");
  rows = rows.contiguous();
  const int64_t H = k.size(0), N = k.size(1), D = k.size(2);
  TORCH_CHECK(rows.numel() == N && v.size(0) == H && v.size(1) == N && v.size(2) == D && k_dst.size(0) == H &&
              v_dst.size(0) == H && k_dst.size(2) == D && v_dst.size(2) == D, "shapes do not match");
  const int64_t* rw = rows.data_ptr<int64_t>();
  const int64_t P = std::min(k_dst.size(1), v_dst.size(1));
  for (int64_t i = 0; i < N; ++i) TORCH_CHECK(rw[i] >= 0 && rw[i] < P, "row ", rw[i], " outside the cache");
  const int64_t bytes = D * k.element_size();
  char* kd = static_cast<char*>(k_dst.data_ptr());
  char* vd = static_cast<char*>(v_dst.data_ptr());
  const char* ks = static_cast<const char*>(k.data_ptr());
  const char* vs = static_cast<const char*>(v.data_ptr());
  const int64_t e = k.element_size();
  const int64_t kd0 = k_dst.stride(0) * e, kd1 = k_dst.stride(1) * e, vd0 = v_dst.stride(0) * e,
                vd1 = v_dst.stride(1) * e, ks0 = k.stride(0) * e, ks1 = k.stride(1) * e, vs0 = v.stride(0) * e,
                vs1 = v.stride(1) * e;
  at::parallel_for(0, H * N, 256, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      const int64_t h = i / N, j = i % N;
      std::memcpy(kd + h * kd0 + rw[j] * kd1, ks + h * ks0 + j * ks1, bytes);
      std::memcpy(vd + h * vd0 + rw[j] * vd1, vs + h * vs0 + j * vs1, bytes);
    }
  });
}

// RoPE, halves form (HF rotate_half): out = x * cos + cat(-x2, x1) * sin over x [B, W, n, hd] (float32; cos / sin
// [W, hd]), the same three roundings as torch's ops in the same order (so the same bits), in one pass.
torch::Tensor rope_half(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 4 && x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat && x.stride(3) == 1, "x [B, W, n, hd] float32, contiguous rows");
  TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(), "CPU tensors");
  const int64_t B = x.size(0), W = x.size(1), n = x.size(2), D = x.size(3), h = D / 2;
  cos = cos.contiguous(); sin = sin.contiguous();
  TORCH_CHECK(D % 2 == 0 && cos.numel() == W * D && sin.numel() == W * D, "cos / sin [W, hd]");
  auto out = torch::empty({B, W, n, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1), s2 = x.stride(2);
  at::parallel_for(0, B * W * n, 64, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      const int64_t hd_i = i % n, w = (i / n) % W, bb = i / (n * W);
      const float* xr = xp + bb * s0 + w * s1 + hd_i * s2;
      const float* c = cp + w * D;
      const float* s = sp + w * D;
      float* o = op + i * D;
      for (int64_t d = 0; d < h; ++d) o[d] = xr[d] * c[d] + (-xr[d + h]) * s[d];
      for (int64_t d = h; d < D; ++d) o[d] = xr[d] * c[d] + xr[d - h] * s[d];
    }
  });
  return out;
}

// RMSNorm of float32 rows: x * (1 / sqrt(mean(x^2) + eps)) * w, each row's sum of squares in a fixed order.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "float32");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "CPU tensors");
  x = x.contiguous(); w = w.contiguous();
  const int64_t D = x.size(-1);
  TORCH_CHECK(D > 0 && w.numel() == D, "weight size");
  const int64_t M = x.numel() / D;
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, M, 16, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      const float* xr = xp + r * D;
      float* o = op + r * D;
      const float inv = 1.0f / std::sqrt(dot(xr, xr, D) / static_cast<float>(D) + e);
      for (int64_t d = 0; d < D; ++d) o[d] = xr[d] * inv * wp[d];
    }
  });
  return out;
}

namespace {
// Few rows (a decode step's) times a weight: oneDNN's packed product of float32 computes each output element as a
// chain of FMAs over k from zero, in blocks of k whose sums are then added in order (docs/performance.md: its kernels
// for few rows stream the weight slower than this plain walk does).  ``panels`` is a copy of the weight in 16-column panels
// [N / 16, K, 16] read by a kernel of the same arithmetic (the same bits: registered only where a test product
// agrees bit for bit with oneDNN's, with the k-block found there), so a call takes either and a row's value does not
// depend on which.
struct Panels {
  torch::Tensor packed, panels;   // packed: held, so its address is never another tensor's while registered
  int64_t N = 0, kb = 0;
  int threads = 0;                // oneDNN's arithmetic can follow the thread count (it may split k over threads)
  unsigned csr = 0;               // and the flush-to-zero / denormals-are-zero state: both as when registered
};
std::mutex panels_mu;
std::unordered_map<const c10::TensorImpl*, Panels> panels_of;
constexpr int64_t PANEL_MAX_ROWS = 16;

bool find_panels(const torch::Tensor& packed, Panels& out) {
  std::lock_guard<std::mutex> lock(panels_mu);
  auto it = panels_of.find(packed.unsafeGetTensorImpl());
  if (it == panels_of.end()) return false;
  out = it->second;
  return true;
}

#if defined(__AVX512F__)
unsigned float_state() { return _mm_getcsr() & 0x8040u; }

template <int MR>
void panel_tile(const float* xt, int64_t ldx, const float* wp, int64_t K, int64_t kb, float* out, int64_t ldo,
                int64_t nc) {
  __m512 total[MR];
  for (int64_t k0 = 0; k0 < K; k0 += kb) {
    const int64_t k1 = std::min(K, k0 + kb);
    __m512 acc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
      const __m512 w = _mm512_loadu_ps(wp + k * 16);
      const float* xk = xt + k * ldx;
      for (int m = 0; m < MR; ++m) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(xk[m]), w, acc[m]);
    }
    for (int m = 0; m < MR; ++m) total[m] = k0 == 0 ? acc[m] : _mm512_add_ps(total[m], acc[m]);
  }
  const __mmask16 mask = nc >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << nc) - 1);
  for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(out + m * ldo, mask, total[m]);
}

torch::Tensor panel_product(const torch::Tensor& x_in, const Panels& p) {
  const auto x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = p.N, P = p.panels.size(0);
  TORCH_CHECK(K == p.panels.size(1) && M <= PANEL_MAX_ROWS, "panel product: shapes");
  const auto xt = x.t().contiguous();                  // [K, M]: a k's rows side by side
  auto out = torch::empty({M, N}, x.options());
  const float* xp = xt.data_ptr<float>();
  const float* wp = p.panels.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t kb = p.kb;
  at::parallel_for(0, P, 1, [&](int64_t a, int64_t b) {
    for (int64_t j = a; j < b; ++j) {
      const int64_t nc = std::min<int64_t>(16, N - j * 16);
      const float* w = wp + j * K * 16;
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const float* xs = xp + m0;
        float* o = op + m0 * N + j * 16;
        switch (std::min<int64_t>(8, M - m0)) {
          case 8: panel_tile<8>(xs, M, w, K, kb, o, N, nc); break;
          case 7: panel_tile<7>(xs, M, w, K, kb, o, N, nc); break;
          case 6: panel_tile<6>(xs, M, w, K, kb, o, N, nc); break;
          case 5: panel_tile<5>(xs, M, w, K, kb, o, N, nc); break;
          case 4: panel_tile<4>(xs, M, w, K, kb, o, N, nc); break;
          case 3: panel_tile<3>(xs, M, w, K, kb, o, N, nc); break;
          case 2: panel_tile<2>(xs, M, w, K, kb, o, N, nc); break;
          default: panel_tile<1>(xs, M, w, K, kb, o, N, nc); break;
        }
      }
    }
  });
  return out;
}
#endif

// x [M, K] times a weight packed by oneDNN (linear.py's packed_float32_linear: the same op, arguments and padding;
// `padded` rows, zeros past M), or its panels where it has them and x has few rows.
torch::Tensor packed_product(const torch::Tensor& x, const torch::Tensor& packed, int64_t padded) {
  const int64_t M = x.size(0);
#if defined(__AVX512F__)
  if (M <= PANEL_MAX_ROWS && x.scalar_type() == at::kFloat) {
    Panels p;
    if (find_panels(packed, p) && p.threads == at::get_num_threads() && p.csr == float_state())
      return panel_product(x, p);
  }
#endif
  static auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                        c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  if (padded == M) return op.call(x.contiguous(), packed, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(),
                   c10::string_view(""));
  auto xp = torch::cat({x, x.new_zeros({padded - M, x.size(1)})});
  return op.call(xp, packed, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(), c10::string_view(""))
      .narrow(0, 0, M);
}
}  // namespace

// The attention sublayer of a call's rows in one call (layers.py's Attention.forward on rows the row kernel takes,
// halves-form RoPE, no q/k norm): the same ops on the same views in the same order, so the same bits, without a
// Python call per op.  x [M, d] -> [M, d].
torch::Tensor attention_rows(torch::Tensor x, torch::Tensor wqkv, torch::Tensor wproj, int64_t padded,
                             std::optional<torch::Tensor> qk_bias, torch::Tensor cos, torch::Tensor sin,
                             torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor store_at, torch::Tensor rows,
                             torch::Tensor starts, torch::Tensor lengths, double scale, int64_t H, int64_t Hkv) {
  // every check before the first write into the pool
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), "x [M, d]: float32, CPU");
  TORCH_CHECK(H > 0 && Hkv > 0 && H % Hkv == 0, "heads: H a multiple of H_kv");
  const int64_t M = x.size(0);
  TORCH_CHECK(padded >= M && (padded == M || M > 1), "padded row count below the rows");
  auto qkv = packed_product(x, wqkv, padded);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(0) == M && qkv.size(1) % (H + 2 * Hkv) == 0, "projection width");
  const int64_t hd = qkv.size(1) / (H + 2 * Hkv);
  TORCH_CHECK(!qk_bias.has_value() || (Hkv == H && qk_bias->numel() == 2 * H * hd), "q/k bias [2, H, hd]");
  TORCH_CHECK(k_pool.dim() == 3 && v_pool.dim() == 3 && k_pool.size(0) == Hkv && k_pool.size(2) == hd &&
              v_pool.size(0) == Hkv && v_pool.size(2) == hd && store_at.numel() == M && starts.numel() == M &&
              lengths.numel() == M, "pools [H_kv, rows, hd], one store row, start and length per row");
  auto heads = qkv.view({1, M, H + 2 * Hkv, hd});
  auto qk = heads.narrow(2, 0, H + Hkv);
  if (qk_bias.has_value()) qk = qk + qk_bias->view({2 * H, hd});
  qk = rope_half(qk, cos, sin);
  store_rows(k_pool, v_pool, store_at, qk[0].narrow(1, H, Hkv).transpose(0, 1),
             heads[0].narrow(1, H + Hkv, Hkv).transpose(0, 1));
  auto y = rows_attention(qk[0].narrow(1, 0, H), k_pool, v_pool, rows, starts, lengths, scale);
  return packed_product(y.view({M, H * hd}), wproj, padded);
}

// The gated MLP of a call's rows in one call (layers.py's GatedMLP.forward: fc, silu(gate) * up, proj).
torch::Tensor mlp_rows(torch::Tensor x, torch::Tensor wfc, torch::Tensor wproj, int64_t padded) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), "x [M, d]: float32, CPU");
  TORCH_CHECK(padded >= x.size(0) && (padded == x.size(0) || x.size(0) > 1), "padded row count below the rows");
  auto gate_up = packed_product(x, wfc, padded).chunk(2, -1);
  return packed_product(at::silu(gate_up[0]) * gate_up[1], wproj, padded);
}

// Ouro's layer (families/ouro.py PeriNormBlock: x + n2(attn(n1 x)), then that + n4(mlp(n3 of it))) of a call's rows
// in one call: rms_norm and the two sublayers above, the same ops in the same order, so the same bits.
torch::Tensor peri_layer_rows(torch::Tensor x, std::vector<torch::Tensor> norms, double eps, torch::Tensor wqkv,
                              torch::Tensor wproj, int64_t padded, std::optional<torch::Tensor> qk_bias,
                              torch::Tensor cos, torch::Tensor sin, torch::Tensor k_pool, torch::Tensor v_pool,
                              torch::Tensor store_at, torch::Tensor rows, torch::Tensor starts, torch::Tensor lengths,
                              double scale, int64_t H, int64_t Hkv, torch::Tensor wfc, torch::Tensor wdown,
                              int64_t padded_mlp) {
  TORCH_CHECK(norms.size() == 4, "four norm weights");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), "x [M, d]: float32, CPU");
  for (const auto& w : norms) TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1), "norm weight size");
  auto a = attention_rows(rms_norm(x, norms[0], eps), wqkv, wproj, padded, qk_bias, cos, sin, k_pool, v_pool,
                          store_at, rows, starts, lengths, scale, H, Hkv);
  auto h = x + rms_norm(a, norms[1], eps);
  return h + rms_norm(mlp_rows(rms_norm(h, norms[2], eps), wfc, wdown, padded_mlp), norms[3], eps);
}

// Core steps of Ouro layers over a call's rows in one call (families/ouro.py: LoopedLM.core_step's loop over the
// layers, each a PeriNormBlock, then ln_f, for each step): peri_layer_rows and rms_norm in the same order, so the
// same bits.  Layer i of step s stores into and reads k_pools / v_pools[s * L + i]; every layer application shares
// the call's rows (store_at, rows, starts, lengths), RoPE tables, products' row counts, scale and heads.
torch::Tensor peri_recur_rows(torch::Tensor x, int64_t steps, std::vector<torch::Tensor> norms, std::vector<double> eps,
                              std::vector<torch::Tensor> wqkv, std::vector<torch::Tensor> wproj, int64_t padded,
                              std::vector<std::optional<torch::Tensor>> qk_bias, torch::Tensor cos, torch::Tensor sin,
                              std::vector<torch::Tensor> k_pools, std::vector<torch::Tensor> v_pools,
                              torch::Tensor store_at, torch::Tensor rows, torch::Tensor starts, torch::Tensor lengths,
                              double scale, int64_t H, int64_t Hkv, std::vector<torch::Tensor> wfc,
                              std::vector<torch::Tensor> wdown, int64_t padded_mlp, torch::Tensor ln_w, double ln_eps) {
  const int64_t L = static_cast<int64_t>(wqkv.size());
  TORCH_CHECK(steps > 0 && L > 0, "at least one step and one layer");
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 4 * L && static_cast<int64_t>(eps.size()) == L &&
              static_cast<int64_t>(wproj.size()) == L && static_cast<int64_t>(qk_bias.size()) == L &&
              static_cast<int64_t>(wfc.size()) == L && static_cast<int64_t>(wdown.size()) == L &&
              static_cast<int64_t>(k_pools.size()) == steps * L && static_cast<int64_t>(v_pools.size()) == steps * L,
              "four norms, an eps and four weights per layer; a K and a V pool per step and layer");
  TORCH_CHECK(x.dim() == 2 && ln_w.dim() == 1 && ln_w.size(0) == x.size(1), "ln_f weight size");
  TORCH_CHECK(ln_w.scalar_type() == at::kFloat && ln_w.device().is_cpu(), "ln_f weight: float32, CPU");
  // every layer and step as the first, checked before the first layer writes into a pool
  for (int64_t i = 0; i < L; ++i)
    TORCH_CHECK(wqkv[i].sizes() == wqkv[0].sizes() && wproj[i].sizes() == wproj[0].sizes() &&
                wfc[i].sizes() == wfc[0].sizes() && wdown[i].sizes() == wdown[0].sizes(), "layers of one shape");
  for (int64_t p = 0; p < steps * L; ++p)
    TORCH_CHECK(k_pools[p].sizes() == k_pools[0].sizes() && v_pools[p].sizes() == v_pools[0].sizes() &&
                k_pools[p].scalar_type() == k_pools[0].scalar_type() &&
                v_pools[p].scalar_type() == v_pools[0].scalar_type() && k_pools[p].strides() == k_pools[0].strides()
                && v_pools[p].strides() == v_pools[0].strides(), "pools of one shape");
  for (int64_t s = 0; s < steps; ++s) {
    for (int64_t i = 0; i < L; ++i) {
      x = peri_layer_rows(x, {norms[4 * i], norms[4 * i + 1], norms[4 * i + 2], norms[4 * i + 3]}, eps[i], wqkv[i],
                          wproj[i], padded, qk_bias[i], cos, sin, k_pools[s * L + i], v_pools[s * L + i], store_at,
                          rows, starts, lengths, scale, H, Hkv, wfc[i], wdown[i], padded_mlp);
    }
    x = rms_norm(x, ln_w, ln_eps);
  }
  return x;
}
// Register panels of weight w [N, K] (float32) for its oneDNN-packed copy: the k-block that reproduces oneDNN's bits
// on a test product of two rows, or 0 (not registered: no AVX-512 here, or no block agreed).
int64_t register_panels(torch::Tensor packed, torch::Tensor w) {
#if defined(__AVX512F__)
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(), "w [N, K]: float32, CPU");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + 15) / 16;
  if (N == 0 || K == 0) return 0;
  auto panels = torch::zeros({P, K, 16}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = panels.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t a, int64_t b) {
    for (int64_t j = a; j < b; ++j)
      for (int64_t c = 0; c < 16 && j * 16 + c < N; ++c)
        for (int64_t k = 0; k < K; ++k) dst[(j * K + k) * 16 + c] = src[(j * 16 + c) * K + k];
  });
  {
    std::lock_guard<std::mutex> lock(panels_mu);
    panels_of.erase(packed.unsafeGetTensorImpl());     // the test's reference is oneDNN's own product
  }
  auto xs = torch::empty({144, K}, w.options());       // fixed test rows (the global RNG is left alone)
  float* xp = xs.data_ptr<float>();
  for (int64_t i = 0; i < 144 * K; ++i) xp[i] = std::sin(0.731f * static_cast<float>(i % 100003) + 0.5f);
  const auto x = xs.narrow(0, 0, 2);
  // oneDNN's rows of two test rows, alone and among 40 and 144 (no panels registered yet): where they differ,
  // oneDNN itself depends on the row count for this weight, and no panel arithmetic could match every call
  const auto want = packed_product(x, packed, 8);
  if (!torch::equal(packed_product(xs.narrow(0, 0, 40), packed, 48).narrow(0, 0, 2), want) ||
      !torch::equal(packed_product(xs, packed, 144).narrow(0, 0, 2), want))
    return 0;
  for (int64_t kb : {K, int64_t(1024), int64_t(512), int64_t(2048), int64_t(256), int64_t(768), int64_t(128)}) {
    if (kb > K) continue;
    Panels p{packed, panels, N, kb, at::get_num_threads(), float_state()};
    if (torch::equal(panel_product(x, p), want)) {
      std::lock_guard<std::mutex> lock(panels_mu);
      panels_of[packed.unsafeGetTensorImpl()] = p;
      return kb;
    }
  }
#endif
  return 0;
}

void unregister_panels(torch::Tensor packed) {
  std::lock_guard<std::mutex> lock(panels_mu);
  panels_of.erase(packed.unsafeGetTensorImpl());
}

torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, int64_t padded) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), "x [M, K]: float32, CPU");
  TORCH_CHECK(padded >= x.size(0) && (padded == x.size(0) || x.size(0) > 1), "padded row count below the rows");
  return packed_product(x, packed, padded);
}

// The kernels touch no Python object (the sublayers call torch's ops through the dispatcher, as torch's own C++
// does): release the GIL while they run (as torch's own ops do).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rows_attention", &rows_attention, py::call_guard<py::gil_scoped_release>());
  m.def("store_rows", &store_rows, py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("rope_half", &rope_half, py::call_guard<py::gil_scoped_release>());
  m.def("attention_rows", &attention_rows, py::call_guard<py::gil_scoped_release>());
  m.def("mlp_rows", &mlp_rows, py::call_guard<py::gil_scoped_release>());
  m.def("peri_layer_rows", &peri_layer_rows, py::call_guard<py::gil_scoped_release>());
  m.def("peri_recur_rows", &peri_recur_rows, py::call_guard<py::gil_scoped_release>());
  m.def("register_panels", &register_panels, py::call_guard<py::gil_scoped_release>());
  m.def("unregister_panels", &unregister_panels, py::call_guard<py::gil_scoped_release>());
  m.def("packed_linear", &packed_linear, py::call_guard<py::gil_scoped_release>());
}
"""
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
        print("dasspec: compiling the CPU kernels (once per machine and torch version)",
              file=sys.stderr, flush=True)


def _load():
    """Build (once per machine and source; torch caches it) and import the kernel; None where that fails."""
    global _module, _tried
    with _lock:                  # _tried is set last: a thread asking during the build waits here for its outcome
        if _tried:
            return _module
        if os.environ.get("DASSPEC_DECODE_KERNEL", "1") == "0":
            _tried = True
            return None
        tag = hashlib.sha256(repr((_SOURCE, _CFLAGS, _cpu_id(), torch.__version__)).encode()).hexdigest()[:12]
        name = f"dasspec_decode_{tag}"
        _say_when_building(name)
        try:
            from torch.utils.cpp_extension import load_inline
            # -march=native: the build is keyed by this CPU's flags (tag), so it never runs on another kind of CPU
            module = load_inline(name, cpp_sources=_SOURCE, extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"],
                                 verbose=False)
        except Exception as e:                                        # no compiler, no ninja, a read-only cache
            warnings.warn(f"dasspec: the CPU kernels could not be built ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); attention, stores, RMSNorm, RoPE and the "
                          f"sublayers run through torch's ops", stacklevel=3)
            module = None
        _module = module
        _tried = True
        return _module


def available() -> bool:
    return (_module if _tried else _load()) is not None      # no lock once decided: asked per segment and layer


def rows_attention(q: Tensor, k: Tensor, v: Tensor, rows: Tensor, starts: Tensor, lengths: Tensor,
                   scale: float) -> Tensor:
    """Query s [H, hd] of q [S, H, hd] attends pool rows ``rows[starts[s]: starts[s] + lengths[s]]`` of k, v."""
    return (_module if _tried else _load()).rows_attention(q, k, v, rows, starts, lengths, scale)


def store_rows(k_dst: Tensor, v_dst: Tensor, rows: Tensor, k: Tensor, v: Tensor) -> None:
    """``k_dst[:, rows] = k`` and ``v_dst[:, rows] = v`` ([H_kv, pool rows, hd] <- [H_kv, N, hd])."""
    (_module if _tried else _load()).store_rows(k_dst, v_dst, rows, k, v)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of float32 rows, each row's sum in a fixed order (the same bits whatever the row count)."""
    return (_module if _tried else _load()).rms_norm(x, weight, eps)


def rope_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE in HF's rotate_half form over x [B, W, n, hd] (float32) with cos / sin [W, hd]: torch's bits."""
    return (_module if _tried else _load()).rope_half(x, cos, sin)


def attention_rows(x: Tensor, wqkv: Tensor, wproj: Tensor, padded: int, qk_bias: Tensor | None, cos: Tensor,
                   sin: Tensor, k_pool: Tensor, v_pool: Tensor, store_at: Tensor, rows: Tensor, starts: Tensor,
                   lengths: Tensor, scale: float, n_heads: int, n_kv_heads: int) -> Tensor:
    """The attention sublayer over rows x [M, d] in one call: packed QKV product, q/k bias, halves RoPE, K/V stores
    at pool rows ``store_at``, ``rows_attention``, packed output product (``padded``: the products' row count)."""
    return (_module if _tried else _load()).attention_rows(x, wqkv, wproj, padded, qk_bias, cos, sin, k_pool, v_pool,
                                                           store_at, rows, starts, lengths, scale, n_heads,
                                                           n_kv_heads)


def mlp_rows(x: Tensor, wfc: Tensor, wproj: Tensor, padded: int) -> Tensor:
    """The gated MLP over rows x [M, d] in one call: packed fc product, silu(gate) * up, packed proj product."""
    return (_module if _tried else _load()).mlp_rows(x, wfc, wproj, padded)


def peri_layer_rows(x: Tensor, norms: list[Tensor], eps: float, attention_args: tuple, mlp_args: tuple) -> Tensor:
    """Ouro's layer of a call's rows in one call (``PeriNormBlock.rows``): ``attention_args`` / ``mlp_args`` as
    ``attention_rows`` / ``mlp_rows`` take them after x."""
    return (_module if _tried else _load()).peri_layer_rows(x, norms, eps, *attention_args, *mlp_args)


# attention_rows' arguments: wqkv, wproj, padded, qk_bias, cos, sin, k_pool, v_pool, store_at, rows, starts, lengths,
# scale, H, Hkv; mlp_rows': wfc, wdown, padded.  Of these peri_recur_rows takes per layer the weights and the bias (and
# the pools per layer and step); the rest once, from the first layer.
_PER_LAYER = (0, 1, 3, 6, 7)


def layers_agree(layers: list[tuple]) -> bool:
    """Whether every layer's ``peri_layer_rows`` arguments that ``peri_recur_rows`` takes once (the products' row
    counts, RoPE tables, the call's rows, scale, heads) are the first layer's (the same for every layer of one config;
    asked, since a module may be changed)."""
    a0, m0 = layers[0][2], layers[0][3]
    return all(m[2] == m0[2] and all(j in _PER_LAYER or x is y or (not isinstance(x, Tensor) and x == y)
                                     for j, (x, y) in enumerate(zip(a, a0)))
               for _, _, a, m in layers[1:])


def peri_recur_rows(x: Tensor, steps: int, layers: list[tuple], pools: list[tuple[Tensor, Tensor]], ln_weight: Tensor,
                    ln_eps: float) -> Tensor:
    """``steps`` core steps of Ouro's layers over a call's rows x [M, d] in one call, each step's layers then ln_f
    (``Ouro.recur_rows``).  ``layers``: each layer's ``peri_layer_rows`` arguments after x, as
    ``PeriNormBlock.layer_args`` gives them (``layers_agree``); ``pools``: the (K, V) pool of every layer of every
    step, step after step, in place of the layers' own."""
    norms = [w for n, *_ in layers for w in n]
    a0 = layers[0][2]
    return (_module if _tried else _load()).peri_recur_rows(
        x, steps, norms, [l[1] for l in layers], [l[2][0] for l in layers], [l[2][1] for l in layers], a0[2],
        [l[2][3] for l in layers], a0[4], a0[5], [k for k, _ in pools], [v for _, v in pools], *a0[8:15],
        [l[3][0] for l in layers], [l[3][1] for l in layers], layers[0][3][2], ln_weight, ln_eps)


def register_panels(packed: Tensor, weight: Tensor) -> int:
    """Give ``packed`` (oneDNN's copy of ``weight``) a 16-column panel copy that products of at most 16 rows read
    with oneDNN's arithmetic (a decode step's weights stream faster): the k-block that reproduced oneDNN's bits on a
    test product, or 0 where none did, where oneDNN's own rows of it depend on the row count, or the CPU has no
    AVX-512 (oneDNN's product then serves every call).  The panels serve only calls at the thread count and
    flush-to-zero state of the registration (oneDNN's arithmetic may follow both); other calls take oneDNN's."""
    return (_module if _tried else _load()).register_panels(packed, weight)


def unregister_panels(packed: Tensor) -> None:
    (_module if _tried else _load()).unregister_panels(packed)


def packed_linear(x: Tensor, packed: Tensor, padded: int) -> Tensor:
    """x [M, K] times a packed weight: its panels for at most 16 rows where it has them, else oneDNN's product over
    ``padded`` rows (zeros past M)."""
    return (_module if _tried else _load()).packed_linear(x, packed, padded)
