"""The paired timing benchmark of paper Appendix A.3: ``setup`` (plan, prompts, knobs, pinned run.json),
``work`` (one process's runs -> records), ``runner`` (in one process), ``ray_runner`` (cells sharded over Ray
workers), ``folder`` / ``lock`` / ``records`` (the output folder: one writer, append-only records), ``metrics``
(S, A, G and bootstrap CIs), ``report`` (markdown / CSV / PNG), ``cli`` (``dasspec bench``)."""

from .metrics import bootstrap_ci, speedup, throughput_ratios
from .ray_runner import ModelSource, run_bench_ray
from .report import summarize, write_report
from .runner import BenchPlan, run_bench

__all__ = ["BenchPlan", "run_bench", "run_bench_ray", "ModelSource", "summarize", "write_report", "speedup",
           "throughput_ratios", "bootstrap_ci"]
