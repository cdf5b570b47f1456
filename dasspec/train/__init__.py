"""``dasspec train``: the bundled looped model's recipe, one idea per module.

    config     TrainConfig and the PRESETS
    corpus     the offline training corpus and its contamination check
    prepare    corpus -> tokenizer -> token streams
    schedule   what every step draws: Huginn's random depth, the depth curriculum, the learning rate
    objective  the model as trained (Huginn init) and the truncated-BPTT loss
    loop       the training loop: logs every step, saves the resume state
    resume     the resume state: what is saved, and when a folder may be resumed
    evaluate   held-out loss and depth agreement, greedy samples
    card       generation_config.json, the loss plot, the model card
    run        train(): prepare -> loop -> checkpoint, evaluation, card
    cli        the ``dasspec train`` command
"""

from .config import PRESETS, TrainConfig
from .evaluate import depth_agreement
from .run import train

__all__ = ["PRESETS", "TrainConfig", "depth_agreement", "train"]
