"""Method knobs, declared once: one frozen dataclass per method, whose fields carry their help text, their CLI
spelling and their defaults.  Everything else is derived from it - the ``generate(**knobs)`` check,
``dasspec generate`` / ``bench`` / ``probe`` flags, ``--set`` / ``--knobs`` parsing, tune_wave.py's grids and the
``generation_config.json`` overrides.

    @dataclass(frozen=True)
    class SequentialKnobs(Knobs):
        draft_depth: int = knob(FAMILY, "draft depth d", short="-d")
        block: int = knob(8, "draft block length b", short="-b")

A default is a value; ``FAMILY``, the model family's (``Family.knob_defaults[method][knob]``: the built-in methods'
per-family schedules, paper Table 5 for Huginn and Raven, live with the families); or a dict family -> value (a
method's own per-family defaults, for a method written outside dasspec).  A family without one is an error, never
another family's schedule.  Resolution: family defaults <- the model folder's generation_config.json
(``"dasspec": {"<method>": {...}}``) <- the caller's knobs; then ``fit`` lowers defaulted values that conflict
with explicit ones or with the call's depth R, and ``validate`` checks every value and returns normalised knobs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

SAMPLED = ":sampled"          # generation_config.json section suffix: a method's defaults for sampled decoding
FAMILY = object()             # a knob default that is the model family's (``Family.knob_defaults``)


def knob(default: Any, help: str, *, short: str | None = None, parse: Callable[[str], Any] | None = None,
         choices: tuple | None = None) -> Any:
    """A knob field: ``default`` (a value, ``FAMILY`` or {family: value}), ``help`` for the CLI, an optional short
    flag, a parser for text values (default: by the field's type) and the allowed values."""
    meta = {"help": help, "short": short, "parse": parse, "choices": choices}
    if default is FAMILY or isinstance(default, dict):
        meta["by_family"] = FAMILY if default is FAMILY else dict(default)
        return field(default=None, metadata=meta)
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Knobs:
    """Base class of a method's knobs."""

    method: ClassVar[str] = ""

    # --- declared knobs ------------------------------------------------------------------------------------
    @classmethod
    def specs(cls) -> list[dataclasses.Field]:
        return list(dataclasses.fields(cls))

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def kind(cls, name: str) -> Any:
        """The annotated type of knob ``name``."""
        return typing.get_type_hints(cls)[name]

    @classmethod
    def parse(cls, name: str, text: str) -> Any:
        """A knob value from command-line text (``--set``, ``--knobs``, tune grids)."""
        f = {f.name: f for f in dataclasses.fields(cls)}[name]
        parser = f.metadata.get("parse")
        if parser is not None:
            return parser(text)
        return parse_as(cls.kind(name), text, name)

    # --- resolution ------------------------------------------------------------------------------------------
    @classmethod
    def defaults(cls, family: str, given: set[str] = frozenset()) -> dict[str, Any]:
        """Every knob's default for ``family``; knobs in ``given`` need none (the caller sets them)."""
        out = {}
        for f in dataclasses.fields(cls):
            by_family = f.metadata.get("by_family")
            if f.name in given:
                continue
            if by_family is None:
                out[f.name] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                continue
            table = cls.family_table(f.name) if by_family is FAMILY else by_family
            if family not in table:
                raise ValueError(f"method {cls.method!r} has no default {f.name} for model family {family!r} (known: "
                                 f"{', '.join(table) or 'none'}); give {f.name} explicitly")
            out[f.name] = table[family]
        return out

    @classmethod
    def family_table(cls, name: str) -> dict[str, Any]:
        """family -> its default for knob ``name`` of this method, from every family that declares one."""
        from ..model.families import FAMILIES        # (here: the CLI reads knobs without loading torch)
        return {fam: spec.knob_defaults[cls.method][name] for fam, spec in FAMILIES.items()
                if name in spec.knob_defaults.get(cls.method, {})}

    @classmethod
    def resolve(cls, family: str, model_defaults: dict | None, user: dict[str, Any], R: int,
                origin: str | None = None, sampled: bool = False) -> "Knobs":
        """Family defaults <- the model folder's per-method overrides (for sampled decoding, then those under
        ``"<method>:sampled"``) <- the caller's knobs; fitted, validated.  ``origin``: the file the overrides came
        from (``<folder>/generation_config.json``), named in the error when one of its values is the invalid one."""
        where = origin or "the model's generation_config.json"
        base = cls.file_overrides(model_defaults, where)
        extra = cls.file_overrides(model_defaults, where, cls.method + SAMPLED) if sampled else {}
        per_method = {**base, **extra}
        section = {**{k: cls.method for k in base}, **{k: cls.method + SAMPLED for k in extra}}  # where each came from
        sections = " and ".join(f'"{name}"' for name in dict.fromkeys(section.values()))
        unknown = sorted(set(user) - set(cls.names()))
        if unknown:
            raise ValueError(f"method {cls.method!r} does not take {', '.join(unknown)}; its knobs: "
                             f"{', '.join(cls.names()) or 'none'}")
        try:
            return cls._build(family, per_method, user, R)
        except ValueError as err:
            if not per_method:
                raise
            mine = cls._error(family, {}, user, R)
            if mine is not None:
                raise mine from None                # the caller's knobs are invalid by themselves
            if cls._error(family, per_method, {}, R) is not None:
                raise ValueError(f'{where}: "dasspec" -> {sections}: {err}') from None
            # each is valid alone: the caller's knobs conflict with the file's
            from_file = ", ".join(f'{k}={v!r} ("{section[k]}")' for k, v in per_method.items() if k not in user)
            raise ValueError(f"{err} ({from_file} from {where})") from None

    @classmethod
    def file_overrides(cls, model_defaults: dict | None, where: str, key: str | None = None) -> dict[str, Any]:
        """This method's knobs from a generation_config.json (``"dasspec": {"<method>": {...}}``, or ``key``); a
        section of the wrong shape is an error, names this method does not take are ignored with a warning."""
        if not model_defaults:
            return {}
        key = key or cls.method
        section = model_defaults.get("dasspec") if isinstance(model_defaults, dict) else model_defaults
        per_method = section.get(key) if isinstance(section, dict) else section
        if section is None or per_method is None:
            return {}
        if not isinstance(per_method, dict):
            raise ValueError(f'{where}: "dasspec" must map method names to objects of knobs, e.g. '
                             f'{{"dasspec": {{"{cls.method}": {{...}}}}}}')
        ignored = sorted(set(per_method) - set(cls.names()))
        if ignored:
            warnings.warn(f'{where}: "dasspec" -> "{key}" sets {", ".join(ignored)}, which {cls.method} does '
                          f"not take (its knobs: {', '.join(cls.names()) or 'none'}); ignored", UserWarning,
                          stacklevel=4)
        return {k: v for k, v in per_method.items() if k in cls.names()}

    @classmethod
    def _build(cls, family: str, per_method: dict[str, Any], user: dict[str, Any], R: int) -> "Knobs":
        values = cls.defaults(family, set(per_method) | set(user))
        values.update(per_method)
        values.update(user)
        values = cls.fit(values, set(user), R)
        return cls(**values).validate(R)

    @classmethod
    def _error(cls, family: str, per_method: dict[str, Any], user: dict[str, Any], R: int) -> ValueError | None:
        """What ``_build`` raises for these values, or None when they are valid."""
        try:
            cls._build(family, per_method, user, R)
        except ValueError as err:
            return err
        return None

    @classmethod
    def fit(cls, values: dict[str, Any], explicit: set[str], R: int) -> dict[str, Any]:
        """Lower *defaulted* values that conflict with explicit ones or with R (explicit ones are only checked)."""
        return values

    def validate(self, R: int) -> "Knobs":
        """Check every value (naming the bad one) and return the knobs with values normalised."""
        return self

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def as_json(self) -> dict[str, Any]:
        """``as_dict`` with every value JSON-ready (for run.json and the server's replies)."""
        return jsonable(self.as_dict())


def jsonable(value: Any) -> Any:
    """``value`` as JSON can hold it: a knob that is a structure (a draft tree) becomes its name or a digest."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    text = getattr(value, "name", None) or str(value)
    if len(text) > 80:      # a structure (e.g. a draft tree): a short stable digest keeps run.json readable
        text = f"{type(value).__name__}<sha1:{hashlib.sha1(text.encode()).hexdigest()[:12]}>"
    return text


# --- value checks used by the methods' validate ----------------------------------------------------------------

def positive_int(knobs: Knobs, *names: str, minimum: int = 1) -> None:
    for name in names:
        v = getattr(knobs, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {v!r}")


def boolean(knobs: Knobs, *names: str) -> None:
    for name in names:
        v = getattr(knobs, name)
        if not isinstance(v, bool):
            raise ValueError(f"{name} must be true or false, got {v!r}")


def one_of(knobs: Knobs, name: str, allowed) -> None:
    v = getattr(knobs, name)
    if v not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}, got {v!r}")


def parse_as(kind: Any, text: str, name: str = "value") -> Any:
    """Text -> a value of ``kind`` (bool, int, float, str, Optional[...], or JSON for anything else)."""
    origin = typing.get_origin(kind)
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if text.lower() in ("none", "null", ""):
            return None
        kinds = args
    else:
        kinds = [kind]
    if bool in kinds:
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: expected true or false, got {text!r}")
    if int in kinds:
        try:
            return int(text)
        except ValueError:
            if len(kinds) == 1:
                raise ValueError(f"{name}: expected an integer, got {text!r}") from None
    if float in kinds:
        try:
            return float(text)
        except ValueError:
            if len(kinds) == 1:
                raise ValueError(f"{name}: expected a number, got {text!r}") from None
    if str in kinds:
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


# --- command-line flags, derived from the dataclasses ----------------------------------------------------------

def flag_specs(classes: list[type[Knobs]], names: set[str] | None = None) -> dict[str, tuple[type[Knobs], Any]]:
    """knob name -> (the first class declaring it, its field), over ``classes``, optionally only ``names``."""
    out: dict[str, tuple[type[Knobs], Any]] = {}
    for cls in classes:
        for f in cls.specs():
            if (names is None or f.name in names) and f.name not in out:
                out[f.name] = (cls, f)
    return out


def add_knob_flags(group, classes: list[type[Knobs]], names: set[str] | None = None, grid: bool = False) -> None:
    """One flag per knob of ``classes`` (``--draft-depth``, its short form, ``--trim`` / ``--no-trim`` for
    booleans).  ``grid``: every flag takes a comma-separated list of values (tuning scripts)."""
    for name, (cls, f) in flag_specs(classes, names).items():
        long = f"-{name}" if len(name) == 1 else f"--{name.replace('_', '-')}"
        spellings = list(dict.fromkeys([long, f.metadata.get("short") or long]))
        helptext = f.metadata.get("help", "")
        if grid:
            group.add_argument(*spellings, dest=name, default=None, metavar="V[,V...]",
                               help=f"{helptext} (comma-separated values to try)")
        elif cls.kind(name) is bool:
            group.add_argument(*spellings, dest=name, action="store_true", default=None, help=helptext)
            group.add_argument(f"--no-{name.replace('_', '-')}", dest=name, action="store_false",
                               help=f"the opposite of {long}")
        else:
            group.add_argument(*spellings, dest=name, default=None, metavar=name.upper(), help=helptext)


def knobs_from_args(args, classes: list[type[Knobs]], extra: list[str] = (), grid: bool = False) -> dict[str, Any]:
    """The knobs given on the command line, parsed by their declared types: the derived flags plus
    ``--set NAME=VALUE`` items.  ``grid``: {name: [values]} from comma-separated lists."""
    specs = flag_specs(classes)
    out: dict[str, Any] = {}
    for name, (cls, _) in specs.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        if grid:
            out[name] = [cls.parse(name, v) for v in split_values(str(value))]
        elif isinstance(value, str):
            out[name] = cls.parse(name, value)
        else:
            out[name] = value
    out.update(parse_set_items(extra or [], {name: cls for name, (cls, _) in specs.items()}, "no method has a"))
    return out


def parse_set_items(items: list[str], takers: dict[str, type[Knobs]], lacking: str) -> dict[str, Any]:
    """``--set NAME=VALUE`` items, each parsed by its knob's declared type; ``takers``: knob name -> the class
    that declares it; ``lacking``: who has no such knob, for the message ("no method has a", "method 'x' has no")."""
    out: dict[str, Any] = {}
    for item in items:
        name, eq, text = item.partition("=")
        name = name.strip()
        if not eq or not name:
            raise ValueError(f"--set expects NAME=VALUE, got {item!r}")
        if name not in takers:
            raise ValueError(f"--set {name}: {lacking} knob {name!r}; knobs: {', '.join(sorted(takers)) or 'none'}")
        out[name] = takers[name].parse(name, text.strip())
    return out


def split_values(text: str) -> list[str]:
    """Comma-separated values; an explicit read policy "k=4,v=32" stays one value."""
    out: list[str] = []
    for part in (x.strip() for x in text.split(",")):
        if part.startswith("v=") and out and out[-1].startswith("k="):
            out[-1] += "," + part
        elif part:
            out.append(part)
    return out
