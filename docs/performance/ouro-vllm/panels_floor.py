"""A decode step's 129 products (the mid-size Ouro's real weights: each layer weight 4 times, the head once) in a
plain loop, oneDNN's packed product against the same weights' panels (decode_kernel.packed_linear), M rows each,
2 threads, alternating, 3 repetitions of 10 steps each (issue 34, 2026-12-04).
    PYTHONPATH=. python docs/performance/ouro-vllm/panels_floor.py M"""
import statistics, sys, time, torch, dasspec
from dasspec.model import linear as L, decode_kernel as dk
torch.set_num_threads(2)
M = int(sys.argv[1]) if len(sys.argv) > 1 else 8
model = dasspec.load_model("/tmp/ouro-mid", dtype=torch.float32)
ws = [p for name, p in model.named_parameters() if p.dim() == 2 and p.numel() >= L.PACK_MIN_ELEMENTS
      and "wte" not in name]
packs = [L._PACKS.get(p) for p in ws]
assert all(dk.register_panels(pk, p.detach()) > 0 for pk, p in zip(packs, ws))
xs = {p.shape[1]: torch.randn(M, p.shape[1]) for p in ws}
order = [(pk, p.shape[1]) for _ in range(4) for pk, p in zip(packs[:-1], ws[:-1])] + [(packs[-1], ws[-1].shape[1])]
assert len(order) == 129
pad = L.padded_rows(M)
for pk, K in order[-1:] + order[:1]:          # the same bits as oneDNN's rows among 8 or more (a single row too)
    rows = torch.cat((xs[K], xs[K].new_zeros(max(pad, 8) - M, K)))
    assert torch.equal(dk.packed_linear(xs[K], pk, pad), torch.ops.mkldnn._linear_pointwise(rows, pk, None, "none",
                                                                                              [], "")[:M])


def onednn():
    for pk, K in order:
        torch.ops.mkldnn._linear_pointwise(xs[K], pk, None, "none", [], "")


def panels():
    for pk, K in order:
        dk.packed_linear(xs[K], pk, pad)


for rep in range(3):
    for name, f in (("oneDNN", onednn), ("panels", panels)):
        f()
        ts = []
        for _ in range(10):
            t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
        print(f"{name} M={M}: 129 products median {statistics.median(ts) * 1e3:.1f} ms, min {min(ts) * 1e3:.1f}",
              flush=True)
