"""Settings: what a model's ``config.attnorm`` holds, validated.

A setting ("option") is declared by the normalizer or scale file that uses it, with its type, default, help text
and range check, so a new normalizer brings its own options without editing this file. ``AttnormSettings`` is the
validated, immutable result: the implementation (preset) name, the normalizer, the scale, and the values of exactly
the options those two use. It round-trips through ``to_dict``/``from_dict`` (config.json, safetensors metadata).
"""

from __future__ import annotations

import dataclasses
import json
import math
import reprlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .registry import NORMALIZERS, PRESETS, SCALES, AttnormError, Registry

#: keys of ``config.attnorm`` that are not options
CORE_KEYS = ("implementation", "normalizer", "scale")
#: informational keys written on save and ignored on load
INFO_KEYS = ("hf_attnorm_version",)


@dataclasses.dataclass(frozen=True)
class Option:
    """One setting: name, type, default and help text; ``check`` returns an error message or None."""

    name: str
    kind: type
    default: Any
    help: str
    optional: bool = False  # None allowed (meaning documented in help)
    choices: tuple[Any, ...] | None = None
    check: Callable[[Any], str | None] | None = None

    def coerce(self, value: Any, owner: str) -> Any:
        where = f"attnorm option {self.name!r} (used by {owner})"
        if value is None:
            if self.optional:
                return None
            raise AttnormError(f"{where} must not be None; {self.help}")
        if self.kind is bool:
            if not isinstance(value, bool):
                raise AttnormError(f"{where} must be true or false, got {value!r}")
        elif self.kind is int:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or float(value) != int(value):
                raise AttnormError(f"{where} must be an integer, got {value!r}")
            value = int(value)
        elif self.kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise AttnormError(f"{where} must be a number, got {value!r}")
            value = float(value)
            if not math.isfinite(value):
                raise AttnormError(f"{where} must be finite, got {value!r}")
        elif self.kind is str:
            if not isinstance(value, str):
                raise AttnormError(f"{where} must be a string, got {value!r}")
        elif self.kind in (dict, list):
            # structured options (e.g. a fitted table) must survive config.json: plain JSON data, copied so the
            # frozen settings do not alias the caller's object; JSON text is accepted too (command lines)
            kind = "a JSON object (dict)" if self.kind is dict else "a JSON array (list)"
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise AttnormError(f"{where} must be {kind} or its JSON text; the text does not parse: {e}") \
                        from None
            if not isinstance(value, self.kind):
                raise AttnormError(f"{where} must be {kind}, got {type(value).__name__}")
            try:
                value = json.loads(json.dumps(value, allow_nan=False))
            except (TypeError, ValueError) as e:
                raise AttnormError(f"{where} must hold only finite JSON data (numbers, strings, lists, dicts): "
                                   f"{e}") from None
        if self.choices is not None and value not in self.choices:
            raise AttnormError(f"{where} must be one of {list(self.choices)}, got {value!r}")
        if self.check is not None:
            problem = self.check(value)
            if problem:
                shown = reprlib.repr(value) if isinstance(value, dict | list) else repr(value)
                raise AttnormError(f"{where} {problem}, got {shown}")
        return value


OPTIONS: Registry[Option] = Registry("option")
#: options every normalizer and scale accepts (a generic step such as learned memory key/values owns them); left out
#: of ``to_dict`` at their default, so settings and checkpoints that do not use them are unchanged
GLOBAL_OPTIONS: list[str] = []


def declare_option(
    name: str,
    kind: type,
    default: Any,
    help: str,
    *,
    optional: bool = False,
    choices: tuple[Any, ...] | None = None,
    check: Callable[[Any], str | None] | None = None,
    everywhere: bool = False,
) -> str:
    """Declare an option (once, in the file of the component that owns it) and return its name. ``everywhere``:
    accepted with every normalizer and scale (``GLOBAL_OPTIONS``)."""
    OPTIONS.add(name, Option(name, kind, default, help, optional, choices, check))
    if everywhere:
        GLOBAL_OPTIONS.append(name)
    return name


def nonnegative(v: float) -> str | None:
    return "must be >= 0" if v < 0 else None


def positive(v: float) -> str | None:
    return "must be > 0" if v <= 0 else None


def open_unit(v: float) -> str | None:
    return "must lie strictly between 0 and 1" if not 0.0 < v < 1.0 else None


class FrozenOptions(dict):
    """The options of an ``AttnormSettings``: a dict that refuses changes (the settings are frozen; a changed copy
    comes from ``AttnormSettings.replace``). Copies and pickles as a plain mapping."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("AttnormSettings options are read-only; use settings.replace(name=value)")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse  # type: ignore[assignment]

    def __reduce__(self):
        return (type(self), (dict(self),))


#: the first line of the error an edit of ``model.config.attnorm`` raises
READ_ONLY_MESSAGE = (
    "model.config.attnorm is read-only: it records the settings the model runs with and saves. Change them with "
    "hf_attnorm.apply(model, implementation, **options) (e.g. hf_attnorm.apply(model, 'symax', eta=0.25)), which "
    "validates them, keeps learned values whose settings did not change and updates every attention module"
)


class ConfigSettings(dict):
    """``model.config.attnorm`` of a model set up by hf_attnorm: the settings as a plain-JSON dict that refuses
    in-place edits (nested dicts and lists too), so the settings a model saves are always the ones it runs with.
    It serialises, copies, deep-copies and pickles as a dict (transformers' ``to_dict``/``save_pretrained``, PEFT);
    copies stay read-only."""

    def __init__(self, data: Mapping[str, Any] = ()) -> None:
        super().__init__({k: _read_only(v) for k, v in dict(data).items()})

    # a call that would change nothing is no edit and passes (transformers' to_dict pops keys it never finds from
    # every nested dict); one that would change something raises
    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise AttnormError(READ_ONLY_MESSAGE)

    __delitem__ = popitem = _refuse  # type: ignore[assignment]

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in self or self[key] != value:
            self._refuse()

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        if any(k not in self or self[k] != v for k, v in dict(*args, **kwargs).items()):
            self._refuse()

    def __ior__(self, other: Any) -> ConfigSettings:  # type: ignore[override]
        self.update(other)
        return self

    def pop(self, key: str, *default: Any) -> Any:  # type: ignore[override]
        if key in self or not default:
            self._refuse()
        return default[0]

    def setdefault(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        if key not in self:
            self._refuse()
        return self[key]

    def clear(self) -> None:
        if self:
            self._refuse()

    def __reduce__(self):
        return (type(self), (_plain(self),))

    def __deepcopy__(self, memo: dict) -> ConfigSettings:
        return type(self)(_plain(self))


class _ReadOnlyList(list):
    """A list value inside ``ConfigSettings`` (a structured option): refuses edits like its owner."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise AttnormError(READ_ONLY_MESSAGE)

    __setitem__ = __delitem__ = append = extend = insert = pop = remove = clear = sort = reverse = _refuse  # type: ignore[assignment]
    __iadd__ = __imul__ = _refuse  # type: ignore[assignment]

    def __reduce__(self):
        return (list, (_plain(self),))

    def __deepcopy__(self, memo: dict) -> _ReadOnlyList:
        return _ReadOnlyList(_read_only(x) for x in _plain(self))


def _read_only(value: Any) -> Any:
    if isinstance(value, Mapping):
        return ConfigSettings(value)
    if isinstance(value, list | tuple):
        return _ReadOnlyList(_read_only(x) for x in value)
    return value


def _plain(value: Any) -> Any:
    """A read-only value as plain, independent dicts and lists (for copies and pickles)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(x) for x in value]
    return value


class OptionError(AttnormError):
    """A ``key=value`` option text that does not parse; the message names the key and what is allowed."""


#: the words a boolean option accepts on a command line (any case)
TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")


def parse_option_text(name: str, text: str) -> Any:
    """The value of option ``name`` written as command-line text, typed by its declaration: booleans take
    true/false/yes/no/on/off/1/0, numbers their usual spelling, dict/list options JSON, ``null``/``none`` means None
    (refused later unless the option is optional). Ranges are checked by ``resolve_settings``, and so are names
    no component declares: they stay text here, and ``resolve_settings`` refuses them naming the options that the
    chosen normalizer and scale use."""
    if name in ("normalizer", "scale") or name not in OPTIONS:
        return text
    kind = OPTIONS.get(name).kind
    low = text.strip().lower()
    if low in ("null", "none"):
        return None
    if kind is bool:
        if low in TRUE_WORDS or low in FALSE_WORDS:
            return low in TRUE_WORDS
        raise OptionError(f"option {name} must be true or false ({'/'.join(TRUE_WORDS + FALSE_WORDS)}), "
                          f"got {text!r}")
    if kind is int:
        try:
            return int(low)
        except ValueError:
            raise OptionError(f"option {name} must be an integer, got {text!r}") from None
    if kind is float:
        try:
            return float(low)
        except ValueError:
            raise OptionError(f"option {name} must be a number, got {text!r}") from None
    if kind in (dict, list):
        try:
            return json.loads(text)
        except ValueError as e:
            raise OptionError(f"option {name} must be JSON text of a {kind.__name__}: {e}") from None
    return text


def parse_option_pairs(pairs: Iterable[str]) -> dict[str, Any]:
    """``["eta=0.5", "ssmax_learnable=yes"]`` -> ``{"eta": 0.5, "ssmax_learnable": True}``: the one grammar of
    options written as text (training's ``--attnorm``, evaluation's ``name:key=value,...`` variants, scripts).
    ``normalizer`` and ``scale`` are accepted as plain names; a key given twice is an error."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise OptionError(f"options are KEY=VALUE, got {pair!r}")
        if key in out:
            raise OptionError(f"option {key} is given twice")
        out[key] = parse_option_text(key, raw.strip())
    return out


@dataclasses.dataclass(frozen=True)
class AttnormSettings:
    """Validated settings of one model: the implementation name, its normalizer and scale, and their options.

    Fields:
        implementation: the registered attention-implementation (preset) name, e.g. ``"ssmax"``.
        normalizer: normalizer name (see ``hf_attnorm.available("normalizers")``).
        scale: length-aware scale name (see ``hf_attnorm.available("scales")``).
        options: values of exactly the options the normalizer and scale use (defaults filled in).
    """

    implementation: str
    normalizer: str
    scale: str
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", FrozenOptions(self.options))
        # options read as plain attributes (settings.eta, settings.n_extra): ordinary instance attributes, so
        # torch.compile traces them without a graph break
        for name, value in self.options.items():
            if name in self.__dataclass_fields__ or hasattr(type(self), name):
                raise AttnormError(f"option name {name!r} collides with an AttnormSettings attribute")
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        # only reached for names that are not options
        if name.startswith("__"):
            raise AttributeError(name)
        options = self.__dict__.get("options", {})
        raise AttributeError(
            f"{name!r} is not an option of normalizer {self.normalizer!r} with scale {self.scale!r}"
            f" (its options: {sorted(options)})"
        )

    def to_dict(self) -> dict[str, Any]:
        opts = {k: v for k, v in sorted(self.options.items())
                if not (k in GLOBAL_OPTIONS and v == OPTIONS.get(k).default)}
        return {"implementation": self.implementation, "normalizer": self.normalizer, "scale": self.scale, **opts}

    def to_config(self) -> ConfigSettings:
        """``to_dict`` as the read-only dict a model's ``config.attnorm`` holds."""
        return ConfigSettings(self.to_dict())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AttnormSettings:
        """Validate a full settings dict (as saved in config.json). ``implementation`` is required."""
        if "implementation" not in data:
            raise AttnormError(f"attnorm settings need an 'implementation' key; got keys {sorted(data)}")
        data = dict(data)
        return resolve_settings(data.pop("implementation"), data)

    def replace(self, **changes: Any) -> AttnormSettings:
        return resolve_settings(self.implementation, {**self.to_dict(), **changes})


def settings_core(d: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A settings dict without its informational keys (the version that wrote it): what two checkpoints must
    share to hold the same attention."""
    return None if d is None else {k: v for k, v in d.items() if k not in INFO_KEYS}


def option_names(normalizer: str, scale: str) -> tuple[str, ...]:
    norm, sc = NORMALIZERS.get(normalizer), SCALES.get(scale)
    names = tuple(dict.fromkeys((*norm.options, *sc.options, *GLOBAL_OPTIONS)))
    return names


def resolve_settings(implementation: str, overrides: Mapping[str, Any] | None = None) -> AttnormSettings:
    """Merge a preset with user overrides and validate every field.

    ``overrides`` may change the normalizer and the scale too; every other key must be an option used by the
    resulting normalizer or scale (anything else is an error: nothing is silently ignored).
    """
    preset = PRESETS.get(implementation)
    overrides = dict(overrides or {})
    if not isinstance(overrides, dict):
        raise AttnormError(f"attnorm settings must be a dict, got {type(overrides).__name__}")
    given_impl = overrides.pop("implementation", implementation)
    if given_impl != implementation:
        raise AttnormError(
            f"attnorm settings name implementation {given_impl!r} but the model uses {implementation!r}"
        )
    for key in INFO_KEYS:
        overrides.pop(key, None)
    merged = {**preset.settings, **overrides}
    normalizer = merged.pop("normalizer")
    scale = merged.pop("scale")
    NORMALIZERS.get(normalizer)  # raise UnknownNameError with the list
    SCALES.get(scale)
    allowed = option_names(normalizer, scale)
    unknown = sorted(k for k in merged if k not in allowed)
    if unknown:
        known_anywhere = [k for k in unknown if k in OPTIONS]
        hint = ""
        if known_anywhere:
            hint = f" ({', '.join(known_anywhere)} belong to other normalizers/scales)"
        raise AttnormError(
            f"attnorm option(s) {unknown} are not used by normalizer {normalizer!r} with scale {scale!r}{hint}; "
            f"allowed: {list(CORE_KEYS) + list(allowed)}"
        )
    options: dict[str, Any] = {}
    for name in allowed:
        opt = OPTIONS.get(name)
        owner = (f"normalizer {normalizer!r}" if name in NORMALIZERS.get(normalizer).options
                 else f"scale {scale!r}" if name in SCALES.get(scale).options else "every normalizer")
        options[name] = opt.coerce(merged.get(name, opt.default), owner)
    settings = AttnormSettings(implementation, normalizer, scale, options)
    NORMALIZERS.get(normalizer).validate(settings)
    SCALES.get(scale).validate(settings)
    return settings
