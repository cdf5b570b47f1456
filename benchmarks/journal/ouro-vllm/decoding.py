"""The engine step_profile.py times: B GSM8K questions (``$DASSPEC_DATA``) already decoding with AR."""
import json
import os

import dasspec


def decoding_engine(model, B: int, warm: int = 8):
    qs = [json.loads(l)["question"] for l in open(os.path.join(os.environ.get("DASSPEC_DATA", "../shared/data"), "gsm8k", "test.jsonl"))][:B]
    eng = dasspec.Engine(model, method="ar", max_batch=B)
    for q in qs:
        eng.add(model.tokenizer.encode(q), max_new_tokens=400, eos=False)
    while len(eng.running) < B or any(not e.generated for e in eng.running):
        eng.step()
    for _ in range(warm):
        eng.step()
    return eng
