"""The engine's base, below the drafter interface and the core: ``contract`` (StepPlan, StepOutput and what they
hold: plain, picklable values; the enums Phase, Status, StopReason; Counts), ``request`` (Request: the executor's
state of one running request, which a DraftContext views; the token choice ``greedy``), ``sampling`` (Sampling:
the seeded Gumbel token choice), ``runtime`` (Runtime: static shapes, torch.compile, CUDA graphs), ``timing`` (Lap:
a stretch of work timed without a host synchronisation: the executor's phases, a drafter's own laps)."""
