#!/bin/bash
# alternate AR B=1/B=8 bundled between two trees, separate processes
OLD=/tmp/s23/old
NEW=/work/main
cat > /tmp/s23/ab_ar.py <<'PY'
import time, json, glob, torch, sys
torch.set_num_threads(2)
import dasspec
m = dasspec.load_model(); tok = dasspec.load_tokenizer()
f = "/work/shared/data/gsm8k/test.jsonl"
prompts = [tok.encode(json.loads(l)["question"]) for l in open(f)][:8]
dasspec.generate_batch(m, prompts[:2], "ar", max_new_tokens=4, eos=False)
dasspec.generate(m, prompts[0], "ar", max_new_tokens=4, eos=False)
out = []
for i in range(2):
    t = time.perf_counter(); [dasspec.generate(m, p, "ar", max_new_tokens=64, eos=False) for p in prompts]; b1 = time.perf_counter() - t
    t = time.perf_counter(); dasspec.generate_batch(m, prompts, "ar", max_new_tokens=64, eos=False); b8 = time.perf_counter() - t
    out.append((round(512 / b1, 1), round(512 / b8, 1)))
print(sys.argv[1], out, dasspec.__file__)
PY
for r in 1 2 3; do
  for side in old new; do
    d=$([ $side = old ] && echo $OLD || echo $NEW)
    (cd $d && PYTHONPATH=$d python /tmp/s23/ab_ar.py $side)
  done
done
