"""What the journal's A/B scripts share: the flags --model, --threads, --rounds and --tokens (and a script's own),
the model loaded in float32 at that thread count, and iquest_vllm.py's random-id prompts."""
import argparse, os, sys
from typing import Callable
import torch, dasspec
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from iquest_vllm import random_prompts  # noqa: E402,F401  (re-exported for the scripts)


def setup(rounds: int = 3, add: Callable[[argparse.ArgumentParser], None] | None = None):
    """The parsed flags and the model."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--tokens", type=int, default=32)
    if add is not None:
        add(p)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    return a, dasspec.load_model(a.model, dtype=torch.float32)
