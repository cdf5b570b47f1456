"""``dasspec train``: the bundled looped model's recipe, one idea per module.

    config     TrainConfig and the PRESETS
    corpus     the offline training corpus and its contamination check
    prepare    corpus -> tokenizer -> token streams
    schedule   what every step draws: Huginn's random depth, the depth curriculum, the learning rate
    objective  the model as trained (Huginn init) and the truncated-BPTT loss
    loop       the training loop: logs every step, saves the resume state
    resume     DIR.partial until the model is complete, the resume state in it, what a rerun does
    evaluate   held-out loss and depth agreement, greedy samples
    card       generation_config.json, the loss plot, the model card
    run        train(): prepare -> loop -> checkpoint, evaluation, card -> rename DIR.partial to DIR
    cli        the ``dasspec train`` command
"""

from __future__ import annotations

import importlib

# Imported on first use: ``dasspec train --help`` (and every other command's parser) must not load torch.
_EXPORTS = {"PRESETS": ".config", "TrainConfig": ".config", "depth_agreement": ".evaluate", "train": ".run"}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dasspec.train' has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)


__all__ = ["PRESETS", "TrainConfig", "depth_agreement", "train"]
