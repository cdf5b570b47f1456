"""Model-agnostic proposal mechanisms verified by the full-depth target (paper Table 1 baselines)."""
