"""``auto``: choose, per request and per step, among DAS-Wave, SAM-Decoding, prompt lookup and plain AR, from a cost
model fitted on what the executor measured - so the default is never meaningfully slower than AR and as fast as the
drafter that pays where one does.  Every choice is verified by the same full-depth target, so the tokens are AR's
whatever it chooses (greedy, sampled per seed, batched); only the speed depends on the measurements.

One idea per module:

* ``tuning.py``       every constant, in one frozen record with the reason for each value;
* ``calibrate.py``    the model's pass costs on this machine (cached), and what they imply: the price of a pass over
                      W rows, of a DAS-Wave round, and DAS-Wave's window for this model;
* ``costs.py``        the cost model: a pass's price (plain rows, and the rows a draft adds, by width) and each arm's
                      drafting per group size, fitted on the executor's ``PassTiming`` and on drafting laps;
* ``earnings.py``     what each arm earns per request (tokens and rows per step), the drafter-wide averages, and the
                      lookups' off-policy scoring;
* ``explorer.py``     one request's choice: named rules (exploit with a margin; first measure, trusted prior, prior
                      probe, price probe, hint probe, interval probe) within one exploration budget;
* ``planners.py``     the batch planners: a server batch drafting together, a closed batch timed to its end;
* ``memory.py``       what a ``generate`` call's drafter measured on a model (prices, average earnings), kept in
                      this process for the next such call's (``recall``): a call does not start blind;
* ``drafter.py``      the drafter and its sessions, composing them per step.

What was chosen and why: each draft's notes in a trace (``auto``: the arm; ``rule``; ``plan``; ``probe``;
``estimates``: the step's tokens per second per arm compared), and ``stats.choices`` (arm -> steps) per request.
Calibration (``calibrate``, on by default) is cached per model and machine in ``~/.cache/dasspec/calibration.json``
(``$DASSPEC_CACHE``); ``benchmarks/tune_wave.py`` stays the way to tune a DAS-Wave schedule explicitly.
"""

from __future__ import annotations

from .. import Method, register
from .calibrate import Curve, Sizing, calibration, measure_costs, monotone
from .drafter import AutoDrafter, AutoSession
from .knobs import ARMS, AutoKnobs
from .tuning import TUNING, Tuning, reasons

__all__ = ["ARMS", "AutoDrafter", "AutoKnobs", "AutoSession", "Curve", "Sizing", "TUNING", "Tuning", "calibration",
           "measure_costs", "monotone", "reasons"]


def _build(knobs: AutoKnobs) -> AutoDrafter:
    return AutoDrafter(knobs)


register(Method("auto", AutoKnobs, _build, stateful=True))
