"""The drafter interface: what a decoding method is written against (``dasspec.methods`` and methods outside
dasspec) - the engine's core runs drafters through it, and a method imports nothing else of the engine.

    draft.py     Draft, TreeLayout, Verdict; Drafter and Session; the drafter <-> engine contract (the budget rule)
    context.py   DraftContext: the read-only view of its request a drafting session gets
    batch.py     Batch: the three primitives over several requests' scratch rows in one call

It also hands on what a drafter is given or may use from the engine's base (``dasspec.engine.base``, below it):
``greedy`` (the greedy token choice, which ``ctx.choose`` is compared with), ``PassTiming`` (what
``Drafter.measured`` is told of each verification pass) and ``Lap`` (its own work timed without a device
synchronisation).

    from dasspec.engine.drafting import Batch, Draft, DraftContext, Drafter, Session, TreeLayout, Verdict, greedy
"""

from ..base.contract import PassTiming
from ..base.request import TokenChoice, greedy
from ..base.timing import Lap
from .batch import Batch
from .context import DraftContext
from .draft import Draft, Drafter, Session, TreeLayout, Verdict

__all__ = ["Batch", "Draft", "DraftContext", "Drafter", "Lap", "PassTiming", "Session", "TokenChoice", "TreeLayout",
           "Verdict", "greedy"]
