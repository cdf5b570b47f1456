"""The floor of a B = 8 decode step's products (issue 34, 2026-12-04): its 129 packed oneDNN products on the
model's real weights, 8 rows each, in a plain loop (the head once, each layer weight 4 times), 2 threads.
    PYTHONPATH=. python docs/performance/ouro-vllm/products_floor.py
vLLM's side was timed the same way in its venv with vllm._custom_ops.create_onednn_mm / onednn_mm on random
weights of the same shapes."""
import time, torch, dasspec
from dasspec.model import linear as L
torch.set_num_threads(2)
model = dasspec.load_model("/tmp/ouro-mid", dtype=torch.float32)
ws = []
for name, p in model.named_parameters():
    if p.dim() == 2 and p.numel() >= L.PACK_MIN_ELEMENTS and "wte" not in name: ws.append((name, p))
print(len(ws), [n for n, _ in ws[:6]])
packs = [(L._PACKS.get(p), p.shape[0], p.shape[1]) for _, p in ws]
layer = [pk for pk in packs[:-1]]  # 32 linears of 8 layers? 
print(len(layer))
xs = {K: torch.randn(8, K) for _, _, K in packs}
def run():
    for _ in range(4):
        for pk, N, K in packs[:-1]:
            torch.ops.mkldnn._linear_pointwise(xs[K], pk, None, "none", [], "")
    pk, N, K = packs[-1]
    torch.ops.mkldnn._linear_pointwise(xs[K], pk, None, "none", [], "")
for _ in range(3): run()
ts = []
for _ in range(20):
    t = time.perf_counter(); run(); ts.append(time.perf_counter() - t)
ts.sort(); print("products only per step ms: min %.1f med %.1f" % (ts[0]*1e3, ts[10]*1e3))
