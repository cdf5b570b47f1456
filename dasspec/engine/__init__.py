"""The engine: many requests, one step at a time, in four layers - each imports only the layers below it (and the
model); this file and the layers' own files import nothing, so loading one layer loads none above it.

    base/       what every layer speaks: the plan and outcome exchanged by scheduler and executor (contract), a
                running request's device state (request), the seeded token choice (sampling), execution options
                (runtime), timing without a host synchronisation (timing)
    drafting/   the drafter interface methods are written against: Draft / Verdict / TreeLayout, Drafter /
                Session, DraftContext, Batch
    (dasspec.methods: the decoding methods and their registry, built on drafting/)
    core/       the machine: scheduler, executor (in process or in a child: remote), the block pool, the verifier
                and the decode loop, the drafter cache wired to the method registry, stop rules, the speculation
                policy
    api/        what users call: Engine (composing the core with the output processor), generate / generate_batch,
                request options and results, statistics, PrefixCache

Users import from ``dasspec`` (``dasspec.Engine``, ``dasspec.generate``, ...); a method outside dasspec from
``dasspec.engine.drafting``."""
