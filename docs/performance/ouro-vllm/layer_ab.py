"""Ouro's layer in one call (PeriNormBlock.rows -> decode_kernel.peri_layer_rows) against the same layers on their
sublayer calls, in one process (``paired.py``: whole generate_batch runs, alternating, tokens checked equal; issue
34, 2026-12-04).
    PYTHONPATH=. python docs/performance/ouro-vllm/layer_ab.py THREADS B PAIRS"""
import sys
sys.path.insert(0, "docs/performance/ouro-vllm")
from paired import paired
from dasspec.model.families import ouro

real = ouro.PeriNormBlock.rows


def set_arm(model, fused):
    ouro.PeriNormBlock.rows = real if fused else (lambda self, x, span, kv: None)


paired(set_arm, int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), "fused/modules")
