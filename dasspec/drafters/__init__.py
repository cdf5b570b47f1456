"""Model-agnostic proposal mechanisms verified by the full-depth target (paper Table 1 baselines).

pld.py        prompt lookup (PLD): suffix n-gram match in the text, chain draft
lookahead.py  Lookahead decoding: Jacobi window + n-gram pool, candidate forest
recycling.py  Token Recycling: persistent top-k successor table, static draft tree
sam.py        SAM-Decoding: suffix automaton over the text (+ optional static corpus automaton)
tree.py       static trees from choices and their per-depth fill

Importing this package registers the methods ``pld``, ``lookahead``, ``token-recycling`` and ``sam``.
"""

from . import lookahead, pld, recycling, sam  # noqa: F401  (registers the methods)
