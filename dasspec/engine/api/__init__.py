"""The engine's user API, on top: ``engine`` (Engine: add / step / cancel / result, composing the core's scheduler
and executor with the output processor), ``generate`` (dasspec.generate, dasspec.generate_batch), ``options`` (what
a request may ask for; GenerationResult), ``output`` (OutputProcessor: events, streamers, text, statistics),
``stats`` (GenerationStats), ``prefix_cache`` (PrefixCache).  ``dasspec`` re-exports the public names."""
