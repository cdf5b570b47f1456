"""The engine's core, above the methods: ``scheduler`` (the table, admission, the token budget, preemption, stop
rules: makes each StepPlan), ``executor`` (runs a plan, answers with a StepOutput) and ``remote`` (the executor in
a child process), ``blocks`` (the paged depth cache), ``loop`` and ``verify`` (propose -> place -> verify ->
observe), ``drafters`` (DrafterCache: drafters by key, built through the method registry), ``stopping``,
``policy``."""
