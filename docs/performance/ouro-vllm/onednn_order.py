"""What oneDNN's packed float32 product computes (issue 34, 2026-12-04): its output against a per-element chain of
FMAs over k from zero (``seq``) and against chains over blocks of kb whose sums are added in order (``kb...``: the
share of outputs that differ), at 1, 8, 16 and 480 rows; the finding behind decode_kernel.register_panels (K = 512:
one chain; K = 1408: blocks of 1024).
    PYTHONPATH=. python docs/performance/ouro-vllm/onednn_order.py"""
import torch
from torch.utils.cpp_extension import load_inline
src = r"""
#include <torch/extension.h>
#include <cmath>
torch::Tensor seq_fma(torch::Tensor x, torch::Tensor w) {
  auto M = x.size(0), K = x.size(1), N = w.size(0);
  auto out = torch::empty({M, N}, x.options());
  auto xp = x.data_ptr<float>(); auto wp = w.data_ptr<float>(); auto op = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) for (int64_t n = 0; n < N; ++n) {
    float c = 0.f;
    for (int64_t k = 0; k < K; ++k) c = std::fma(xp[m*K+k], wp[n*K+k], c);
    op[m*N+n] = c;
  }
  return out;
}
torch::Tensor seq_fma_blocked(torch::Tensor x, torch::Tensor w, int64_t kb) {
  // K in blocks of kb: each block's sum from 0, then added to the total
  auto M = x.size(0), K = x.size(1), N = w.size(0);
  auto out = torch::empty({M, N}, x.options());
  auto xp = x.data_ptr<float>(); auto wp = w.data_ptr<float>(); auto op = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) for (int64_t n = 0; n < N; ++n) {
    float c = 0.f;
    for (int64_t k0 = 0; k0 < K; k0 += kb) { float p = 0.f; for (int64_t k = k0; k < std::min(K, k0+kb); ++k) p = std::fma(xp[m*K+k], wp[n*K+k], p); c += p; }
    op[m*N+n] = c;
  }
  return out;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("seq_fma", &seq_fma); m.def("seq_fma_blocked", &seq_fma_blocked); }
"""
mod = load_inline("seqfma_t", cpp_sources=src, extra_cflags=["-O2", "-ffp-contract=off"], verbose=False)
from dasspec.model import linear as lin
torch.set_num_threads(2)
torch.manual_seed(0)
for N, K in [(1536, 512), (512, 1408)]:
    W = torch.randn(N, K) * 0.02
    for M in (1, 8, 16, 480):
        x = torch.randn(M, K)
        pw = lin.packed_weight(x if M > 1 else torch.randn(2, K), W)
        ref = torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], "")
        s = mod.seq_fma(x, W)
        res = [f"seq {torch.equal(ref, s)} ({(ref != s).float().mean():.3f} differ)"]
        for kb in (256, 512, 768, 1024):
            b = mod.seq_fma_blocked(x, W, kb)
            res.append(f"kb{kb} {(ref != b).float().mean():.3f}")
        print(N, K, M, *res, flush=True)
