"""Products of few rows through the weights' panels (decode_kernel.register_panels: oneDNN's arithmetic, a
streaming kernel) against oneDNN's packed product alone, in one process (``paired.py``: whole generate_batch runs,
alternating, the panels dropped and registered again between runs outside the timing, tokens checked equal; issue
34, 2026-12-04).
    PYTHONPATH=. python docs/performance/ouro-vllm/panels_ab.py THREADS B PAIRS"""
import sys
sys.path.insert(0, "docs/performance/ouro-vllm")
from paired import paired
from dasspec.model import linear as lin, decode_kernel as dk


def set_arm(model, on):
    weights = {id(p): p for p in model.parameters()}
    for key, hit in lin._PACKS.table.items():       # packed by the first run (with their panels)
        if hit:
            dk.unregister_panels(hit[0])
            if on:
                assert dk.register_panels(hit[0], weights[key].detach()) > 0


paired(set_arm, int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), "panels / oneDNN alone")
