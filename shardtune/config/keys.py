"""How a key is declared, and everything its declaration alone decides.

A key is a field of a section dataclass (``schema``): its annotation is its type (a ``Literal`` lists the values
it accepts), its default is the default, and ``key(...)`` puts the rest beside them, in the field's metadata: what
it does, its bounds, other spellings of its values, other tools' names for it. From that one declaration come the
coercion of YAML and command-line values, normalised spellings, the checks of one value, ``--help-keys``,
docs/config.md and the recipe JSON Schema. Rules between keys live in ``validation``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from shardtune.errors import closest


class Problem(str):
    """One line saying what is wrong with a config, carrying the keys it is about: the first of them that a file
    sets puts that file and line in front of it (``loading``)."""

    keys: tuple[str, ...]

    def __new__(cls, keys: str | tuple[str, ...], text: str) -> Problem:
        problem = super().__new__(cls, text)
        problem.keys = (keys,) if isinstance(keys, str) else keys
        return problem


@dataclass(frozen=True)
class Key:
    """What the schema says of one key besides its type and default."""

    help: str  # what it does: docs/config.md, --help-keys and the JSON Schema say this
    choices: tuple[Any, ...] = ()  # the values it accepts where no Literal lists them (a table's names)
    ge: float | None = None  # bounds of a number: at least, above, at most, below
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    spellings: Mapping[str, str] = dataclasses.field(default_factory=dict)  # another spelling (upper case) -> value
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)  # another tool's name -> whose name it is
    deepspeed: tuple[str, ...] = ()  # the DeepSpeed config entries that set it as they are (config/deepspeed.py)
    refused: Mapping[str, str] = dataclasses.field(default_factory=dict)  # a value outside the choices -> why
    refusal: str = ""  # what to say of any other value outside the choices, instead of listing them
    secret: bool = False  # never written into config.yaml
    takes_true: bool = False  # not a boolean, but true is one of its values: a bare --key flag means it
    commas: bool = False  # a text of comma-separated items: a YAML list is read as its items joined by commas
    # The setting without which it does nothing, as the help says it ("use_peft_lora true"; validation.SWITCHES
    # decides it): another value than its default is refused there, not dropped.
    needs: str = ""
    # Values that do nothing where that setting is off (another tool's default there: Transformers' hub_strategy
    # every_save without push_to_hub): accepted there, refused as any other value where the key acts.
    idle: tuple[Any, ...] = ()


def key(default: Any = None, help: str = "", *, factory: Any = None, **rules: Any) -> Any:  # noqa: A002
    """A section field: its default (``factory`` makes a fresh one per config) and its ``Key``."""
    metadata = {"key": Key(help, **rules)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Declared:
    """One key as declared: its section, name, type (without None), whether unset is allowed, and ``Key``."""

    section: str
    name: str
    type: Any
    optional: bool
    meta: Key

    @property
    def is_list(self) -> bool:
        return get_origin(self.type) is list

    @property
    def base(self) -> type:
        """bool, int, float or str: what one value (one item of a list) is."""
        inner = get_args(self.type)[0] if self.is_list else self.type
        return type(get_args(inner)[0]) if get_origin(inner) is Literal else inner

    @property
    def choices(self) -> tuple[Any, ...]:
        inner = get_args(self.type)[0] if self.is_list else self.type
        return get_args(inner) if get_origin(inner) is Literal else self.meta.choices

    def coerce(self, value: Any) -> Any:
        """A YAML or command-line value as this key's type; ValueError says the accepted form."""
        if (self.is_list or self.meta.commas) and isinstance(value, str) and value.strip().startswith("[") and \
                value.strip().endswith("]"):
            value = _flow_list(value)  # the command line's '["lm_head", "embed_tokens"]', a JSON list
        if self.is_list:  # a YAML list, or one string of comma-separated items (the command line's form)
            items = value if isinstance(value, (list, tuple)) else str(value or "").split(",")
            if isinstance(value, dict) or any(isinstance(item, (dict, list, tuple)) for item in items):
                raise ValueError("expected a list of values (a YAML list, or comma-separated text), not a mapping or "
                                 "nested list")
            return [self.normal(str(item).strip()) for item in items if str(item).strip()]
        if value is None or (self.optional and isinstance(value, str) and value.lower() in ("none", "null")):
            if self.optional:
                return None
            raise ValueError(self.meta.refused.get("null", "a value is required"))
        if isinstance(value, (list, tuple)) and not (self.base is str and self.meta.commas):
            raise ValueError("expected one value, not a list")
        try:
            return self.normal(_COERCE[self.base](value))
        except ValueError:  # a refused value of another type (a boolean key's FSDP1 strategy name) says why
            why = {str(word).upper(): text for word, text in self.meta.refused.items()}.get(str(value).upper())
            if why is None:
                raise
            raise ValueError(why.format(key=self.name)) from None

    def normal(self, value: Any) -> Any:
        """The canonical spelling of a value: the choice it matches in any case, or what a spelling means."""
        if not isinstance(value, str):
            return value
        spelled = {str(c).upper(): c for c in (*self.choices, *self.meta.refused, *self.meta.idle)} | dict(
            self.meta.spellings)
        return spelled.get(value.upper(), value)

    def problems(self, value: Any) -> list[Problem]:
        """What is wrong with ``value`` on its own: a value outside the choices, a number out of bounds."""
        if value is None:
            return []
        found = [self._not_a_choice(item) for item in (value if self.is_list else [value])
                 if self.choices and item not in self.choices]
        m = self.meta
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not _within(value, m):
            found.append(Problem(self.name, f"{self.name}={value} must {_bounds_text(m)}"))
        return found

    def _not_a_choice(self, value: Any) -> Problem:
        if value in self.meta.refused:
            return Problem(self.name, f"{self.name}={value}: {self.meta.refused[value].format(key=self.name)}")
        if self.meta.refusal:
            return Problem(self.name, f"{self.name}={value!r} is not accepted: {self.meta.refusal}")
        hint = closest(str(value), [str(c) for c in self.choices])
        return Problem(self.name, f"{self.name}={value!r} is not accepted; use one of "
                                  f"{', '.join(map(str, self.choices))}{f' (did you mean {hint}?)' if hint else ''}")

    def described(self) -> str:
        """What docs/config.md, --help-keys and the JSON Schema say of it: what it does, its values, its names
        elsewhere."""
        text = self.meta.help
        if self.choices and not self.meta.refusal:  # a refusal says the one value itself
            text += f" One of: {', '.join(map(str, self.choices))}."
        if any(getattr(self.meta, bound) is not None for bound in ("ge", "gt", "le", "lt")):
            text += f" Must {_bounds_text(self.meta)}."
        if self.meta.aliases:
            text += f" Also read as {', '.join(f'{whose} `{a}`' for a, whose in self.meta.aliases.items())}."
        if self.meta.deepspeed:
            text += f" A DeepSpeed config sets it with {' or '.join(f'`{p}`' for p in self.meta.deepspeed)}."
        if self.meta.needs:
            text += f" Acts only with {self.meta.needs}."
        return text

    def type_text(self) -> str:
        name = f"list[{self.base.__name__}]" if self.is_list else self.base.__name__
        return f"{name} or unset" if self.optional else name


def shown(value: Any) -> str:
    """A default as docs/config.md and --help-keys write it: unset, true/false, or the value."""
    return "unset" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def parse_bool(value: Any) -> bool:
    """A boolean as recipes and the command line write it (true/false, yes/no, on/off, 1/0, any case)."""
    word = value if isinstance(value, bool) else _BOOLEANS.get(str(value).lower())
    if word is None:
        raise ValueError("expected true or false")
    return word


_BOOLEANS = {"true": True, "1": True, "yes": True, "y": True, "on": True,
             "false": False, "0": False, "no": False, "n": False, "off": False}


def _to_number(value: Any, kind: type) -> float:
    """``value`` as a whole number (``kind`` int) or a finite float; booleans are neither."""
    try:
        number = None if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        number = None
    if number is None or (kind is int and not number.is_integer()):
        raise ValueError("expected an integer" if kind is int else "expected a number")
    if not math.isfinite(number):
        raise ValueError("expected a finite number")
    return int(number) if kind is int else number


_COERCE = {bool: parse_bool, int: lambda v: _to_number(v, int), float: lambda v: _to_number(v, float),
           str: lambda v: ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)}


def _within(value: float, m: Key) -> bool:
    return ((m.ge is None or value >= m.ge) and (m.gt is None or value > m.gt)
            and (m.le is None or value <= m.le) and (m.lt is None or value < m.lt))


def _bounds_text(m: Key) -> str:
    """The bounds in words, as a problem says them: "be at least 1", "not be negative", "be in [0, 1)"."""
    ge, gt, le, lt = (None if b is None else str(int(b) if float(b).is_integer() else b) for b in (m.ge, m.gt, m.le,
                                                                                                    m.lt))
    if le is not None or lt is not None:
        return f"be from {ge} to {le}" if le is not None else f"be in [{ge}, {lt})"
    return {("0", None): "not be negative", (None, "0"): "be positive"}.get((ge, gt)) or \
        (f"be at least {ge}" if ge is not None else f"be above {gt}")


@functools.cache
def declared(cls: type, section: str = "") -> tuple[Declared, ...]:
    """Every key a section dataclass declares, in order."""
    found = []
    for f, hint in zip(dataclasses.fields(cls), (get_type_hints(cls)[f.name] for f in dataclasses.fields(cls))):
        optional = get_origin(hint) in (Union, types.UnionType) and type(None) in get_args(hint)
        inner = next(a for a in get_args(hint) if a is not type(None)) if optional else hint
        found.append(Declared(section, f.name, inner, optional, f.metadata["key"]))
    return tuple(found)


def value_problems(section: Any, idle: set[str] = frozenset()) -> list[Problem]:
    """Every problem of a section's values one by one (choices and bounds); rules between keys are not here.
    ``idle``: the keys whose setting is off, where their ``idle`` values are accepted."""
    return [problem for d in declared(type(section)) if not (d.name in idle and getattr(section, d.name) in d.meta.idle)
            for problem in d.problems(getattr(section, d.name))]


def _flow_list(text: str) -> Any:
    """A list written inline on the command line (JSON's or YAML's flow form, ``[a, b]``) as the list it says;
    the text itself where it is not one."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text
