"""Evaluation: ``tasks`` (the four workloads and their data), ``bench`` (the paper's paired timing benchmark) and
``probes`` (the mechanism probes)."""
