// The arithmetic of every CPU kernel, written once in GCC / Clang vector extensions and compiled once per
// instruction set (cpu_kernels.cpp includes this file inside a namespace per ISA, under that ISA's target).
//
// Every value is a function of its own row alone, in an order fixed by that row's length:
//  * a product's output (m, n) is sum_k x[m, k] w[n, k] as 16 lanes (lane l: an FMA chain over k = l, l + 16, ...
//    from zero, the tail lanes fed zeros), then the lanes added in a fixed tree (l + l + 8, + 4, + 2, + 1);
//  * attention's scores, softmax and weighted sums run over a query's own key list in order;
//  * a norm's sum of squares is a 16-lane dot product in the same tree.
// The lanes are 16 whatever the registers are (one AVX-512 register, two AVX2 ones, scalars on the portable
// path), the build has -ffp-contract=off (no FMA the source does not write) and an FMA is one rounding on every
// path, so the three paths give the same bits.  Work is split over threads by rows and outputs, never along a sum.
// Needs: <cstdint>, <cstring>, <algorithm>, <cmath>, <limits>, <type_traits>, <immintrin.h> (x86) before the
// include, and DASSPEC_ISA_AVX512 / DASSPEC_ISA_AVX2 / neither defined.

typedef float f16v __attribute__((vector_size(16 * sizeof(float))));
typedef float f8v __attribute__((vector_size(8 * sizeof(float))));
typedef float f4v __attribute__((vector_size(4 * sizeof(float))));
typedef float f2v __attribute__((vector_size(2 * sizeof(float))));
typedef int32_t i16v __attribute__((vector_size(16 * sizeof(int32_t))));
constexpr int LANES = 16;

#define DASSPEC_INLINE inline __attribute__((always_inline))

DASSPEC_INLINE f16v load16(const float* p) {
  f16v v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

DASSPEC_INLINE f16v load_tail(const float* p, int64_t n) {      // n < 16 values, zeros after
  f16v v = {};
#pragma GCC unroll 16
  for (int l = 0; l < LANES; ++l) v[l] = l < n ? p[l] : 0.0f;    // no memcpy call: a call spills every register
  return v;
}

// The fixed tree: lanes l and l + n/2 added, level by level.
DASSPEC_INLINE float tree_sum(f16v x) {
  const f8v a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  const f4v b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const f2v c = __builtin_shufflevector(b, b, 0, 1) + __builtin_shufflevector(b, b, 2, 3);
  return c[0] + c[1];
}

// r[j] = tree_sum(a[j]) for 16 vectors at once: the same additions (each level adds lane l and l + n/2 of one
// vector), with the vectors interleaved so that every addition is a full-width one.
DASSPEC_INLINE f16v tree_sum16(const f16v* a) {
  f16v b[8], c[4], d[2];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j)
    b[j] = __builtin_shufflevector(a[2 * j], a[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * j], a[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                   31);
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j)
    c[j] = __builtin_shufflevector(b[2 * j], b[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * j], b[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                   31);
#pragma GCC unroll 2
  for (int j = 0; j < 2; ++j)
    d[j] = __builtin_shufflevector(c[2 * j], c[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(c[2 * j], c[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                   31);
  return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// ---- the product --------------------------------------------------------------------------------------------
// A 16-lane accumulator in this ISA's registers: acc + a * b with one rounding per lane.
#if defined(DASSPEC_ISA_AVX512)
typedef __m512 Acc;
DASSPEC_INLINE Acc acc_zero() { return _mm512_setzero_ps(); }
DASSPEC_INLINE Acc acc_load(const float* p) { return _mm512_loadu_ps(p); }
DASSPEC_INLINE Acc acc_load_tail(const float* p, int64_t n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}
DASSPEC_INLINE Acc acc_load(const c10::BFloat16* p) {       // bfloat16 -> float32 is exact: the bits, shifted
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
DASSPEC_INLINE Acc acc_fma(Acc a, Acc b, Acc c) { return _mm512_fmadd_ps(a, b, c); }
DASSPEC_INLINE f16v acc_lanes(Acc a) { return (f16v)a; }
constexpr int MG = 4;                                // rows of x per register block
constexpr int NR_OF[5] = {0, 16, 8, 4, 4};           // rows of w per block, by rows of x
constexpr int MW = 8, NW = 2;                        // the wide block: up to 8 rows of x against 2 of w
#elif defined(DASSPEC_ISA_AVX2)
struct Acc { __m256 lo, hi; };
DASSPEC_INLINE Acc acc_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
DASSPEC_INLINE Acc acc_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
DASSPEC_INLINE Acc acc_load(const c10::BFloat16* p) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(w)), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(w, 1)), 16))};
}
DASSPEC_INLINE Acc acc_fma(Acc a, Acc b, Acc c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
DASSPEC_INLINE f16v acc_lanes(Acc a) {
  f16v v;
  std::memcpy(&v, &a.lo, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &a.hi, 32);
  return v;
}
// bfloat16 -> float32 of 8 values (exact), and float32's 8: the half of a 16-lane vector a register holds.
DASSPEC_INLINE __m256 half_load(const float* p) { return _mm256_loadu_ps(p); }
DASSPEC_INLINE __m256 half_load(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
DASSPEC_INLINE __m256 half_load_tail(const float* p, int64_t n) {    // lanes >= n (n may be <= 0): zeros, not read
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::max<int64_t>(n, 0))),
                                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}
DASSPEC_INLINE __m256 half_load_tail(const c10::BFloat16* p, int64_t n) {
  const uint16_t* q = reinterpret_cast<const uint16_t*>(p);
  uint16_t t[8];
#pragma GCC unroll 8
  for (int l = 0; l < 8; ++l) t[l] = l < n ? q[l] : 0;
  return half_load(reinterpret_cast<const c10::BFloat16*>(t));
}
// tree_sum of up to 8 accumulators at once, the same additions interleaved (lanes l + l + 8 of each: lo + hi; then
// l + l + 4 across two accumulators' 128-bit halves, l + l + 2 and l + l + 1 within 128-bit lanes).
DASSPEC_INLINE void tree_sum8(const Acc* a, int count, float* r) {
  __m256 s[8], t[4], u[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) s[i] = i < count ? _mm256_add_ps(a[i].lo, a[i].hi) : _mm256_setzero_ps();
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j)
    t[j] = _mm256_add_ps(_mm256_permute2f128_ps(s[2 * j], s[2 * j + 1], 0x20),
                         _mm256_permute2f128_ps(s[2 * j], s[2 * j + 1], 0x31));
#pragma GCC unroll 2
  for (int j = 0; j < 2; ++j)
    u[j] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * j], t[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(t[2 * j], t[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 v = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  float f[8];
  _mm256_storeu_ps(f, v);                            // s0, s2, s4, s6, s1, s3, s5, s7
#pragma GCC unroll 8
  for (int i = 0; i < count; ++i) r[i] = f[(i & 1) * 4 + (i >> 1)];
}
constexpr int MG = 3;                                // 3 x 2 accumulators of two registers, a half at a time
constexpr int NR_OF[5] = {0, 4, 2, 2, 2};
constexpr int MW = MG, NW = 2;                       // no wide block: 16 registers
#else
typedef f16v Acc;
DASSPEC_INLINE Acc acc_zero() { return f16v{}; }
DASSPEC_INLINE Acc acc_load(const float* p) { return load16(p); }
DASSPEC_INLINE Acc acc_load_tail(const float* p, int64_t n) { return load_tail(p, n); }
DASSPEC_INLINE Acc acc_load(const c10::BFloat16* p) {
  f16v v;
  for (int l = 0; l < LANES; ++l) v[l] = static_cast<float>(p[l]);
  return v;
}
DASSPEC_INLINE Acc acc_fma(Acc a, Acc b, Acc c) {
  f16v r;
  for (int l = 0; l < LANES; ++l) r[l] = __builtin_fmaf(a[l], b[l], c[l]);
  return r;
}
DASSPEC_INLINE f16v acc_lanes(Acc a) { return a; }
constexpr int MG = 4;
constexpr int NR_OF[5] = {0, 4, 2, 2, 2};
constexpr int MW = MG, NW = 2;
#endif
constexpr int64_t WIDE_K_MIN = 1024, WIDE_K_MAX = 4096;   // the wide block's rows: longer than MIN, at most MAX

DASSPEC_INLINE Acc acc_load_tail(const c10::BFloat16* p, int64_t n) {
  const uint16_t* q = reinterpret_cast<const uint16_t*>(p);
  uint16_t t[LANES];
#pragma GCC unroll 16
  for (int l = 0; l < LANES; ++l) t[l] = l < n ? q[l] : 0;        // (no memcpy call, as load_tail)
  return acc_load(reinterpret_cast<const c10::BFloat16*>(t));
}

#if defined(DASSPEC_ISA_AVX2)
// One k-step of an MR x NR block on AVX2, 8 lanes of every accumulator at a time (the low halves, then the high
// ones: each its own FMA chain, so the sums are the same): 3 x 2 accumulators, the weight's half-vectors and one of
// x fit the 16 registers, and each value is loaded once.  TAIL: the last step, rem < 16 values (zeros after them).
template <int MR, int NR, bool TAIL, typename T>
DASSPEC_INLINE void half_k_step(const T* const* xr, const T* const* wr, int64_t k, int64_t rem, Acc* acc) {
#pragma GCC unroll 2
  for (int h = 0; h < LANES; h += 8) {
    __m256 wv[NR];
#pragma GCC unroll 16
    for (int n = 0; n < NR; ++n) wv[n] = TAIL ? half_load_tail(wr[n] + k + h, rem - h) : half_load(wr[n] + k + h);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      __m256 xv = TAIL ? half_load_tail(xr[m] + k + h, rem - h) : half_load(xr[m] + k + h);
      asm("" : "+x"(xv));                  // in a register: not read again by each FMA from memory
#pragma GCC unroll 16
      for (int n = 0; n < NR; ++n) {
        Acc& a = acc[m * NR + n];
        if (h == 0) a.lo = _mm256_fmadd_ps(xv, wv[n], a.lo);
        else a.hi = _mm256_fmadd_ps(xv, wv[n], a.hi);
      }
    }
  }
}
#endif

// One k-step of an MR x NR block: the wide block holds the weight's vectors and loads x row by row, the others hold
// x's.  TAIL: the last step, rem < 16 values (zeros after them).
template <int MR, int NR, bool TAIL, typename T>
DASSPEC_INLINE void k_step(const T* const* xr, const T* const* wr, int64_t k, int64_t rem, Acc* acc) {
#if defined(DASSPEC_ISA_AVX2)
  half_k_step<MR, NR, TAIL>(xr, wr, k, rem, acc);
#else
  if constexpr (MR == MW && MW > MG && !TAIL) {
    Acc wv[NR];
#pragma GCC unroll 16
    for (int n = 0; n < NR; ++n) wv[n] = acc_load(wr[n] + k);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const Acc xv = acc_load(xr[m] + k);
#pragma GCC unroll 16
      for (int n = 0; n < NR; ++n) acc[m * NR + n] = acc_fma(xv, wv[n], acc[m * NR + n]);
    }
  } else {
    Acc xv[MR];
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) xv[m] = TAIL ? acc_load_tail(xr[m] + k, rem) : acc_load(xr[m] + k);
#pragma GCC unroll 16
    for (int n = 0; n < NR; ++n) {
      const Acc wv = TAIL ? acc_load_tail(wr[n] + k, rem) : acc_load(wr[n] + k);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) acc[m * NR + n] = acc_fma(xv[m], wv, acc[m * NR + n]);
    }
  }
#endif
}

// out[m, n] (m < mr, n < nr) of x rows [mr, K] (stride ldx) and w rows [nr, K] (stride ldw): an MR x NR block of
// accumulators; rows past mr / nr repeat the last one (computed, not stored).
// bfloat16 rows are widened exactly and summed in float32 like float32 rows; the output is rounded once (to nearest
// even) after the bias.
// pf > 0: the rows pf elements further on (a later chunk's) are fetched into the L2 cache meanwhile, one line per
// row on every pf_period-th k-step from pf_phase - a weight that comes from memory then arrives while this chunk
// computes (only a fetch: no bit of the arithmetic depends on it).
// The small loops are unrolled early (``#pragma GCC unroll``) and no load calls a function, so the accumulators stay
// in registers from the first step to the sums (else the compiler keeps them on the stack around the loop).
template <int MR, int NR, typename T>
DASSPEC_INLINE void gemm_tile(const T* x, int64_t ldx, const T* w, int64_t ldw, int64_t K, T* out,
                              int64_t ldo, int mr, int nr, const T* bias, int64_t pf, int64_t pf_period,
                              int64_t pf_phase) {
  const T* xr[MR];
  const T* wr[NR];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) xr[m] = x + std::min(m, mr - 1) * ldx;
#pragma GCC unroll 16
  for (int n = 0; n < NR; ++n) wr[n] = w + std::min(n, nr - 1) * ldw;
  Acc acc[MR * NR];
#pragma GCC unroll 16
  for (int i = 0; i < MR * NR; ++i) acc[i] = acc_zero();
  int64_t k = 0;
  for (int64_t turn = 0; k + LANES <= K; k += LANES, turn = turn + 1 == pf_period ? 0 : turn + 1) {
    if (pf && turn == pf_phase) {
#pragma GCC unroll 16
      for (int n = 0; n < NR; ++n) __builtin_prefetch(wr[n] + pf + k, 0, 2);
    }
    k_step<MR, NR, false>(xr, wr, k, LANES, acc);
  }
  if (k < K) k_step<MR, NR, true>(xr, wr, k, K - k, acc);
#if defined(DASSPEC_ISA_AVX2)
  if constexpr (MR * NR <= 8) {
    float r[8];
    tree_sum8(acc, MR * NR, r);
    for (int m = 0; m < mr; ++m)
      for (int n = 0; n < nr; ++n)
        out[m * ldo + n] = static_cast<T>(bias ? r[m * NR + n] + static_cast<float>(bias[n]) : r[m * NR + n]);
    return;
  }
#endif
  if constexpr (MR * NR == 16) {
    f16v lanes[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) lanes[i] = acc_lanes(acc[i]);
    const f16v r = tree_sum16(lanes);
    for (int m = 0; m < mr; ++m)
      for (int n = 0; n < nr; ++n)
        out[m * ldo + n] = static_cast<T>(bias ? r[m * NR + n] + static_cast<float>(bias[n]) : r[m * NR + n]);
  } else {
    for (int m = 0; m < mr; ++m)
      for (int n = 0; n < nr; ++n) {
        const float s = tree_sum(acc_lanes(acc[m * NR + n]));
        out[m * ldo + n] = static_cast<T>(bias ? s + static_cast<float>(bias[n]) : s);
      }
  }
}

template <int MR, int NR, typename T>
inline void gemm_rows(const T* x, int64_t ldx, int mr, const T* w, int64_t ldw, int64_t n0, int64_t n1,
                      int64_t K, T* out, int64_t ldo, const T* bias, int64_t pf, int64_t pf_period,
                      int64_t pf_phase) {
  for (int64_t n = n0; n < n1; n += NR) {
    const int nr = static_cast<int>(std::min<int64_t>(NR, n1 - n));
    gemm_tile<MR, NR, T>(x, ldx, w + n * ldw, ldw, K, out + n, ldo, mr, nr, bias ? bias + n : nullptr, pf,
                         pf_period, pf_phase);
  }
}

// Rows [m0, m1) of x times w rows [n0, n1): a chunk of weight rows that fits the L1 cache beside MG rows of x
// against every row of x (in register blocks of MG rows, then the rows left), chunk after chunk.  Fewer rows of x
// than MG (a decode step) stream the weight in chunks of 16 rows.  MG + 1 to MW float32 rows of WIDE_K_MIN / MAX's
// lengths (a batch's decode step on a mid-size model, its weight read from memory once) are one block of MW rows
// against NW weight rows where the ISA has the registers for it: each weight vector is loaded once instead of once
// per block of MG rows (where it pays: docs/performance-journal.md, "Products at 5-8 rows").  While a chunk
// computes, a later chunk's weight rows are fetched into L2, the fetches spread evenly over the chunk's blocks of x
// rows (a block reads few weight rows at a time: a weight coming from memory, not a cache, would otherwise leave the
// memory idle between blocks).  A block changes which values share
// registers, never an output's sum: every path gives the same bits.
template <typename T>
inline void gemm_block(const T* x, int64_t ldx, int64_t m0, int64_t m1, const T* w, int64_t ldw, int64_t n0,
                       int64_t n1, int64_t K, T* out, int64_t ldo, const T* bias) {
  constexpr bool has_wide = MW > MG && std::is_same_v<T, float>;    // compiled only where it can be taken
  const bool wide = has_wide && m1 - m0 > MG && m1 - m0 <= MW && K > WIDE_K_MIN && K <= WIDE_K_MAX;
  const int64_t NC = m1 - m0 < MG ? 16
                     : wide      ? 8
                                 : std::max<int64_t>(4, std::min<int64_t>(32, 7168 / K - MG) & ~int64_t(3));
  const int64_t blocks = wide ? 1 : (m1 - m0 + MG - 1) / MG;      // a chunk's fetches spread over its blocks
  for (int64_t c0 = n0; c0 < n1; c0 += NC) {
    const int64_t c1 = std::min(n1, c0 + NC);
    const int64_t pf = c1 < n1 ? (NC * K < 16384 ? 2 : 1) * NC * ldw : 0;    // up to 128 KB ahead
    if constexpr (has_wide) {
      if (wide) {
        gemm_rows<MW, NW, T>(x + m0 * ldx, ldx, static_cast<int>(m1 - m0), w, ldw, c0, c1, K, out + m0 * ldo, ldo,
                             bias, pf, 1, 0);
        continue;
      }
    }
    int64_t m = m0;
    for (; m + MG <= m1; m += MG) {
      const int64_t phase = (m - m0) / MG;
      gemm_rows<MG, NR_OF[MG], T>(x + m * ldx, ldx, MG, w, ldw, c0, c1, K, out + m * ldo, ldo, bias, pf, blocks,
                                  phase);
    }
    const T* xm = x + m * ldx;
    T* om = out + m * ldo;
    const int64_t phase = (m - m0) / MG;
    switch (m1 - m) {
      case 3: gemm_rows<3, NR_OF[3], T>(xm, ldx, 3, w, ldw, c0, c1, K, om, ldo, bias, pf, blocks, phase); break;
      case 2: gemm_rows<2, NR_OF[2], T>(xm, ldx, 2, w, ldw, c0, c1, K, om, ldo, bias, pf, blocks, phase); break;
      case 1: gemm_rows<1, NR_OF[1], T>(xm, ldx, 1, w, ldw, c0, c1, K, om, ldo, bias, pf, blocks, phase); break;
      default: break;
    }
  }
}

// ---- dot products, exp, attention -----------------------------------------------------------------------------
// sum_d q[d] k[d]: 16 lanes (no FMA: a product, then a sum), then the fixed tree.
DASSPEC_INLINE f16v dot_lanes(const float* q, const float* k, int64_t D) {
  f16v part = {};
  int64_t d = 0;
  for (; d + LANES <= D; d += LANES) part += load16(q + d) * load16(k + d);
  if (d < D) part += load_tail(q + d, D - d) * load_tail(k + d, D - d);
  return part;
}

DASSPEC_INLINE float dot(const float* q, const float* k, int64_t D) { return tree_sum(dot_lanes(q, k, D)); }

// exp(x) for x <= 0 of 16 values at once (Cephes' single-precision polynomial, about 2 ulp), in plain vector
// arithmetic, the same operations lane by lane; underflows to 0 below -87.  floor as truncation corrected by one
// below zero (exact here: |y| < 2^23).
DASSPEC_INLINE f16v exp_nonpositive16(f16v x) {
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

inline float to_float(float v) { return v; }
template <typename T> inline float to_float(T v) { return static_cast<float>(v); }

// sigmoid(x) of 16 values: 1 / (1 + exp(-x)) for x >= 0, exp(x) / (1 + exp(x)) below (exp only of values <= 0).
DASSPEC_INLINE f16v sigmoid16(f16v x) {
  const i16v neg = x < 0.0f;
  const f16v e = exp_nonpositive16(neg ? x : f16v{} - x);
  const f16v one = f16v{} + 1.0f;
  return (neg ? e : one) / (one + e);
}

// An elementwise row of n values, 16 lanes at a time (the tail through the same lanes, zeros after it), so that a
// value's bits never depend on where it sits in a call: silu(g) * u (torch's two roundings: the SiLU, then the
// product) or, without u, sigmoid(g).
template <typename T>
inline void pointwise_row(const T* g, const T* u, int64_t n, T* o) {
  float gb[LANES], ub[LANES], ob[LANES];
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {             // whole vectors straight from and to the rows
    for (; i + LANES <= n; i += LANES) {
      const f16v x = load16(g + i);
      const f16v s = sigmoid16(x);
      const f16v r = u ? x * s * load16(u + i) : s;
      std::memcpy(o + i, &r, sizeof r);
    }
  }
  for (; i < n; i += LANES) {
    const int64_t k = std::min<int64_t>(LANES, n - i);
    for (int64_t l = 0; l < LANES; ++l) gb[l] = l < k ? to_float(g[i + l]) : 0.0f;
    const f16v x = load16(gb);
    f16v r = sigmoid16(x);
    if (u) {
      for (int64_t l = 0; l < LANES; ++l) ub[l] = l < k ? to_float(u[i + l]) : 0.0f;
      f16v silu = x * r;
      if constexpr (!std::is_same_v<T, float>) {          // rounded to T before the product, as torch's F.silu is
        for (int l = 0; l < LANES; ++l) silu[l] = to_float(static_cast<T>(silu[l]));
      }
      r = silu * load16(ub);
    }
    std::memcpy(ob, &r, sizeof ob);
    for (int64_t l = 0; l < k; ++l) o[i + l] = static_cast<T>(ob[l]);
  }
}

// One (query, head): softmax(q K^T * scale) V over the key rows rows[0, L), the first Lc of them from (kc, vc) and
// the rest from (ku, vu) - the verified prefix at its read depths, then the call's own rows (one source: the same
// tensors).  Scores, their maximum, the exponentials, their sum and each output lane's weighted sum run over the
// rows in list order.  buf: 3 * D floats; sc: L floats.
template <typename T>
void one_head(const T* q, const T* kc, const T* vc, const T* ku, const T* vu, const int64_t* rows, int64_t L,
              int64_t Lc, int64_t D, int64_t k_row, int64_t v_row, float scale, float* sc, float* buf, T* out) {
  float* qf = buf;
  float* acc = buf + D;
  float* kf = buf + 2 * D;
  for (int64_t d = 0; d < D; ++d) qf[d] = to_float(q[d]) * scale;
  float m = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
  if constexpr (std::is_same_v<T, float>) {        // 16 keys' trees at once (tree_sum16: the same additions)
    for (; j + LANES <= L; j += LANES) {
      f16v parts[LANES];
      for (int t = 0; t < LANES; ++t) parts[t] = dot_lanes(qf, (j + t < Lc ? kc : ku) + rows[j + t] * k_row, D);
      const f16v s = tree_sum16(parts);
      std::memcpy(sc + j, &s, sizeof s);
      for (int t = 0; t < LANES; ++t) m = s[t] > m ? s[t] : m;
    }
  }
  for (; j < L; ++j) {
    const T* kr = (j < Lc ? kc : ku) + rows[j] * k_row;
    float s;
    if constexpr (std::is_same_v<T, float>) {
      s = dot(qf, kr, D);
    } else {
      for (int64_t d = 0; d < D; ++d) kf[d] = to_float(kr[d]);
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
    f16v e = load16(x);
    e = exp_nonpositive16(e - m);
    std::memcpy(sc + j0, &e, n * sizeof(float));
  }
  float total = 0.f;
  for (int64_t j = 0; j < L; ++j) total += sc[j];
  // sum_j p_j v_j, each lane over j in order; a 16-lane slice of the row at a time so its sum stays in a register
  int64_t d0 = 0;
  if constexpr (std::is_same_v<T, float>) {
    // up to 8 slices of 16 lanes in registers, one pass over the value rows for them
    for (; d0 + LANES <= D; d0 += 8 * LANES) {
      const int n = static_cast<int>(std::min<int64_t>(8, (D - d0) / LANES));
      f16v a[8] = {};
      for (int64_t j = 0; j < L; ++j) {
        const float* vr = (j < Lc ? vc : vu) + rows[j] * v_row + d0;
        for (int t = 0; t < n; ++t) a[t] += sc[j] * load16(vr + t * LANES);
      }
      std::memcpy(acc + d0, a, n * sizeof(f16v));
      if (n < 8) { d0 += n * LANES; break; }
    }
  }
  if (d0 < D) {                                          // what is left of the row, and other dtypes
    for (int64_t d = d0; d < D; ++d) acc[d] = 0.f;
    for (int64_t j = 0; j < L; ++j) {
      const T* vr = (j < Lc ? vc : vu) + rows[j] * v_row;
      const float p = sc[j];
      for (int64_t d = d0; d < D; ++d) acc[d] += p * to_float(vr[d]);
    }
  }
  const float inv = 1.0f / total;
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<T>(acc[d] * inv);
}

// QG float32 queries of one head whose row lists are prefixes of one list (consecutive rows of a prompt block or
// a chain: query t sees rows[0, L[t])), with one prefix split Lc: each key and value row is loaded once for all of
// them while every query's arithmetic stays one_head's (its own scores, max, exponentials, sum and weighted sums,
// each over its rows in order).  sc: QG * L_max floats; buf: QG * D floats.
constexpr int QG = 4;
inline void group_heads(const float* const* q, const float* kc, const float* vc, const float* ku, const float* vu,
                        const int64_t* rows, const int64_t* L, int64_t Lc, int64_t D, int64_t k_row, int64_t v_row,
                        float scale, float* sc, int64_t ld_sc, float* qf, float* const* out) {
  int64_t Lmin = L[0], Lmax = L[0];
  for (int t = 1; t < QG; ++t) Lmin = std::min(Lmin, L[t]), Lmax = std::max(Lmax, L[t]);
  for (int t = 0; t < QG; ++t)
    for (int64_t d = 0; d < D; ++d) qf[t * D + d] = q[t][d] * scale;
  // scores: 16 keys at a time for every query while all of them see the keys, then each query's own rest
  int64_t j = 0;
  for (; j + LANES <= Lmin; j += LANES) {
    f16v parts[QG][LANES];
    for (int u = 0; u < LANES; ++u) {
      const float* kr = (j + u < Lc ? kc : ku) + rows[j + u] * k_row;
      for (int t = 0; t < QG; ++t) parts[t][u] = dot_lanes(qf + t * D, kr, D);
    }
    for (int t = 0; t < QG; ++t) {
      const f16v s = tree_sum16(parts[t]);
      std::memcpy(sc + t * ld_sc + j, &s, sizeof s);
    }
  }
  float m[QG], total[QG];
  for (int t = 0; t < QG; ++t) {
    float* st = sc + t * ld_sc;
    int64_t i = j;
    for (; i + LANES <= L[t]; i += LANES) {
      f16v parts[LANES];
      for (int u = 0; u < LANES; ++u) parts[u] = dot_lanes(qf + t * D, (i + u < Lc ? kc : ku) + rows[i + u] * k_row, D);
      const f16v s = tree_sum16(parts);
      std::memcpy(st + i, &s, sizeof s);
    }
    for (; i < L[t]; ++i) st[i] = dot(qf + t * D, (i < Lc ? kc : ku) + rows[i] * k_row, D);
    m[t] = -std::numeric_limits<float>::infinity();
    for (i = 0; i < L[t]; ++i) m[t] = st[i] > m[t] ? st[i] : m[t];
    for (int64_t j0 = 0; j0 < L[t]; j0 += LANES) {
      const int64_t n = std::min<int64_t>(LANES, L[t] - j0);
      float x[LANES];
      std::fill(x, x + LANES, m[t]);
      std::memcpy(x, st + j0, n * sizeof(float));
      f16v e = load16(x);
      e = exp_nonpositive16(e - m[t]);
      std::memcpy(st + j0, &e, n * sizeof(float));
    }
    total[t] = 0.f;
    for (i = 0; i < L[t]; ++i) total[t] += st[i];
  }
  // weighted sums: 32 lanes of every query at a time, each value row loaded once while all queries see it
  int64_t d0 = 0;
  for (; d0 + 2 * LANES <= D; d0 += 2 * LANES) {
    f16v a[QG][2] = {};
    int64_t i = 0;
    for (; i < Lmin; ++i) {
      const float* vr = (i < Lc ? vc : vu) + rows[i] * v_row + d0;
      const f16v v0 = load16(vr), v1 = load16(vr + LANES);
      for (int t = 0; t < QG; ++t) {
        const float p = sc[t * ld_sc + i];
        a[t][0] += p * v0;
        a[t][1] += p * v1;
      }
    }
    for (int t = 0; t < QG; ++t) {
      for (int64_t r = i; r < L[t]; ++r) {
        const float* vr = (r < Lc ? vc : vu) + rows[r] * v_row + d0;
        const float p = sc[t * ld_sc + r];
        a[t][0] += p * load16(vr);
        a[t][1] += p * load16(vr + LANES);
      }
      const float inv = 1.0f / total[t];
      for (int l = 0; l < LANES; ++l) out[t][d0 + l] = a[t][0][l] * inv, out[t][d0 + LANES + l] = a[t][1][l] * inv;
    }
  }
  for (; d0 + LANES <= D; d0 += LANES) {                 // one 16-lane slice left
    for (int t = 0; t < QG; ++t) {
      f16v a = {};
      for (int64_t r = 0; r < L[t]; ++r) a += sc[t * ld_sc + r] * load16((r < Lc ? vc : vu) + rows[r] * v_row + d0);
      const float inv = 1.0f / total[t];
      for (int l = 0; l < LANES; ++l) out[t][d0 + l] = a[l] * inv;
    }
  }
  if (d0 < D) {                                          // what is left of the row
    for (int t = 0; t < QG; ++t) {
      const float inv = 1.0f / total[t];
      for (int64_t d = d0; d < D; ++d) {
        float acc = 0.f;
        for (int64_t r = 0; r < L[t]; ++r) acc += sc[t * ld_sc + r] * ((r < Lc ? vc : vu) + rows[r] * v_row)[d];
        out[t][d] = acc * inv;
      }
    }
  }
}

// torch's argmax of one float32 row: the index of its largest value, the first on ties, and the first NaN where
// there is one (argmax counts NaN above every number).  16 lanes each keep their first largest value; the lanes
// are then merged (larger value, or equal and earlier), and the tail after them compared with a strict >.
inline int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0, best = 0;
  float top = x[0];
  if (n >= LANES) {
    f16v bv = load16(x);
    i16v bi = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    i16v at = bi;
    i16v nan = bv != bv;
    for (i = LANES; i + LANES <= n; i += LANES) {
      const f16v v = load16(x + i);
      at += LANES;
      const i16v gt = v > bv;
      bv = gt ? v : bv;
      bi = gt ? at : bi;
      nan |= v != v;
    }
    bool any_nan = false;
    for (int l = 0; l < LANES; ++l) any_nan |= nan[l] != 0;
    if (any_nan) {
      for (int64_t j = 0; j < n; ++j)
        if (x[j] != x[j]) return j;
    }
    top = bv[0], best = bi[0];
    for (int l = 1; l < LANES; ++l)
      if (bv[l] > top || (bv[l] == top && bi[l] < best)) top = bv[l], best = bi[l];
  } else {
    i = 1;
    if (top != top) return 0;
  }
  for (; i < n; ++i) {
    if (x[i] != x[i]) return i;
    if (x[i] > top) top = x[i], best = i;
  }
  return best;
}

// RMSNorm of one float32 row: x * (1 / sqrt(mean(x^2) + eps)) * w.
inline void rms_row(const float* x, const float* w, int64_t D, float eps, float* o) {
  const float inv = 1.0f / std::sqrt(dot(x, x, D) / static_cast<float>(D) + eps);
  for (int64_t d = 0; d < D; ++d) o[d] = x[d] * inv * w[d];
}
