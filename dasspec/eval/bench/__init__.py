"""The paired timing benchmark of paper Appendix A.3: ``runner`` (protocol, resumable records), ``metrics``
(S, A, G and bootstrap CIs), ``report`` (markdown / CSV / PNG), ``cli`` (``dasspec bench``)."""

from .metrics import bootstrap_ci, speedup, throughput_ratios
from .report import summarize, write_report
from .runner import BenchPlan, run_bench

__all__ = ["BenchPlan", "run_bench", "summarize", "write_report", "speedup", "throughput_ratios", "bootstrap_ci"]
