"""Target-model decoders: full-depth AR, sequential self-speculation / Mature-Spec, and DAS-Wave."""

from . import ar, sequential, wave  # noqa: F401  (registers the methods)
