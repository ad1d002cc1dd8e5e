"""Options declared once: dataclass fields that carry their help, flags and check.

A group of options (:class:`~prefixcache.engine.arg_utils.EngineArgs`,
:class:`~prefixcache.engine.arg_utils.KVEventsArgs`, the server's
:class:`~prefixcache.entrypoints.openai.server_args.ServerArgs`) is a dataclass deriving
from :class:`DeclaredOptions` whose fields are made with :func:`option`. Everything else is
derived from that one declaration:

- ``Cls(**values)`` checks every value once, in ``__post_init__``: a ValueError names the
  option, what it must be and what it got (``block_size must be a positive integer, got 0``).
- ``Cls.add_cli_args(parser)`` adds one argument group (``CLI_GROUP``; a field may name
  another with ``group=``) with a flag per field that has flags (the first flag is the
  main spelling, the rest aliases); the help ends with the default, as the command will
  use it.
- ``Cls.from_cli_args(namespace)`` builds the group from the parsed flags; fields the
  command did not add keep their defaults.

A field without flags is an option of the Python API only (e.g. ``hash_seed``).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, ClassVar

OPTION = "option"  # the field metadata key


@dataclass(frozen=True, slots=True)
class Option:
    """What one field declares besides its default.

    ``accepts`` tells a valid Python value, described by ``wanted`` in the error
    (``"a positive integer"``); for ``choices`` both default to membership. ``parse`` is
    the argparse ``type=`` for the flag; ``default_text`` shows the default in ``--help``
    when ``str(default)`` would not say it well (None: ``str(default)``, nothing for a
    default of None, enabled/disabled for a bool). ``nargs`` is argparse's (the value is
    then a list); ``group`` titles the argument group of the flag when it is not the
    class's ``CLI_GROUP``.
    """

    help: str
    flags: tuple[str, ...] = ()
    accepts: Callable[[Any], bool] | None = None
    wanted: str | None = None
    choices: Sequence[str] | None = None
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    default_text: str | None = None
    allow_none: bool = False
    nargs: str | None = None
    group: str | None = None


def option(default: Any, *flags: str, help: str, accepts: Callable[[Any], bool] | None = None,
           wanted: str | None = None, choices: Sequence[str] | None = None,
           parse: Callable[[str], Any] | None = None, metavar: str | None = None,
           default_text: str | None = None, nargs: str | None = None,
           group: str | None = None) -> Any:
    """A dataclass field declaring an option (see :class:`Option`). A default of None
    is always accepted: it means "unset" (the engine picks)."""
    if accepts is None and choices is not None:
        names = tuple(choices)
        accepts = lambda value: isinstance(value, str) and value in names  # noqa: E731
        wanted = wanted or f"one of {', '.join(names)}"
    elif accepts is None and isinstance(default, bool):
        accepts = lambda value: isinstance(value, bool)  # noqa: E731
        wanted = wanted or "True or False"
    spec = Option(help=help, flags=flags, accepts=accepts, wanted=wanted,
                  choices=tuple(choices) if choices is not None else None, parse=parse,
                  metavar=metavar, default_text=default_text, allow_none=default is None,
                  nargs=nargs, group=group)
    return field(default=default, metadata={OPTION: spec})


def is_int(value: Any) -> bool:
    """An int that is not a bool (``True`` is an int to Python, never a count to us)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_positive_int(value: Any) -> bool:
    return is_int(value) and value >= 1


def is_non_negative_int(value: Any) -> bool:
    return is_int(value) and value >= 0


def is_int64(value: Any) -> bool:
    return is_int(value) and -(2**63) <= value < 2**63


def is_positive_number(value: Any) -> bool:
    """A finite int or float > 0 (not a bool)."""
    return _is_finite_number(value) and value > 0


def is_non_negative_number(value: Any) -> bool:
    """A finite int or float >= 0 (not a bool)."""
    return _is_finite_number(value) and value >= 0


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


def is_str(value: Any) -> bool:
    return isinstance(value, str)


def is_non_blank_str(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


class DeclaredOptions:
    """Base of a dataclass of :func:`option` fields: validation on construction, and the
    command line built from the fields. ``CLI_GROUP`` titles the argument group."""

    CLI_GROUP: ClassVar[str] = "options"

    def __post_init__(self) -> None:
        for spec_field, spec in _declared(type(self)):
            value = getattr(self, spec_field.name)
            if spec.accepts is None or (value is None and spec.allow_none):
                continue
            if not spec.accepts(value):
                wanted = spec.wanted + (" or None" if spec.allow_none else "")
                raise ValueError(f"{spec_field.name} must be {wanted}, got {value!r}")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *,
                     exclude: Collection[str] = (), positional: Collection[str] = (),
                     defaults: Mapping[str, Any] | None = None) -> None:
        """Add a flag for every field with flags, in declaration order, to new groups of
        ``parser`` (``CLI_GROUP``, and any a field names). ``exclude``: fields the command
        leaves out (it has its own flag of the same spelling); ``positional``: fields
        taken as an optional positional argument instead of their flag; ``defaults``: the
        command's own defaults for some fields (shown in the help)."""
        defaults = dict(defaults or {})
        title_to_group: dict[str, argparse._ArgumentGroup] = {}
        for spec_field, spec in _declared(cls):
            name = spec_field.name
            if not spec.flags or name in exclude:
                continue
            title = spec.group or cls.CLI_GROUP
            if title not in title_to_group:
                title_to_group[title] = parser.add_argument_group(title)
            group = title_to_group[title]
            default = defaults.get(name, spec_field.default)
            kwargs: dict[str, Any] = {"default": default,
                                      "help": _help_with_default(spec, default)}
            if isinstance(spec_field.default, bool):
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = spec.parse
                if spec.choices is not None:
                    kwargs["choices"] = list(spec.choices)
                if spec.metavar is not None and name not in positional:
                    kwargs["metavar"] = spec.metavar
                if spec.nargs is not None:
                    kwargs["nargs"] = spec.nargs
            if name in positional:
                group.add_argument(name, nargs="?", **kwargs)
            else:
                group.add_argument(*spec.flags, dest=name, **kwargs)

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> Any:
        """The options the parsed flags set; a field the command did not add keeps its
        default. Raises ValueError as the constructor does."""
        values = {spec_field.name: getattr(namespace, spec_field.name)
                  for spec_field, _ in _declared(cls) if hasattr(namespace, spec_field.name)}
        return cls(**values)


def _declared(cls: type) -> list[tuple[Field, Option]]:
    return [(f, f.metadata[OPTION]) for f in fields(cls) if OPTION in f.metadata]


def _help_with_default(spec: Option, default: Any) -> str:
    text = spec.default_text
    if text is None and isinstance(default, bool):
        text = "enabled" if default else "disabled"
    elif text is None and default is not None and default is not MISSING:
        text = str(default)
    help_text = spec.help if text is None else f"{spec.help} (default: {text})"
    return help_text.replace("%", "%%")  # argparse %-formats help strings
