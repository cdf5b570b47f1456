# In-process A/B of kernel builds: the model's weights in order (cold, 103 MB), M rows, alternating builds per round.
import sys, time, importlib.machinery, importlib.util, statistics, torch
torch.set_num_threads(int(sys.argv[2]))
M = int(sys.argv[1])
tags = sys.argv[3:]
import dasspec
def load(tag):
    path = f"/root/.cache/dasspec/kernels/{tag}/dasspec_cpu_{tag}.so"
    spec = importlib.util.spec_from_file_location(f"dasspec_cpu_{tag}", path)
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
mods = [load(t) for t in tags]
import os
if os.environ.get("SHAPES"):
    ws = []
    for sh in os.environ["SHAPES"].split(";"):
        N, K = map(int, sh.split(","))
        ws += [torch.randn(N, K) for _ in range(max(1, int(os.environ.get("MB", 100)) * 2**20 // (4 * N * K) // len(os.environ["SHAPES"].split(";"))))]
else:
    model = dasspec.load_model("/tmp/dasspec-paired/ouro-mid")
    ws = [p.detach() for n, p in model.named_parameters() if p.dim() == 2 and p.shape[0] < 10000]
xs = {K: torch.randn(M, K) for K in {w.shape[1] for w in ws}}
shapes = sorted({tuple(w.shape) for w in ws})
per = {(i, s): [] for i in range(len(mods)) for s in shapes}
tot = {i: [] for i in range(len(mods))}
for m in mods:
    for w in ws: assert torch.equal(m.linear(xs[w.shape[1]], w, None), mods[0].linear(xs[w.shape[1]], w, None))
for r in range(int(__import__("os").environ.get("ROUNDS", 15))):
    order = list(range(len(mods))) if r % 2 == 0 else list(reversed(range(len(mods))))
    for i in order:
        m = mods[i]; acc = {s: 0.0 for s in shapes}
        t0 = time.perf_counter()
        for w in ws:
            t = time.perf_counter(); m.linear(xs[w.shape[1]], w, None); acc[tuple(w.shape)] += time.perf_counter() - t
        tot[i].append(time.perf_counter() - t0)
        for s in shapes: per[(i, s)].append(acc[s])
for i in range(1, len(mods)):
    rat = [a / b for a, b in zip(tot[0], tot[i])]
    print(f"{tags[i]} vs {tags[0]} M={M}: total speed ratio median {statistics.median(rat):.3f} [{min(rat):.3f}, {max(rat):.3f}]",
          " ".join(f"{s}: {statistics.median([a / b for a, b in zip(per[(0, s)], per[(i, s)])]):.3f}" for s in shapes))
print("medians ms:", {tags[i]: round(statistics.median(tot[i]) * 1e3, 2) for i in tot})
