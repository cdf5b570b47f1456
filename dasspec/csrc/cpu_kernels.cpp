// dasspec's CPU kernels (cpu_kernels.h): the arithmetic of isa_body.h compiled for AVX-512, AVX2 and a portable
// path, one chosen at run time, and the tensor-level functions around it.  Built with -ffp-contract=off.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <type_traits>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DASSPEC_X86 1
#endif

namespace dasspec {

constexpr int QG = 4;   // queries per attention group (isa_body.h's group_heads)

// What a range of (query, head) items of one rows_attention call needs.
template <typename T>
struct HeadArgs {
  const T *q, *kc, *vc, *ku, *vu;
  T* out;
  const int64_t *rows, *starts, *lengths, *prefix;   // prefix: rows of each query's list read from (kc, vc), or null
  const int64_t *group_first, *group_size;           // float32: items are (group of queries, head) pairs
  int64_t H, D, g, kc0, kc1, vc0, vc1, ku0, ku1, vu0, vu1, L_max;
  float scale;
};

template <typename T>
struct GemmArgs {
  const T *x, *w, *bias;
  T* out;
  int64_t ldx, ldw, ldo, K;
};

}  // namespace dasspec

// One body per ISA; each defines the same three entry points.
#define DASSPEC_ENTRY_POINTS                                                                                      \
  void gemm_f32(const dasspec::GemmArgs<float>& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {           \
    gemm_block<float>(a.x, a.ldx, m0, m1, a.w, a.ldw, n0, n1, a.K, a.out, a.ldo, a.bias);                       \
  }                                                                                                               \
  void gemm_bf16(const dasspec::GemmArgs<c10::BFloat16>& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {   \
    gemm_block<c10::BFloat16>(a.x, a.ldx, m0, m1, a.w, a.ldw, n0, n1, a.K, a.out, a.ldo, a.bias);               \
  }                                                                                                               \
  template <typename T>                                                                                           \
  void heads(const dasspec::HeadArgs<T>& a, int64_t i0, int64_t i1) {                                            \
    std::vector<float> sc(a.L_max), buf(3 * a.D);                                                                 \
    for (int64_t i = i0; i < i1; ++i) {                                                                           \
      const int64_t s = i / a.H, kvh = (i % a.H) / a.g, L = a.lengths[s];                                        \
      const int64_t Lc = a.prefix ? a.prefix[s] : L;                                                              \
      one_head<T>(a.q + i * a.D, a.kc + kvh * a.kc0, a.vc + kvh * a.vc0, a.ku + kvh * a.ku0, a.vu + kvh * a.vu0, \
                  a.rows + a.starts[s], L, Lc, a.D, a.kc1, a.vc1, a.scale, sc.data(), buf.data(), a.out + i * a.D); \
    }                                                                                                             \
  }                                                                                                               \
  void heads_f32(const dasspec::HeadArgs<float>& a, int64_t i0, int64_t i1) {                                    \
    std::vector<float> sc(QG * a.L_max), buf(3 * a.D), qf(QG * a.D);                                              \
    for (int64_t i = i0; i < i1; ++i) {                                                                           \
      const int64_t g = i / a.H, h = i % a.H, kvh = h / a.g, s0 = a.group_first[g], n = a.group_size[g];          \
      const float *kc = a.kc + kvh * a.kc0, *vc = a.vc + kvh * a.vc0, *ku = a.ku + kvh * a.ku0,                   \
                  *vu = a.vu + kvh * a.vu0;                                                                       \
      const int64_t Lc0 = a.prefix ? a.prefix[s0] : a.L_max;                                                      \
      if (n == QG) {                                                                                              \
        const float* q[QG];                                                                                       \
        float* out[QG];                                                                                           \
        for (int t = 0; t < QG; ++t) q[t] = a.q + ((s0 + t) * a.H + h) * a.D, out[t] = a.out + ((s0 + t) * a.H + h) * a.D; \
        group_heads(q, kc, vc, ku, vu, a.rows + a.starts[s0], a.lengths + s0, Lc0, a.D, a.kc1, a.vc1, a.scale,   \
                    sc.data(), a.L_max, qf.data(), out);                                                           \
        continue;                                                                                                 \
      }                                                                                                           \
      for (int64_t s = s0; s < s0 + n; ++s) {                                                                     \
        const int64_t L = a.lengths[s], Lc = a.prefix ? a.prefix[s] : L, it = s * a.H + h;                       \
        one_head<float>(a.q + it * a.D, kc, vc, ku, vu, a.rows + a.starts[s], L, Lc, a.D, a.kc1, a.vc1, a.scale, \
                        sc.data(), buf.data(), a.out + it * a.D);                                                 \
      }                                                                                                           \
    }                                                                                                             \
  }                                                                                                               \
  void heads_bf16(const dasspec::HeadArgs<c10::BFloat16>& a, int64_t i0, int64_t i1) {                           \
    heads<c10::BFloat16>(a, i0, i1);                                                                              \
  }                                                                                                               \
  void heads_f16(const dasspec::HeadArgs<c10::Half>& a, int64_t i0, int64_t i1) { heads<c10::Half>(a, i0, i1); } \
  void rms(const float* x, const float* w, int64_t D, float eps, float* o, int64_t r0, int64_t r1) {             \
    for (int64_t r = r0; r < r1; ++r) rms_row(x + r * D, w, D, eps, o + r * D);                                  \
  }                                                                                                               \
  void argmax_f32(const float* x, int64_t n, int64_t ld, int64_t* out, int64_t r0, int64_t r1) {                \
    for (int64_t r = r0; r < r1; ++r) out[r] = argmax_row(x + r * ld, n);                                       \
  }                                                                                                               \
  void pw_f32(const float* g, const float* u, int64_t n, float* o) { pointwise_row<float>(g, u, n, o); }          \
  void pw_bf16(const c10::BFloat16* g, const c10::BFloat16* u, int64_t n, c10::BFloat16* o) {                     \
    pointwise_row<c10::BFloat16>(g, u, n, o);                                                                     \
  }

namespace dasspec_portable {
#include "isa_body.h"
DASSPEC_ENTRY_POINTS
}  // namespace dasspec_portable

#if DASSPEC_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
namespace dasspec_avx2 {
#define DASSPEC_ISA_AVX2
#include "isa_body.h"
#undef DASSPEC_ISA_AVX2
DASSPEC_ENTRY_POINTS
}  // namespace dasspec_avx2
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma"))), \
                             apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma")
#endif
namespace dasspec_avx512 {
#define DASSPEC_ISA_AVX512
#include "isa_body.h"
#undef DASSPEC_ISA_AVX512
DASSPEC_ENTRY_POINTS
}  // namespace dasspec_avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

namespace dasspec {
namespace {

struct Ops {
  const char* name;
  void (*gemm_f32)(const GemmArgs<float>&, int64_t, int64_t, int64_t, int64_t);
  void (*gemm_bf16)(const GemmArgs<c10::BFloat16>&, int64_t, int64_t, int64_t, int64_t);
  void (*heads_f32)(const HeadArgs<float>&, int64_t, int64_t);
  void (*heads_bf16)(const HeadArgs<c10::BFloat16>&, int64_t, int64_t);
  void (*heads_f16)(const HeadArgs<c10::Half>&, int64_t, int64_t);
  void (*rms)(const float*, const float*, int64_t, float, float*, int64_t, int64_t);
  void (*argmax_f32)(const float*, int64_t, int64_t, int64_t*, int64_t, int64_t);
  void (*pw_f32)(const float*, const float*, int64_t, float*);
  void (*pw_bf16)(const c10::BFloat16*, const c10::BFloat16*, int64_t, c10::BFloat16*);
};

#define DASSPEC_OPS(ns, label) \
  Ops { label, &ns::gemm_f32, &ns::gemm_bf16, &ns::heads_f32, &ns::heads_bf16, &ns::heads_f16, &ns::rms,        \
        &ns::argmax_f32,                                                                                          \
        &ns::pw_f32, &ns::pw_bf16 }

const Ops PORTABLE = DASSPEC_OPS(dasspec_portable, "portable");
#if DASSPEC_X86
const Ops AVX2 = DASSPEC_OPS(dasspec_avx2, "avx2");
const Ops AVX512 = DASSPEC_OPS(dasspec_avx512, "avx512");

bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
}
bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#endif

const Ops* by_name(const std::string& name) {
  if (name == "portable") return &PORTABLE;
#if DASSPEC_X86
  if (name == "avx2" && has_avx2()) return &AVX2;
  if (name == "avx512" && has_avx512()) return &AVX512;
#endif
  return nullptr;
}

const Ops* best() {
  const char* env = std::getenv("DASSPEC_CPU_ISA");
  if (env && *env) {
    const Ops* o = by_name(env);
    TORCH_CHECK(o, "DASSPEC_CPU_ISA=", env, ": not one of this CPU's kernel paths (avx512, avx2, portable)");
    return o;
  }
#if DASSPEC_X86
  if (has_avx512()) return &AVX512;
  if (has_avx2()) return &AVX2;
#endif
  return &PORTABLE;
}

std::atomic<const Ops*> current{nullptr};

const Ops& ops() {
  const Ops* o = current.load(std::memory_order_acquire);
  if (!o) {
    const Ops* chosen = best();
    current.compare_exchange_strong(o, chosen);
    o = current.load(std::memory_order_acquire);
  }
  return *o;
}

void check_cpu(const at::Tensor& t, const char* what) { TORCH_CHECK(t.device().is_cpu(), what, ": a CPU tensor"); }

}  // namespace

std::string isa() { return ops().name; }

void set_isa(const std::string& name) {
  const Ops* o = by_name(name);
  TORCH_CHECK(o, "no kernel path '", name, "' on this CPU");
  current.store(o, std::memory_order_release);
}

std::vector<std::string> isas_here() {
  std::vector<std::string> out;
#if DASSPEC_X86
  if (has_avx512()) out.push_back("avx512");
  if (has_avx2()) out.push_back("avx2");
#endif
  out.push_back("portable");
  return out;
}

// ---- the product ------------------------------------------------------------------------------------------------
namespace {
template <typename T, typename Gemm>
void run_gemm(const T* xp, const T* wp, const T* bp, T* op, int64_t M, int64_t N, int64_t K, int64_t ldx,
              int64_t ldw, Gemm gemm) {
  const GemmArgs<T> a{xp, wp, bp, op, std::max<int64_t>(ldx, 1), std::max<int64_t>(ldw, 1), N, K};
  constexpr int64_t MB = 64, NB = 64;
  if (M <= 16) {            // every row at once: the weight is read once
    const int64_t grain = std::max<int64_t>(16, ((1 << 15) / std::max<int64_t>(K * M, 1) + 15) / 16 * 16);
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) { gemm(a, 0, M, n0, n1); });
    return;
  }
  const int64_t mb = (M + MB - 1) / MB, nb = (N + NB - 1) / NB;
  at::parallel_for(0, mb * nb, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i = t % mb, j = t / mb;      // consecutive tasks share a block of weight rows
      gemm(a, i * MB, std::min(M, (i + 1) * MB), j * NB, std::min(N, (j + 1) * NB));
    }
  });
}
}  // namespace

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& w, const std::optional<at::Tensor>& bias_in) {
  const auto dt = x_in.scalar_type();
  TORCH_CHECK(x_in.dim() == 2 && w.dim() == 2 && w.scalar_type() == dt && (dt == at::kFloat || dt == at::kBFloat16),
              "linear: x [M, K] and w [N, K], both float32 or both bfloat16");
  check_cpu(x_in, "x");
  check_cpu(w, "w");
  TORCH_CHECK(x_in.size(1) == w.size(1), "linear: x has ", x_in.size(1), " columns, w ", w.size(1));
  TORCH_CHECK(w.stride(1) == 1 || w.size(1) <= 1, "linear: w's rows must be contiguous");
  const auto x = x_in.stride(1) == 1 || x_in.size(1) <= 1 ? x_in : x_in.contiguous();
  at::Tensor bias;
  if (bias_in.has_value()) {
    bias = bias_in->contiguous();
    TORCH_CHECK(bias.scalar_type() == dt && bias.numel() == w.size(0), "linear: bias [N] of x's dtype");
  }
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return bias.defined() ? out.copy_(bias.expand({M, N})) : out.zero_();
  if (dt == at::kFloat) {
    run_gemm<float>(x.data_ptr<float>(), w.data_ptr<float>(), bias.defined() ? bias.data_ptr<float>() : nullptr,
                    out.data_ptr<float>(), M, N, K, x.stride(0), w.stride(0), ops().gemm_f32);
  } else {
    using B = c10::BFloat16;
    run_gemm<B>(x.data_ptr<B>(), w.data_ptr<B>(), bias.defined() ? bias.data_ptr<B>() : nullptr, out.data_ptr<B>(),
                M, N, K, x.stride(0), w.stride(0), ops().gemm_bf16);
  }
  return out;
}

// ---- attention ----------------------------------------------------------------------------------------------
at::Tensor rows_attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, const at::Tensor& rows_in,
                          const at::Tensor& starts_in, const at::Tensor& lengths_in, double scale,
                          const std::optional<at::Tensor>& k_prefix, const std::optional<at::Tensor>& v_prefix,
                          const std::optional<at::Tensor>& prefix_lengths) {
  TORCH_CHECK(q_in.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q [S, H, hd], k / v [H_kv, rows, hd]");
  for (const auto* t : {&q_in, &k, &v, &rows_in, &starts_in, &lengths_in}) check_cpu(*t, "rows_attention");
  TORCH_CHECK(k.size(0) > 0, "no key heads");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k and v: contiguous rows");
  TORCH_CHECK(q_in.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "one dtype");
  TORCH_CHECK(rows_in.scalar_type() == at::kLong && starts_in.scalar_type() == at::kLong &&
              lengths_in.scalar_type() == at::kLong, "int64 rows, starts and lengths");
  TORCH_CHECK(k_prefix.has_value() == v_prefix.has_value() && k_prefix.has_value() == prefix_lengths.has_value(),
              "k_prefix, v_prefix and prefix_lengths together");
  const auto q = q_in.contiguous();
  const auto rows = rows_in.contiguous(), starts = starts_in.contiguous(), lengths = lengths_in.contiguous();
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(0), N = rows.numel();
  TORCH_CHECK(H % Hkv == 0 && k.size(2) == D && v.size(2) == D && v.size(0) == Hkv && starts.numel() == S &&
              lengths.numel() == S, "shapes do not match");
  const at::Tensor& kc = k_prefix.has_value() ? *k_prefix : k;
  const at::Tensor& vc = v_prefix.has_value() ? *v_prefix : v;
  at::Tensor pl;
  if (prefix_lengths.has_value()) {
    pl = prefix_lengths->contiguous();
    check_cpu(kc, "k_prefix");
    check_cpu(vc, "v_prefix");
    check_cpu(pl, "prefix_lengths");
    TORCH_CHECK(pl.scalar_type() == at::kLong && pl.numel() == S, "int64 prefix_lengths [S]");
    TORCH_CHECK(kc.dim() == 3 && vc.dim() == 3 && kc.sizes() == vc.sizes() && kc.size(0) == Hkv &&
                kc.size(2) == D && kc.stride(2) == 1 && vc.stride(2) == 1 && kc.scalar_type() == k.scalar_type() &&
                vc.scalar_type() == k.scalar_type() && kc.stride(1) == k.stride(1) && vc.stride(1) == v.stride(1),
                "k_prefix / v_prefix like k / v");
  }
  auto out = at::empty_like(q);
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* ln = lengths.data_ptr<int64_t>();
  const int64_t* rw = rows.data_ptr<int64_t>();
  const int64_t* pp = pl.defined() ? pl.data_ptr<int64_t>() : nullptr;
  int64_t L_max = 1;
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(ln[s] > 0, "query ", s, " needs a row");
    TORCH_CHECK(st[s] >= 0 && st[s] + ln[s] <= N, "query ", s, ": rows outside the row list");
    TORCH_CHECK(!pp || (pp[s] >= 0 && pp[s] <= ln[s]), "query ", s, ": prefix length outside its rows");
    L_max = std::max(L_max, ln[s]);
  }
  const int64_t P = std::min({k.size(1), v.size(1), kc.size(1), vc.size(1)});
  for (int64_t j = 0; j < N; ++j) TORCH_CHECK(rw[j] >= 0 && rw[j] < P, "row ", rw[j], " outside the cache");
  const float sc = static_cast<float>(scale);
  const auto& o = ops();
  // float32: consecutive queries whose lists start alike (a prompt block's or a chain's rows) in groups of QG that
  // load each key and value row once (every query's arithmetic unchanged); the rest alone
  std::vector<int64_t> first, size;
  if (q.scalar_type() == at::kFloat) {
    for (int64_t s = 0; s < S;) {
      int64_t n = 1;
      while (n < QG && s + n < S && st[s + n] == st[s] && (!pp || pp[s + n] == pp[s])) ++n;
      first.push_back(s);
      size.push_back(n);
      s += n;
    }
  }
  auto run = [&](auto* tag, auto fn) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const HeadArgs<T> a{q.data_ptr<T>(), kc.data_ptr<T>(), vc.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(),
                        out.data_ptr<T>(), rw, st, ln, pp, first.data(), size.data(), H, D, H / Hkv, kc.stride(0),
                        kc.stride(1), vc.stride(0), vc.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                        L_max, sc};
    const int64_t items = (first.empty() ? S : static_cast<int64_t>(first.size())) * H;
    at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) { fn(a, i0, i1); });
  };
  // one_head reads both sources with the first's row strides (checked equal above)
  switch (q.scalar_type()) {
    case at::kFloat: run(static_cast<float*>(nullptr), o.heads_f32); break;
    case at::kBFloat16: run(static_cast<c10::BFloat16*>(nullptr), o.heads_bf16); break;
    case at::kHalf: run(static_cast<c10::Half*>(nullptr), o.heads_f16); break;
    default: TORCH_CHECK(false, "rows_attention: float32, bfloat16 or float16");
  }
  return out;
}

// dst[h, rows[i], :] = src[h, i, :]: a plain copy per (head, row), the source's bits.
void store_rows(const at::Tensor& k_dst, const at::Tensor& v_dst, const at::Tensor& rows_in, const at::Tensor& k,
                const at::Tensor& v) {
  TORCH_CHECK(k_dst.dim() == 3 && v_dst.dim() == 3 && k.dim() == 3 && v.dim() == 3, "[H_kv, rows, hd] tensors");
  TORCH_CHECK(k_dst.stride(2) == 1 && v_dst.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "contiguous rows");
  TORCH_CHECK(k_dst.scalar_type() == k.scalar_type() && v_dst.scalar_type() == v.scalar_type() &&
              k.scalar_type() == v.scalar_type(), "one dtype");
  TORCH_CHECK(rows_in.scalar_type() == at::kLong, "int64 rows");
  for (const auto* t : {&k_dst, &v_dst, &k, &v, &rows_in}) check_cpu(*t, "store_rows");
  const auto rows = rows_in.contiguous();
  const int64_t H = k.size(0), N = k.size(1), D = k.size(2);
  TORCH_CHECK(rows.numel() == N && v.size(0) == H && v.size(1) == N && v.size(2) == D && k_dst.size(0) == H &&
              v_dst.size(0) == H && k_dst.size(2) == D && v_dst.size(2) == D, "shapes do not match");
  const int64_t* rw = rows.data_ptr<int64_t>();
  const int64_t P = std::min(k_dst.size(1), v_dst.size(1));
  for (int64_t i = 0; i < N; ++i) TORCH_CHECK(rw[i] >= 0 && rw[i] < P, "row ", rw[i], " outside the cache");
  const int64_t e = k.element_size(), bytes = D * e;
  char* kd = static_cast<char*>(k_dst.data_ptr());
  char* vd = static_cast<char*>(v_dst.data_ptr());
  const char* ks = static_cast<const char*>(k.data_ptr());
  const char* vs = static_cast<const char*>(v.data_ptr());
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

// The RoPE kernels' frame: x [B, W, n, hd] (float32, contiguous rows) and per-position tables cos / sin [W, cols]
// (cols: hd, or hd / 2 for pairs); each (b, w, head) row through ``rotate(x row, cos row, sin row, out row)``, rows
// split over threads.
template <typename Rotate>
static at::Tensor rope_rows(const at::Tensor& x, const at::Tensor& cos_in, const at::Tensor& sin_in, bool pairs,
                            const char* name, Rotate rotate) {
  TORCH_CHECK(x.dim() == 4 && x.scalar_type() == at::kFloat && cos_in.scalar_type() == at::kFloat &&
              sin_in.scalar_type() == at::kFloat && x.stride(3) == 1, "x [B, W, n, hd] float32, contiguous rows");
  for (const auto* t : {&x, &cos_in, &sin_in}) check_cpu(*t, name);
  const int64_t B = x.size(0), W = x.size(1), n = x.size(2), D = x.size(3), cols = pairs ? D / 2 : D;
  const auto cos = cos_in.contiguous(), sin = sin_in.contiguous();
  TORCH_CHECK(D % 2 == 0 && cos.numel() == W * cols && sin.numel() == W * cols,
              pairs ? "cos / sin [W, hd / 2]" : "cos / sin [W, hd]");
  auto out = at::empty({B, W, n, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1), s2 = x.stride(2);
  at::parallel_for(0, B * W * n, 64, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      const int64_t hd_i = i % n, w = (i / n) % W, bb = i / (n * W);
      rotate(xp + bb * s0 + w * s1 + hd_i * s2, cp + w * cols, sp + w * cols, op + i * D, D);
    }
  });
  return out;
}

// RoPE, halves form (HF rotate_half): out = x * cos + cat(-x2, x1) * sin over x [B, W, n, hd] (float32; cos / sin
// [W, hd]), the same three roundings as torch's ops in the same order (so the same bits), in one pass.
at::Tensor rope_half(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return rope_rows(x, cos, sin, false, "rope_half", [](const float* xr, const float* c, const float* s, float* o,
                                                       int64_t D) {
    const int64_t h = D / 2;
    for (int64_t d = 0; d < h; ++d) o[d] = xr[d] * c[d] + (-xr[d + h]) * s[d];
    for (int64_t d = h; d < D; ++d) o[d] = xr[d] * c[d] + xr[d - h] * s[d];
  });
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && w_in.scalar_type() == at::kFloat, "float32");
  check_cpu(x_in, "x");
  check_cpu(w_in, "w");
  const auto x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t D = x.size(-1);
  TORCH_CHECK(D > 0 && w.numel() == D, "weight size");
  const int64_t M = x.numel() / D;
  auto out = at::empty_like(x);
  const auto rms = ops().rms;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t a, int64_t b) { rms(xp, wp, D, static_cast<float>(eps), op, a, b); });
  return out;
}

// torch.argmax(x, -1) of float32 rows [..., n] (n >= 1, unit inner stride): the same indices (the first largest
// value, the first NaN), rows split over threads.
at::Tensor argmax_rows(const at::Tensor& x_in) {
  check_cpu(x_in, "x");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() >= 1 && x_in.size(-1) > 0, "float32 rows [..., n > 0]");
  const int64_t n = x_in.size(-1);
  auto x = x_in.reshape({-1, n});
  if (x.stride(1) != 1 || x.stride(0) < n) x = x.contiguous();
  auto sizes = x_in.sizes().vec();
  sizes.pop_back();
  auto out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  const auto f = ops().argmax_f32;
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t ld = x.stride(0);
  at::parallel_for(0, x.size(0), std::max<int64_t>(1, (1 << 16) / n),
                   [&](int64_t a, int64_t b) { f(xp, n, ld, op, a, b); });
  return out.view(sizes);
}

// silu(g) * u, or sigmoid(g) without u: g, u [..., n] (rows with unit inner stride), float32 or bfloat16; out
// contiguous.  Rows split over threads, never a row: each value's bits are its own (isa_body.h's pointwise_row).
at::Tensor pointwise(const at::Tensor& g_in, const std::optional<at::Tensor>& u_in) {
  check_cpu(g_in, "g");
  const auto dt = g_in.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "float32 or bfloat16");
  const int64_t n = g_in.size(-1);
  auto g = g_in.reshape({-1, n});
  if (g.stride(1) != 1) g = g.contiguous();
  at::Tensor u;
  if (u_in.has_value()) {
    check_cpu(*u_in, "u");
    TORCH_CHECK(u_in->scalar_type() == dt && u_in->sizes() == g_in.sizes(), "u: g's shape and dtype");
    u = u_in->reshape({-1, n});
    if (u.stride(1) != 1) u = u.contiguous();
  }
  const int64_t M = g.size(0);
  auto out = at::empty({M, n}, g.options());
  const auto& o = ops();
  at::parallel_for(0, M, std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1)), [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      if (dt == at::kFloat)
        o.pw_f32(g.data_ptr<float>() + r * g.stride(0), u.defined() ? u.data_ptr<float>() + r * u.stride(0) : nullptr,
                 n, out.data_ptr<float>() + r * n);
      else
        o.pw_bf16(g.data_ptr<c10::BFloat16>() + r * g.stride(0),
                  u.defined() ? u.data_ptr<c10::BFloat16>() + r * u.stride(0) : nullptr, n,
                  out.data_ptr<c10::BFloat16>() + r * n);
    }
  });
  return out.view(g_in.sizes());
}

// ---- one-call sublayers (the modules' ops on the same views in the same order: their bits) -------------------------
// The shapes and dtypes a sublayer's products, stores and reads need, checked before its first write into a pool (a
// row list's bounds are rows_attention's, after the call's own rows are stored - as in the modules' ops).
static void check_attention(const at::Tensor& x, const at::Tensor& wqkv, const at::Tensor& wproj,
                            const at::Tensor& k_pool, const at::Tensor& v_pool, int64_t H, int64_t Hkv) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), "x [M, d]: float32, CPU");
  TORCH_CHECK(H > 0 && Hkv > 0 && H % Hkv == 0, "heads: H a multiple of H_kv");
  TORCH_CHECK(wqkv.dim() == 2 && wqkv.size(1) == x.size(1) && wqkv.size(0) % (H + 2 * Hkv) == 0 &&
              wqkv.scalar_type() == at::kFloat, "wqkv [(H + 2 H_kv) hd, d], float32");
  const int64_t hd = wqkv.size(0) / (H + 2 * Hkv);
  TORCH_CHECK(wproj.dim() == 2 && wproj.size(0) == x.size(1) && wproj.size(1) == H * hd &&
              wproj.scalar_type() == at::kFloat, "wproj [d, H hd], float32");
  TORCH_CHECK(k_pool.scalar_type() == at::kFloat && v_pool.scalar_type() == at::kFloat && k_pool.stride(2) == 1 &&
              v_pool.stride(2) == 1, "pools: float32, contiguous rows");
}

// A draft's prefix pools and counts (attention_rows', each step's of recur_rows): what rows_attention reads them as.
static void check_prefix(const at::Tensor& kp, const at::Tensor& vp, const at::Tensor& prefix_lengths,
                         const at::Tensor& k_pool, const at::Tensor& v_pool, int64_t M) {
  check_cpu(kp, "k_prefix");
  check_cpu(vp, "v_prefix");
  check_cpu(prefix_lengths, "prefix_lengths");
  TORCH_CHECK(kp.sizes() == k_pool.sizes() && vp.sizes() == v_pool.sizes() && kp.stride(1) == k_pool.stride(1) &&
              vp.stride(1) == v_pool.stride(1) && kp.stride(2) == 1 && vp.stride(2) == 1 &&
              kp.scalar_type() == at::kFloat && vp.scalar_type() == at::kFloat &&
              prefix_lengths.scalar_type() == at::kLong && prefix_lengths.numel() == M,
              "prefix pools like the pools, an int64 prefix length per row");
}

static void check_mlp(const at::Tensor& x, const at::Tensor& wfc, const at::Tensor& wdown) {
  TORCH_CHECK(wfc.dim() == 2 && wfc.size(1) == x.size(1) && wfc.size(0) % 2 == 0 && wdown.dim() == 2 &&
              wdown.size(0) == x.size(1) && wdown.size(1) == wfc.size(0) / 2 && wfc.scalar_type() == at::kFloat &&
              wdown.scalar_type() == at::kFloat, "MLP weights [2 I, d] and [d, I], float32");
}

static void check_norms(const at::Tensor& x, const std::vector<at::Tensor>& norms) {
  for (const auto& w : norms)
    TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == at::kFloat, "norm weight [d], float32");
}

// A one-call layer's: n norms, the attention's and the MLP's weights and its pools.
static void check_layer(const at::Tensor& x, const std::vector<at::Tensor>& norms, size_t n, const at::Tensor& wqkv,
                        const at::Tensor& wproj, const at::Tensor& k_pool, const at::Tensor& v_pool, int64_t H,
                        int64_t Hkv, const at::Tensor& wfc, const at::Tensor& wdown) {
  TORCH_CHECK(norms.size() == n, "norm weights: ", n, " per layer");
  check_attention(x, wqkv, wproj, k_pool, v_pool, H, Hkv);
  check_norms(x, norms);
  check_mlp(x, wfc, wdown);
}

// Every layer's weights and every (step, layer)'s pools of the first's shapes (a core of one config): with the first
// checked, all are, before the first layer writes into a pool.
static void check_like_first(const std::vector<at::Tensor>& wqkv, const std::vector<at::Tensor>& wproj,
                             const std::vector<at::Tensor>& wfc, const std::vector<at::Tensor>& wdown,
                             const std::vector<at::Tensor>& k_pools, const std::vector<at::Tensor>& v_pools) {
  for (size_t i = 0; i < wqkv.size(); ++i)
    TORCH_CHECK(wqkv[i].sizes() == wqkv[0].sizes() && wproj[i].sizes() == wproj[0].sizes() &&
                wfc[i].sizes() == wfc[0].sizes() && wdown[i].sizes() == wdown[0].sizes(), "layers of one shape");
  for (size_t p = 0; p < k_pools.size(); ++p)
    TORCH_CHECK(k_pools[p].sizes() == k_pools[0].sizes() && v_pools[p].sizes() == v_pools[0].sizes() &&
                k_pools[p].scalar_type() == k_pools[0].scalar_type() &&
                v_pools[p].scalar_type() == v_pools[0].scalar_type() && k_pools[p].strides() == k_pools[0].strides()
                && v_pools[p].strides() == v_pools[0].strides(), "pools of one shape");
}

// Each layer's norm weights, ``per`` of them, as one vector per layer (taken once per call, not per step).
static std::vector<std::vector<at::Tensor>> per_layer(const std::vector<at::Tensor>& norms, size_t per) {
  std::vector<std::vector<at::Tensor>> out;
  for (size_t i = 0; i + per <= norms.size(); i += per) out.emplace_back(norms.begin() + i, norms.begin() + i + per);
  return out;
}

static void check_gate(const at::Tensor& gate_w, const at::Tensor& gate_b, const at::Tensor& k_glob,
                       const at::Tensor& v_glob, const at::Tensor& k_pool, int64_t H, int64_t hd) {
  TORCH_CHECK(gate_w.dim() == 2 && gate_w.size(0) == H && gate_w.size(1) == H * hd && gate_b.numel() == H &&
              gate_w.scalar_type() == at::kFloat && gate_b.scalar_type() == at::kFloat,
              "gate weight [H, H hd] and bias [H], float32");
  TORCH_CHECK(k_glob.dim() == 3 && v_glob.dim() == 3 && k_glob.sizes() == k_pool.sizes() &&
              v_glob.sizes() == k_pool.sizes() && k_glob.scalar_type() == at::kFloat &&
              v_glob.scalar_type() == at::kFloat && k_glob.stride(2) == 1 && v_glob.stride(2) == 1,
              "depth-1 pools: the pools' shape, float32, contiguous rows");
}

// Huginn's RoPE (layers.py apply_rope, interleaved): each pair (2j, 2j + 1) of a row rotated as a complex number by
// (cos_j, sin_j) with torch's complex product's roundings - re = a c - b s, im = a s + b c, each product rounded,
// then the difference or sum (ATen's vectorized complex multiply; the build has no FMA contraction).
at::Tensor rope_pairs(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return rope_rows(x, cos, sin, true, "rope_pairs", [](const float* xr, const float* c, const float* s, float* o,
                                                       int64_t D) {
    for (int64_t j = 0; j < D / 2; ++j) {
      const float re = xr[2 * j], im = xr[2 * j + 1];
      const float ac = re * c[j], bd = im * s[j], ad = re * s[j], bc = im * c[j];
      o[2 * j] = ac - bd;
      o[2 * j + 1] = ad + bc;
    }
  });
}

// The RoPE attention_rows applies, by its operands' width: (cat(cos, cos), cat(sin, sin)) [M, hd] rotate halves
// (rope_half), (cos, sin) [M, hd / 2] rotate pairs (rope_pairs, Huginn's).
static at::Tensor rope(const at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin, int64_t hd) {
  const int64_t M = qk.size(1), cols = cos.dim() ? cos.size(-1) : 0;
  TORCH_CHECK(cos.dim() >= 1 && cos.sizes() == sin.sizes() && cos.size(0) == M && cos.numel() == M * cols &&
              (cols == hd || 2 * cols == hd), "RoPE operands [M, hd] (halves) or [M, hd / 2] (pairs), a row per row");
  return cols == hd ? rope_half(qk, cos, sin) : rope_pairs(qk, cos, sin);
}

// layers.py's Attention.forward on rows the row kernel takes (no q/k norm; either RoPE form; with the prefix pools,
// a draft's read of the verified prefix at another depth).  x [M, d] -> [M, d].
at::Tensor attention_rows(const at::Tensor& x, const at::Tensor& wqkv, const at::Tensor& wproj,
                          const std::optional<at::Tensor>& qk_bias, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& store_at,
                          const at::Tensor& rows, const at::Tensor& starts, const at::Tensor& lengths, double scale,
                          int64_t H, int64_t Hkv, const std::optional<at::Tensor>& k_prefix,
                          const std::optional<at::Tensor>& v_prefix, const std::optional<at::Tensor>& prefix_lengths) {
  // every shape and dtype check before the first write into the pool (the prefix pools': rows_attention's, which
  // reads and writes nothing before them)
  check_attention(x, wqkv, wproj, k_pool, v_pool, H, Hkv);
  TORCH_CHECK(k_prefix.has_value() == v_prefix.has_value() && k_prefix.has_value() == prefix_lengths.has_value(),
              "k_prefix, v_prefix and prefix_lengths together");
  if (k_prefix.has_value()) check_prefix(*k_prefix, *v_prefix, *prefix_lengths, k_pool, v_pool, x.size(0));
  const int64_t M = x.size(0);
  auto qkv = dasspec::linear(x, wqkv, std::nullopt);
  TORCH_CHECK(qkv.size(1) % (H + 2 * Hkv) == 0, "projection width");
  const int64_t hd = qkv.size(1) / (H + 2 * Hkv);
  TORCH_CHECK(!qk_bias.has_value() || (Hkv == H && qk_bias->numel() == 2 * H * hd), "q/k bias [2, H, hd]");
  TORCH_CHECK(k_pool.dim() == 3 && v_pool.dim() == 3 && k_pool.size(0) == Hkv && k_pool.size(2) == hd &&
              v_pool.size(0) == Hkv && v_pool.size(2) == hd && store_at.numel() == M && starts.numel() == M &&
              lengths.numel() == M, "pools [H_kv, rows, hd], one store row, start and length per row");
  auto heads = qkv.view({1, M, H + 2 * Hkv, hd});
  auto qk = heads.narrow(2, 0, H + Hkv);
  if (qk_bias.has_value()) qk = qk + qk_bias->view({2 * H, hd});
  qk = rope(qk, cos, sin, hd);
  store_rows(k_pool, v_pool, store_at, qk[0].narrow(1, H, Hkv).transpose(0, 1),
             heads[0].narrow(1, H + Hkv, Hkv).transpose(0, 1));
  auto y = rows_attention(qk[0].narrow(1, 0, H), k_pool, v_pool, rows, starts, lengths, scale, k_prefix, v_prefix,
                          prefix_lengths);
  return dasspec::linear(y.view({M, H * hd}), wproj, std::nullopt);
}

// IQuest-Loop's attention at depths >= 2 (families/iquest.py LoopCoderBlock.mixed, op for op): the projections,
// RoPE and the depth's own K/V stores as attention_rows; the gate sigmoid(q . w_h + b_h) as one product by the
// block-diagonal gate weight [H, H * hd]; attention over depth 1's K/V (glob_*) and over the depth's own rows in the
// window (the local row lists); g * global + (1 - g) * local; the output product.  x [M, d] -> [M, d].
at::Tensor loop_mix_rows(const at::Tensor& x, const at::Tensor& wqkv, const at::Tensor& wproj,
                         const std::optional<at::Tensor>& qk_bias, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& store_at,
                         const at::Tensor& rows, const at::Tensor& starts, const at::Tensor& lengths, double scale,
                         int64_t H, int64_t Hkv, const at::Tensor& k_glob, const at::Tensor& v_glob,
                         const at::Tensor& glob_rows, const at::Tensor& glob_starts, const at::Tensor& glob_lengths,
                         const at::Tensor& gate_w, const at::Tensor& gate_b) {
  check_attention(x, wqkv, wproj, k_pool, v_pool, H, Hkv);
  const int64_t M = x.size(0);
  const int64_t hd = wqkv.size(0) / (H + 2 * Hkv);
  check_gate(gate_w, gate_b, k_glob, v_glob, k_pool, H, hd);
  TORCH_CHECK(glob_starts.numel() == M && glob_lengths.numel() == M, "a depth-1 start and length per row");
  TORCH_CHECK(!qk_bias.has_value() || (Hkv == H && qk_bias->numel() == 2 * H * hd), "q/k bias [2, H, hd]");
  TORCH_CHECK(k_pool.dim() == 3 && v_pool.dim() == 3 && k_pool.size(0) == Hkv && k_pool.size(2) == hd &&
              v_pool.size(0) == Hkv && v_pool.size(2) == hd && store_at.numel() == M && starts.numel() == M &&
              lengths.numel() == M, "pools [H_kv, rows, hd], one store row, start and length per row");
  auto qkv = dasspec::linear(x, wqkv, std::nullopt);       // every shape and dtype check above: before the first write
  auto heads = qkv.view({1, M, H + 2 * Hkv, hd});
  auto qk = heads.narrow(2, 0, H + Hkv);
  if (qk_bias.has_value()) qk = qk + qk_bias->view({2 * H, hd});
  qk = rope(qk, cos, sin, hd);
  store_rows(k_pool, v_pool, store_at, qk[0].narrow(1, H, Hkv).transpose(0, 1),
             heads[0].narrow(1, H + Hkv, Hkv).transpose(0, 1));
  auto q = qk[0].narrow(1, 0, H);                          // [M, H, hd]
  auto g = pointwise(dasspec::linear(q.reshape({M, H * hd}), gate_w, gate_b), std::nullopt).unsqueeze(-1);
  auto a = rows_attention(q, k_glob, v_glob, glob_rows, glob_starts, glob_lengths, scale, std::nullopt,
                          std::nullopt, std::nullopt);
  auto b = rows_attention(q, k_pool, v_pool, rows, starts, lengths, scale, std::nullopt, std::nullopt, std::nullopt);
  auto y = g * a + (1 - g) * b;
  return dasspec::linear(y.view({M, H * hd}), wproj, std::nullopt);
}

// layers.py's GatedMLP.forward: fc, silu(gate) * up, proj.
at::Tensor mlp_rows(const at::Tensor& x, const at::Tensor& wfc, const at::Tensor& wproj) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), "x [M, d]: float32, CPU");
  auto gate_up = dasspec::linear(x, wfc, std::nullopt).chunk(2, -1);
  return dasspec::linear(pointwise(gate_up[0], gate_up[1]), wproj, std::nullopt);
}

// Ouro's layer (families/ouro.py PeriNormBlock: x + n2(attn(n1 x)), then that + n4(mlp(n3 of it))).
at::Tensor peri_layer_rows(const at::Tensor& x, const std::vector<at::Tensor>& norms, double eps,
                           const at::Tensor& wqkv, const at::Tensor& wproj, const std::optional<at::Tensor>& qk_bias,
                           const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_pool,
                           const at::Tensor& v_pool, const at::Tensor& store_at, const at::Tensor& rows,
                           const at::Tensor& starts, const at::Tensor& lengths, double scale, int64_t H, int64_t Hkv,
                           const at::Tensor& wfc, const at::Tensor& wdown, const std::optional<at::Tensor>& k_prefix,
                           const std::optional<at::Tensor>& v_prefix,
                           const std::optional<at::Tensor>& prefix_lengths) {
  check_layer(x, norms, 4, wqkv, wproj, k_pool, v_pool, H, Hkv, wfc, wdown);
  auto a = attention_rows(rms_norm(x, norms[0], eps), wqkv, wproj, qk_bias, cos, sin, k_pool, v_pool, store_at, rows,
                          starts, lengths, scale, H, Hkv, k_prefix, v_prefix, prefix_lengths);
  auto h = x + rms_norm(a, norms[1], eps);
  return h + rms_norm(mlp_rows(rms_norm(h, norms[2], eps), wfc, wdown), norms[3], eps);
}

// Huginn's layer (families/huginn.py SandwichBlock: n2(x + attn(n1 x)), then n4(that + mlp(n3 of it))).
at::Tensor sandwich_layer_rows(const at::Tensor& x, const std::vector<at::Tensor>& norms, double eps,
                               const at::Tensor& wqkv, const at::Tensor& wproj,
                               const std::optional<at::Tensor>& qk_bias, const at::Tensor& cos, const at::Tensor& sin,
                               const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& store_at,
                               const at::Tensor& rows, const at::Tensor& starts, const at::Tensor& lengths,
                               double scale, int64_t H, int64_t Hkv, const at::Tensor& wfc, const at::Tensor& wdown,
                               const std::optional<at::Tensor>& k_prefix, const std::optional<at::Tensor>& v_prefix,
                               const std::optional<at::Tensor>& prefix_lengths) {
  check_layer(x, norms, 4, wqkv, wproj, k_pool, v_pool, H, Hkv, wfc, wdown);
  auto h = rms_norm(x + attention_rows(rms_norm(x, norms[0], eps), wqkv, wproj, qk_bias, cos, sin, k_pool, v_pool,
                                       store_at, rows, starts, lengths, scale, H, Hkv, k_prefix, v_prefix,
                                       prefix_lengths), norms[1], eps);
  return rms_norm(h + mlp_rows(rms_norm(h, norms[2], eps), wfc, wdown), norms[3], eps);
}

// Llama's layer (families/raven.py PreNormBlock: x + attn(n1 x), then that + mlp(n2 of it)).
at::Tensor pre_layer_rows(const at::Tensor& x, const std::vector<at::Tensor>& norms, double eps,
                          const at::Tensor& wqkv, const at::Tensor& wproj, const std::optional<at::Tensor>& qk_bias,
                          const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_pool,
                          const at::Tensor& v_pool, const at::Tensor& store_at, const at::Tensor& rows,
                          const at::Tensor& starts, const at::Tensor& lengths, double scale, int64_t H, int64_t Hkv,
                          const at::Tensor& wfc, const at::Tensor& wdown, const std::optional<at::Tensor>& k_prefix,
                          const std::optional<at::Tensor>& v_prefix, const std::optional<at::Tensor>& prefix_lengths) {
  check_layer(x, norms, 2, wqkv, wproj, k_pool, v_pool, H, Hkv, wfc, wdown);
  auto h = x + attention_rows(rms_norm(x, norms[0], eps), wqkv, wproj, qk_bias, cos, sin, k_pool, v_pool, store_at,
                              rows, starts, lengths, scale, H, Hkv, k_prefix, v_prefix, prefix_lengths);
  return h + mlp_rows(rms_norm(h, norms[1], eps), wfc, wdown);
}

// Core steps of a call's rows (looped.py core_step): each step, with an injection (Huginn's), the adapter over
// concat[x, inj] first; then the layers - "peri" (Ouro's, four norms each), "pre" (Llama's, two: Nanbeige's) or
// "sandwich" (Huginn's, four); then ln_f where given (a family that norms every step).  Layer i of step s stores into
// and reads k_pools / v_pools[s * L + i].
at::Tensor recur_rows(at::Tensor x, int64_t steps, const std::string& style, const std::vector<at::Tensor>& norms,
                      const std::vector<double>& eps, const std::vector<at::Tensor>& wqkv,
                      const std::vector<at::Tensor>& wproj, const std::vector<std::optional<at::Tensor>>& qk_bias,
                      const at::Tensor& cos, const at::Tensor& sin, const std::vector<at::Tensor>& k_pools,
                      const std::vector<at::Tensor>& v_pools, const at::Tensor& store_at, const at::Tensor& rows,
                      const at::Tensor& starts, const at::Tensor& lengths, double scale, int64_t H, int64_t Hkv,
                      const std::vector<at::Tensor>& wfc, const std::vector<at::Tensor>& wdown,
                      const std::optional<at::Tensor>& ln_w, double ln_eps, const std::optional<at::Tensor>& inj,
                      const std::optional<at::Tensor>& adapter_w,
                      const std::vector<std::optional<at::Tensor>>& k_prefix_pools,
                      const std::vector<std::optional<at::Tensor>>& v_prefix_pools,
                      const std::optional<at::Tensor>& prefix_lengths) {
  TORCH_CHECK(style == "peri" || style == "pre" || style == "sandwich", "style: peri, pre or sandwich");
  const int64_t per = style == "pre" ? 2 : 4;
  const auto layer = style == "peri" ? peri_layer_rows : style == "pre" ? pre_layer_rows : sandwich_layer_rows;
  const int64_t L = static_cast<int64_t>(wqkv.size());
  TORCH_CHECK(steps > 0 && L > 0, "at least one step and one layer");
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == per * L && static_cast<int64_t>(eps.size()) == L &&
              static_cast<int64_t>(wproj.size()) == L && static_cast<int64_t>(qk_bias.size()) == L &&
              static_cast<int64_t>(wfc.size()) == L && static_cast<int64_t>(wdown.size()) == L &&
              static_cast<int64_t>(k_pools.size()) == steps * L && static_cast<int64_t>(v_pools.size()) == steps * L,
              "the style's norms, an eps and four weights per layer; a K and a V pool per step and layer");
  TORCH_CHECK(x.dim() == 2, "x [M, d]");
  const int64_t d = x.size(1);
  if (ln_w.has_value())
    TORCH_CHECK(ln_w->dim() == 1 && ln_w->size(0) == d && ln_w->scalar_type() == at::kFloat && ln_w->device().is_cpu(),
                "ln_f weight [d]: float32, CPU");
  TORCH_CHECK(inj.has_value() == adapter_w.has_value(), "inj and the adapter's weight together");
  at::Tensor xe;                                  // [x, inj]: inj's half written once, x's each step
  if (inj.has_value()) {
    TORCH_CHECK(inj->sizes() == x.sizes() && inj->scalar_type() == at::kFloat && inj->device().is_cpu(),
                "inj [M, d], float32, CPU");
    TORCH_CHECK(adapter_w->dim() == 2 && adapter_w->size(0) == d && adapter_w->size(1) == 2 * d &&
                adapter_w->scalar_type() == at::kFloat && adapter_w->device().is_cpu(), "adapter weight [d, 2 d]");
    xe = at::empty({x.size(0), 2 * d}, x.options());
    xe.narrow(1, d, d).copy_(*inj);
  }
  // the first layer's shapes and dtypes, then every layer and step as the first, checked before the first layer
  // writes into a pool
  check_norms(x, norms);
  check_attention(x, wqkv[0], wproj[0], k_pools[0], v_pools[0], H, Hkv);
  check_mlp(x, wfc[0], wdown[0]);
  check_like_first(wqkv, wproj, wfc, wdown, k_pools, v_pools);
  const bool two = !k_prefix_pools.empty();
  TORCH_CHECK(k_prefix_pools.size() == v_prefix_pools.size() && (!two || static_cast<int64_t>(
              k_prefix_pools.size()) == steps * L) && two == prefix_lengths.has_value(),
              "prefix pools: none, or a K and a V per step and layer, with the prefix counts");
  for (size_t p = 0; p < k_prefix_pools.size(); ++p) {   // as attention_rows checks them, before any write
    TORCH_CHECK(k_prefix_pools[p].has_value() && v_prefix_pools[p].has_value(), "a K and a V prefix pool per step "
                "and layer");
    check_prefix(*k_prefix_pools[p], *v_prefix_pools[p], *prefix_lengths, k_pools[0], v_pools[0], x.size(0));
  }
  const auto own = per_layer(norms, per);
  for (int64_t s = 0; s < steps; ++s) {
    if (inj.has_value()) {
      xe.narrow(1, 0, d).copy_(x);
      x = dasspec::linear(xe, *adapter_w, std::nullopt);
    }
    for (int64_t i = 0; i < L; ++i) {
      x = layer(x, own[i], eps[i], wqkv[i], wproj[i], qk_bias[i], cos, sin, k_pools[s * L + i], v_pools[s * L + i],
                store_at, rows, starts, lengths, scale, H, Hkv, wfc[i], wdown[i],
                two ? k_prefix_pools[s * L + i] : std::nullopt, two ? v_prefix_pools[s * L + i] : std::nullopt,
                prefix_lengths);
    }
    if (ln_w.has_value()) x = rms_norm(x, *ln_w, ln_eps);
  }
  return x;
}

// IQuest-Loop's loops over a call's rows (families/iquest.py IQuestLoop.recur_rows: core_step's layer calls, no norm
// between loops): step s computes depth first + s - at depth 1 Llama's layers (pre_layer_rows), past it the mixed
// attention's (x + loop_mix_rows(n1 x), then that + mlp(n2 of it)).  Layer i of step s stores into and reads
// k_pools / v_pools[s * L + i] through step s's store rows and row lists (depth 1's causal lists, a later depth's
// windowed ones); a mixed layer reads depth 1 from k_glob / v_glob[i] through the glob lists.
at::Tensor loop_recur_rows(at::Tensor x, int64_t first, const std::vector<at::Tensor>& norms,
                           const std::vector<double>& eps, const std::vector<at::Tensor>& wqkv,
                           const std::vector<at::Tensor>& wproj,
                           const std::vector<std::optional<at::Tensor>>& qk_bias, const at::Tensor& cos,
                           const at::Tensor& sin, const std::vector<at::Tensor>& k_pools,
                           const std::vector<at::Tensor>& v_pools, const std::vector<at::Tensor>& store_at,
                           const std::vector<at::Tensor>& rows, const std::vector<at::Tensor>& starts,
                           const std::vector<at::Tensor>& lengths, double scale, int64_t H, int64_t Hkv,
                           const std::vector<at::Tensor>& wfc, const std::vector<at::Tensor>& wdown,
                           const std::vector<at::Tensor>& k_glob, const std::vector<at::Tensor>& v_glob,
                           const at::Tensor& glob_rows, const at::Tensor& glob_starts,
                           const at::Tensor& glob_lengths, const std::vector<at::Tensor>& gate_w,
                           const std::vector<at::Tensor>& gate_b) {
  const int64_t L = static_cast<int64_t>(wqkv.size()), steps = static_cast<int64_t>(store_at.size());
  TORCH_CHECK(first >= 1 && steps > 0 && L > 0, "a first depth >= 1, at least one step and one layer");
  auto n = [](const auto& v) { return static_cast<int64_t>(v.size()); };
  TORCH_CHECK(n(norms) == 2 * L && n(eps) == L && n(wproj) == L && n(qk_bias) == L && n(wfc) == L && n(wdown) == L &&
              n(k_glob) == L && n(v_glob) == L && n(gate_w) == L && n(gate_b) == L, "two norms, an eps and the "
              "weights, depth 1's pools and the gate per layer");
  TORCH_CHECK(n(k_pools) == steps * L && n(v_pools) == steps * L && n(rows) == steps && n(starts) == steps &&
              n(lengths) == steps, "a K and a V pool per step and layer; store rows and row lists per step");
  // the first layer's shapes and dtypes, every layer's gate and depth-1 pools, then every layer and step as the
  // first: all checked before the first layer writes into a pool
  check_attention(x, wqkv[0], wproj[0], k_pools[0], v_pools[0], H, Hkv);
  check_norms(x, norms);
  check_mlp(x, wfc[0], wdown[0]);
  for (int64_t i = 0; i < L; ++i)
    check_gate(gate_w[i], gate_b[i], k_glob[i], v_glob[i], k_pools[0], H, wqkv[0].size(0) / (H + 2 * Hkv));
  TORCH_CHECK(glob_starts.numel() == x.size(0) && glob_lengths.numel() == x.size(0),
              "a depth-1 start and length per row");
  check_like_first(wqkv, wproj, wfc, wdown, k_pools, v_pools);     // (each gate checked above)
  for (int64_t s = 0; s < steps; ++s)
    TORCH_CHECK(store_at[s].numel() == x.size(0) && starts[s].numel() == x.size(0) &&
                lengths[s].numel() == x.size(0), "a store row, start and length per row at every step");
  const auto norm = per_layer(norms, 2);
  for (int64_t s = 0; s < steps; ++s) {
    for (int64_t i = 0; i < L; ++i) {
      const auto& own = norm[i];
      const auto &kp = k_pools[s * L + i], &vp = v_pools[s * L + i];
      if (first + s == 1) {
        x = pre_layer_rows(x, own, eps[i], wqkv[i], wproj[i], qk_bias[i], cos, sin, kp, vp, store_at[s], rows[s],
                           starts[s], lengths[s], scale, H, Hkv, wfc[i], wdown[i], std::nullopt, std::nullopt,
                           std::nullopt);
        continue;
      }
      auto h = x + loop_mix_rows(rms_norm(x, own[0], eps[i]), wqkv[i], wproj[i], qk_bias[i], cos, sin, kp, vp,
                                 store_at[s], rows[s], starts[s], lengths[s], scale, H, Hkv, k_glob[i], v_glob[i],
                                 glob_rows, glob_starts, glob_lengths, gate_w[i], gate_b[i]);
      x = h + mlp_rows(rms_norm(h, own[1], eps[i]), wfc[i], wdown[i]);
    }
  }
  return x;
}

}  // namespace dasspec
