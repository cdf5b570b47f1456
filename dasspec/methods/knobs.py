"""Method knobs, declared once: one frozen dataclass per method, whose fields carry their help text, their CLI
spelling and their defaults.  Everything else is derived from it - the ``generate(**knobs)`` check,
``dasspec generate`` / ``bench`` / ``probe`` flags, ``--set`` / ``--knobs`` parsing, tune_wave.py's grids and the
``generation_config.json`` overrides.

    @dataclass(frozen=True)
    class SequentialKnobs(Knobs):
        draft_depth: int = knob(FAMILY, "draft depth d", short="-d")
        block: int = knob(8, "draft block length b", short="-b")

A default is a value, which a family may replace with its own (``Family.knob_defaults[method][knob]``: Ouro's
four-step schedule); ``FAMILY``, the model family's (the built-in methods' per-family schedules, paper Table 5 for
Huginn and Raven, live with the families); or a dict family -> value (a method's own per-family defaults, for a
method written outside dasspec).  A ``FAMILY`` knob without the family's value is an error, never another family's
schedule.  Resolution: family defaults <- the model folder's generation_config.json
(``"dasspec": {"<method>": {...}}``) <- the caller's knobs; then ``fit`` lowers defaulted values that conflict
with explicit ones or with the call's depth R, and ``validate`` checks every value and returns normalised knobs.

Every number knob has a ceiling that follows from the model and the call (``most=Most(...)``: the model's context,
the depth R, the vocabulary, the other knobs), shown in its help and checked for every source alike - the API, the
CLI, a server request, generation_config.json: one request's knobs cannot make a block's work unbounded.  An
explicit value above its ceiling is refused, naming the ceiling and why; a *defaulted* one is lowered to it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Callable, ClassVar

from .registry import get_method, method_names

SAMPLED = ":sampled"          # generation_config.json section suffix: a method's defaults for sampled decoding
FAMILY = object()             # a knob default that is the model family's (``Family.knob_defaults``)


@dataclass(frozen=True)
class Scope:
    """What knob ceilings follow from: the call's depth R and the model's context, vocabulary and width."""
    R: int
    context: int
    vocab: int
    n_embd: int

    @classmethod
    def of(cls, model, R: int) -> "Scope":
        c = model.config
        return cls(R=R, context=c.block_size, vocab=c.vocab_size, n_embd=c.n_embd)


class CeilingError(ValueError):
    """A knob above its ceiling (``name``)."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


@dataclass(frozen=True)
class Most:
    """A knob's ceiling: ``text`` (how it is computed, shown in the help), ``why`` (shown when refusing) and
    ``of(knobs, scope)``, its value; ``measure`` turns a structured knob into the number compared (a tree's size)."""
    text: str
    why: str
    of: Callable[[Any, Scope], float]
    measure: Callable[[Any], float] | None = None


def knob(default: Any, help: str, *, short: str | None = None, parse: Callable[[str], Any] | None = None,
         choices: tuple | None = None, most: Most | None = None, path: bool = False) -> Any:
    """A knob field: ``default`` (a value, ``FAMILY`` or {family: value}), ``help`` for the CLI, an optional short
    flag, a parser for text values (default: by the field's type), the allowed values, its ceiling (``most``, added
    to the help) and whether it names a file (``path``: a checkpoint may name only files inside itself)."""
    if most is not None:
        help = f"{help} (at most {most.text})"
    meta = {"help": help, "short": short, "parse": parse, "choices": choices, "most": most, "path": path}
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
        from ..model.families import FAMILIES        # lazy: the CLI reads knobs without loading torch
        own = FAMILIES[family].knob_defaults.get(cls.method, {}) if family in FAMILIES else {}
        out = {}
        for f in dataclasses.fields(cls):
            by_family = f.metadata.get("by_family")
            if f.name in given:
                continue
            if f.name in own:                           # the family's schedule replaces the method's default
                out[f.name] = own[f.name]
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
        from ..model.families import FAMILIES        # lazy: the CLI reads knobs without loading torch
        return {fam: spec.knob_defaults[cls.method][name] for fam, spec in FAMILIES.items()
                if name in spec.knob_defaults.get(cls.method, {})}

    @classmethod
    def resolve(cls, family: str, model_defaults: dict | None, user: dict[str, Any], R: int,
                origin: str | None = None, sampled: bool = False, scope: Scope | None = None,
                folder: str | os.PathLike | None = None) -> "Knobs":
        """Family defaults <- the model folder's per-method overrides (for sampled decoding, then those under
        ``"<method>:sampled"``) <- the caller's knobs; fitted, validated and, given the ``scope`` (model and
        depth), held to every knob's ceiling.  ``origin``: the file the overrides came from
        (``<folder>/generation_config.json``), named in the error when one of its values is the invalid one;
        ``folder``: the checkpoint folder, the only place a file the overrides name may lie."""
        where = origin or "the model's generation_config.json"
        base = cls.file_overrides(model_defaults, where)
        extra = cls.file_overrides(model_defaults, where, cls.method + SAMPLED) if sampled else {}
        per_method = cls._confine_paths({**base, **extra}, folder, where)
        section = {**{k: cls.method for k in base}, **{k: cls.method + SAMPLED for k in extra}}  # where each came from
        sections = " and ".join(f'"{name}"' for name in dict.fromkeys(section.values()))
        unknown = sorted(set(user) - set(cls.names()))
        if unknown:
            raise ValueError(f"method {cls.method!r} does not take {', '.join(unknown)}; its knobs: "
                             f"{', '.join(cls.names()) or 'none'}{elsewhere(unknown, cls.method)}")
        try:
            return cls._build(family, per_method, user, R, scope)
        except ValueError as err:
            if not per_method or (isinstance(err, CeilingError) and err.name in user):
                raise                               # (a caller's value above its ceiling on these very knobs)
            mine = cls._error(family, {}, user, R, scope)
            if mine is not None:
                raise mine from None                # the caller's knobs are invalid by themselves
            if cls._error(family, per_method, {}, R, scope) is not None:
                raise ValueError(f'{where}: "dasspec" -> {sections}: {err}') from None
            # each is valid alone: the caller's knobs conflict with the file's
            from_file = ", ".join(f'{k}={brief(v)} ("{section[k]}")' for k, v in per_method.items() if k not in user)
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
    def _confine_paths(cls, per_method: dict[str, Any], folder: str | os.PathLike | None,
                       where: str) -> dict[str, Any]:
        """File knobs a checkpoint sets (``path=True``), as paths inside ``folder``: a checkpoint must not make
        the loader read ``/etc/passwd`` or ``../../elsewhere`` (a client is refused the same knobs)."""
        if folder is None:
            return per_method
        from ..model.safetensors_io import CheckpointError, checkpoint_root, confine   # lazy: torch, as above
        out = dict(per_method)
        for f in dataclasses.fields(cls):
            value = out.get(f.name)
            if not f.metadata.get("path") or value is None:
                continue
            named = f'{where}: "dasspec" -> "{cls.method}" sets {f.name}'
            if not isinstance(value, str) or not value:
                raise ValueError(f"{named} to {brief(value)}; it must be a file name inside {folder}")
            rel = PurePosixPath(value)
            if rel.is_absolute() or "\\" in value or ".." in rel.parts:
                raise ValueError(f"{named} to {brief(value)}: a checkpoint may only name files inside its folder "
                                 f"{folder} (a relative path without '..')")
            try:
                out[f.name] = str(confine(Path(folder).joinpath(*rel.parts), checkpoint_root(Path(folder)),
                                          f.name))
            except CheckpointError as err:
                raise ValueError(f"{named}: {err}") from None
        return out

    @classmethod
    def _build(cls, family: str, per_method: dict[str, Any], user: dict[str, Any], R: int,
               scope: Scope | None = None) -> "Knobs":
        values = cls.defaults(family, set(per_method) | set(user))
        values.update(per_method)
        values.update(user)
        values = cls.fit(values, set(user), R)
        knobs = cls(**values).validate(R)
        if scope is None:
            return knobs
        given = set(per_method) | set(user)
        knobs.check_ceilings(scope, only=given)     # a value someone set is judged before any default moves
        lowered = knobs.lower_defaults(scope, given)
        if lowered is not knobs:
            knobs = lowered.validate(R)
        return knobs.check_ceilings(scope)

    @classmethod
    def _error(cls, family: str, per_method: dict[str, Any], user: dict[str, Any], R: int,
               scope: Scope | None = None) -> ValueError | None:
        """What ``_build`` raises for these values, or None when they are valid."""
        try:
            cls._build(family, per_method, user, R, scope)
        except ValueError as err:
            return err
        return None

    # --- ceilings --------------------------------------------------------------------------------------------
    @classmethod
    def ceilings(cls) -> dict[str, Most]:
        """knob name -> its ceiling, for every knob that has one."""
        return {f.name: f.metadata["most"] for f in dataclasses.fields(cls) if f.metadata.get("most") is not None}

    def _over(self, name: str, most: Most, scope: Scope) -> tuple[float, float] | None:
        """(value, ceiling) when knob ``name`` is above its ceiling, else None."""
        value = getattr(self, name)
        measured = most.measure(value) if most.measure is not None else value
        ceiling = most.of(self, scope)
        return (measured, ceiling) if measured > ceiling else None

    def lower_defaults(self, scope: Scope, given: set[str]) -> "Knobs":
        """These knobs with every *defaulted* number (a name not in ``given``) above its ceiling lowered to it, in
        declaration order (a lowered gamma lowers the ceilings after it)."""
        knobs = self
        for name, most in self.ceilings().items():
            if name in given or most.measure is not None:
                continue
            over = knobs._over(name, most, scope)
            if over is not None:
                ceiling = over[1]
                value = math.floor(ceiling) if isinstance(getattr(knobs, name), int) else float(ceiling)
                if value >= 1:                      # below every knob's floor: left for check_ceilings to name
                    knobs = dataclasses.replace(knobs, **{name: value})
        return knobs

    def check_ceilings(self, scope: Scope, only: set[str] | None = None) -> "Knobs":
        """Refuse any knob (of ``only``, when given) above its ceiling on this model and depth, naming the ceiling
        and why it is one."""
        for name, most in self.ceilings().items():
            if only is not None and name not in only:
                continue
            over = self._over(name, most, scope)
            if over is not None:
                value, ceiling = over
                shown = f"{ceiling:g}" if isinstance(ceiling, float) else str(ceiling)
                raise CeilingError(name, f"{name}={_show(value)} is above its ceiling of {shown} on this model and "
                                         f"depth (R={scope.R}, context {scope.context}): at most {most.text}, since "
                                         f"{most.why}")
        return self

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


def _show(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else brief(value, 40)


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

def brief(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: a message quotes a bad value, never a whole request body."""
    if isinstance(value, (list, dict, tuple)) and len(value) >= 64:
        return f"<a {type(value).__name__} of {len(value)} items>"
    try:
        text = repr(value)
    except (ValueError, RecursionError):       # an integer past Python's digit limit, a deeply nested list
        text = f"<a {type(value).__name__} too large to show>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def positive_int(knobs: Knobs, *names: str, minimum: int = 1) -> None:
    for name in names:
        v = getattr(knobs, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {brief(v)}")


def boolean(knobs: Knobs, *names: str) -> None:
    for name in names:
        v = getattr(knobs, name)
        if not isinstance(v, bool):
            raise ValueError(f"{name} must be true or false, got {brief(v)}")


def one_of(knobs: Knobs, name: str, allowed) -> None:
    v = getattr(knobs, name)
    if not isinstance(v, (str, int, float, bool)) or v not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}, got {brief(v)}")


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


def elsewhere(names: list[str], method: str) -> str:
    """The other methods that take each of ``names`` (knobs ``method`` lacks), for an error's end: the server's and
    lm-eval's default method, auto, takes few knobs, so DAS-Wave's sent to it must point there ("" if none)."""
    said = []
    for name in names:
        owners = [m for m in method_names() if m != method and name in get_method(m).knobs.names()]
        if owners:
            said.append(f"{name} is a knob of {', '.join(owners)}")
    return f"; {'; '.join(said)} (name that method)" if said else ""


def parse_set_items(items: list[str], takers: dict[str, type[Knobs]], lacking: str,
                    method: str | None = None) -> dict[str, Any]:
    """``--set NAME=VALUE`` items, each parsed by its knob's declared type; ``takers``: knob name -> the class
    that declares it; ``lacking``: who has no such knob, for the message ("no method has a", "method 'x' has no");
    ``method``: the one method they are for (the message then names the methods that have such a knob)."""
    out: dict[str, Any] = {}
    for item in items:
        name, eq, text = item.partition("=")
        name = name.strip()
        if not eq or not name:
            raise ValueError(f"--set expects NAME=VALUE, got {item!r}")
        if name not in takers:
            raise ValueError(f"--set {name}: {lacking} knob {name!r}; knobs: {', '.join(sorted(takers)) or 'none'}"
                             + (elsewhere([name], method) if method else ""))
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
