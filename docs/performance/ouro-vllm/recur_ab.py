"""Ouro's core steps in one call (Ouro.recur_rows -> decode_kernel.peri_recur_rows) against the same steps as one
layer call each (PeriNormBlock.rows), in one process (``paired.py``: whole generate_batch runs, alternating, tokens
checked equal; issue 34, 2026-12-04).
    PYTHONPATH=. python docs/performance/ouro-vllm/recur_ab.py THREADS B PAIRS"""
import sys
sys.path.insert(0, "docs/performance/ouro-vllm")
from paired import paired
from dasspec.model.families import ouro

real = ouro.Ouro.recur_rows


def set_arm(model, fused):
    ouro.Ouro.recur_rows = real if fused else (lambda *a: None)


paired(set_arm, int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), "steps in one call / layer calls")
