"""Mechanism probes: rerun the paper's mechanism studies on any looped checkpoint.

    maturity   Q/K/V cosine similarity to the final recurrence, per depth r        (Figure 2 top)
    channels   draft-target agreement for Aligned / Deep V / Deep K / Deep K/V     (Table 6, Figure 2 bottom)
    grid       agreement over verified-prefix K depth x V depth at one draft depth (Figure 4)
    factorial  committed progress G over carry x Deep K x Deep V, interaction E_cKV (Table 9, eq. 11)
    sweep      DAS-Wave speedup and A against k, gamma and W_init                   (Tables 11-12, Figure 3)
    cost       proposal time of the sequential drafters at similar A               (Table 14)

Each probe is a module with a ``run(...)`` that computes rows from a model and prompts (testable on random models)
and a ``write(...)`` that renders ``<probe>.md``, ``<probe>.csv`` and ``<probe>.png`` into an output folder.
``dasspec probe NAME`` (probes/cli.py) wires them to GSM8K prompts and a checkpoint.
"""
