"""The knobs of method auto."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..knobs import Knobs, Most, boolean, brief, knob

ARMS = ("das-wave", "sam", "pld")        # the drafters auto may use besides AR


@dataclass(frozen=True)
class AutoKnobs(Knobs):
    method = "auto"
    arms: str = knob(",".join(ARMS), "auto: the drafters it chooses among besides AR, comma-separated (of "
                     + ", ".join(ARMS) + ")", parse=str)
    explore: float = knob(0.05, "auto: the most of the step time re-measuring switched-off drafters may cost",
                          most=Most("1", "it is a fraction of the step time", lambda kn, s: 1.0))
    calibrate: bool = knob(True, "auto: measure pass costs when the drafter is built (cached per model and "
                           "machine) and size DAS-Wave's window from them")
    recall: bool = knob(True, "auto: a generate / generate_batch call's drafter starts from the prices and "
                        "averages the last such call measured on the model in this process, instead of probing "
                        "every drafter again")

    def validate(self, R: int) -> "AutoKnobs":
        arms = self.arms
        if isinstance(arms, (list, tuple)):
            arms = ",".join(map(str, arms))
        if not isinstance(arms, str):
            raise ValueError(f"arms must be a comma-separated list of {', '.join(ARMS)}, got {brief(arms)}")
        names = [a.strip() for a in arms.split(",") if a.strip()]
        bad = [a for a in names if a not in ARMS]
        if bad or len(set(names)) != len(names):
            raise ValueError(f"arms must name each of {', '.join(ARMS)} at most once, got {brief(self.arms)}")
        e = self.explore
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not 0 <= e <= 1:
            raise ValueError(f"explore must be a number in [0, 1], got {brief(e)}")
        boolean(self, "calibrate")
        boolean(self, "recall")
        return replace(self, arms=",".join(names), explore=float(e))

    @property
    def arm_list(self) -> list[str]:
        return [a for a in self.arms.split(",") if a]
