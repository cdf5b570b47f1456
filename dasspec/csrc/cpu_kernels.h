// dasspec's CPU kernels: the batch-invariant product, causal-row attention, K/V stores, RMSNorm, RoPE and the
// one-call sublayers built from them.  Each output row's bits depend only on that row's own inputs and length -
// never on the other rows of the call, the thread count or the instruction set the CPU offers (isa_body.h).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

namespace dasspec {

// The instruction set the kernels run on ("avx512", "avx2" or "portable"): the best this CPU has, or
// $DASSPEC_CPU_ISA's; set_isa switches it (tests compare the paths' bits).
std::string isa();
void set_isa(const std::string& name);
std::vector<std::string> isas_here();

// x [M, K] times w [N, K] (rows contiguous) plus an optional bias [N]: float32, out [M, N].
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias);

// Query s [H, hd] of q [S, H, hd] attends rows rows[starts[s]: starts[s] + lengths[s]]; the first
// prefix_lengths[s] of them are read from (k_prefix, v_prefix), the rest from (k, v).  [H_kv, rows, hd] tensors.
at::Tensor rows_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& rows,
                          const at::Tensor& starts, const at::Tensor& lengths, double scale,
                          const std::optional<at::Tensor>& k_prefix, const std::optional<at::Tensor>& v_prefix,
                          const std::optional<at::Tensor>& prefix_lengths);
void store_rows(const at::Tensor& k_dst, const at::Tensor& v_dst, const at::Tensor& rows, const at::Tensor& k,
                const at::Tensor& v);
at::Tensor rope_half(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
// Huginn's interleaved RoPE: pairs rotated as complex numbers with torch's roundings; cos / sin [W, hd / 2].
at::Tensor rope_pairs(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
// torch.argmax(x, -1) of float32 rows.
at::Tensor argmax_rows(const at::Tensor& x);
// silu(g) * u, or sigmoid(g) without u, elementwise: float32 or bfloat16, each value's bits its own.
at::Tensor pointwise(const at::Tensor& g, const std::optional<at::Tensor>& u);

// The attention sublayer in one call; with k_prefix / v_prefix / prefix_lengths, each query's first prefix_lengths
// rows are read from the prefix pools (a draft reading the verified prefix at another depth).
at::Tensor attention_rows(const at::Tensor& x, const at::Tensor& wqkv, const at::Tensor& wproj,
                          const std::optional<at::Tensor>& qk_bias, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& store_at,
                          const at::Tensor& rows, const at::Tensor& starts, const at::Tensor& lengths, double scale,
                          int64_t H, int64_t Hkv, const std::optional<at::Tensor>& k_prefix,
                          const std::optional<at::Tensor>& v_prefix, const std::optional<at::Tensor>& prefix_lengths);
// IQuest-Loop's attention at depths >= 2: attention_rows' arguments, then depth 1's pools and row lists and the
// block-diagonal gate weight [H, H * hd] and bias [H].
at::Tensor loop_mix_rows(const at::Tensor& x, const at::Tensor& wqkv, const at::Tensor& wproj,
                         const std::optional<at::Tensor>& qk_bias, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& store_at,
                         const at::Tensor& rows, const at::Tensor& starts, const at::Tensor& lengths, double scale,
                         int64_t H, int64_t Hkv, const at::Tensor& k_glob, const at::Tensor& v_glob,
                         const at::Tensor& glob_rows, const at::Tensor& glob_starts, const at::Tensor& glob_lengths,
                         const at::Tensor& gate_w, const at::Tensor& gate_b);
at::Tensor mlp_rows(const at::Tensor& x, const at::Tensor& wfc, const at::Tensor& wproj);
at::Tensor peri_layer_rows(const at::Tensor& x, const std::vector<at::Tensor>& norms, double eps,
                           const at::Tensor& wqkv, const at::Tensor& wproj, const std::optional<at::Tensor>& qk_bias,
                           const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_pool,
                           const at::Tensor& v_pool, const at::Tensor& store_at, const at::Tensor& rows,
                           const at::Tensor& starts, const at::Tensor& lengths, double scale, int64_t H, int64_t Hkv,
                           const at::Tensor& wfc, const at::Tensor& wdown, const std::optional<at::Tensor>& k_prefix,
                           const std::optional<at::Tensor>& v_prefix, const std::optional<at::Tensor>& prefix_lengths);
at::Tensor pre_layer_rows(const at::Tensor& x, const std::vector<at::Tensor>& norms, double eps,
                          const at::Tensor& wqkv, const at::Tensor& wproj, const std::optional<at::Tensor>& qk_bias,
                          const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_pool,
                          const at::Tensor& v_pool, const at::Tensor& store_at, const at::Tensor& rows,
                          const at::Tensor& starts, const at::Tensor& lengths, double scale, int64_t H, int64_t Hkv,
                          const at::Tensor& wfc, const at::Tensor& wdown, const std::optional<at::Tensor>& k_prefix,
                          const std::optional<at::Tensor>& v_prefix, const std::optional<at::Tensor>& prefix_lengths);
at::Tensor sandwich_layer_rows(const at::Tensor& x, const std::vector<at::Tensor>& norms, double eps,
                               const at::Tensor& wqkv, const at::Tensor& wproj,
                               const std::optional<at::Tensor>& qk_bias, const at::Tensor& cos, const at::Tensor& sin,
                               const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& store_at,
                               const at::Tensor& rows, const at::Tensor& starts, const at::Tensor& lengths,
                               double scale, int64_t H, int64_t Hkv, const at::Tensor& wfc, const at::Tensor& wdown,
                               const std::optional<at::Tensor>& k_prefix, const std::optional<at::Tensor>& v_prefix,
                               const std::optional<at::Tensor>& prefix_lengths);
// Core steps over a call's rows: with an injection the adapter over concat[x, inj] first, then "peri" (Ouro),
// "pre" (Llama) or "sandwich" (Huginn) layers, then ln_f where given.  A draft's steps that read the verified prefix
// at other depths: per step and layer the prefix's K and V pools, and the rows' prefix counts once.
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
                      const std::optional<at::Tensor>& prefix_lengths);

// IQuest-Loop's loops first, first + 1, ... over a call's rows: per layer two norms, their eps, the weights, depth 1's
// pools and the gate; per step and layer the pools; per step the store rows and row lists.
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
                           const std::vector<at::Tensor>& gate_b);

}  // namespace dasspec
