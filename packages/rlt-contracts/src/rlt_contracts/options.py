"""Options declared on the struct that reads them: one field, one option.

A field of an options struct (msgspec) is an option when its type is
`Annotated[T, Option(help, ...)]`. Its public name, the Python keyword of `build_options` and the
command line's `--kebab-case` flag, is the field's name unless `name` gives another (an older or
vLLM spelling, e.g. `kv_watermark` for `SchedulerConfig.watermark_ratio`); its help is one line;
its choices come from a `Literal` or enum type (or `choices`). A field whose type is itself an
options struct nests that struct's options; a field without `Option` is no option (set by the
engine, e.g. `SchedulerConfig.whole_prompts`).

- `option_fields(root)`: every option of a tree of structs, with where it lives (`path`).
- `build_options(root, flat)`: the tree from flat keywords, each to the struct that declares it.
- `replace_options(tree, flat)`: a copy with some options changed (the structs re-validated).
- `check_option_values(struct)`: the checks a field's type implies (choices, enums converted,
  booleans, positive integers), each error naming the option; a struct's `__post_init__` calls
  it and adds the checks its own fields need.
"""

from __future__ import annotations

import enum
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from rlt_contracts.errors import ConfigurationError

S = TypeVar("S", bound=msgspec.Struct)


@dataclass(frozen=True)
class Option:
    """How a field is offered: `help` (one line; `%(default)s` shows the default), `name`
    (public name, when not the field's), `flags` (the command line's spellings, when not
    --name), `metavar`, `choices` (when the type does not say them), `negatable` (a boolean:
    --x / --no-x; default: when the default is True), `positive` (an integer >= 1), `parse`
    (the value's parser, ValueError when invalid: the flag checks with it too); for the command
    line only: `env` (an environment variable that gives the flag's default) and
    `flag_default` (where the command line's default differs from Python's, e.g. a server's
    exit threshold: the model's own, where Python keeps fixed depth)."""

    help: str
    name: str | None = None
    flags: tuple[str, ...] = ()
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    negatable: bool | None = None
    positive: bool = False
    parse: Callable[[str], Any] | None = None
    env: str | None = None
    flag_default: Any = ...  # ...: the field's default


@dataclass(frozen=True)
class OptionField:
    """One option of a tree: `path` is the attribute path from the root (the struct fields
    leading to it, then its own field); `type` without None and Annotated."""

    name: str
    path: tuple[str, ...]
    type: Any
    optional: bool  # None is a value
    default: Any
    option: Option
    owner: type

    @property
    def flags(self) -> tuple[str, ...]:
        return self.option.flags or ("--" + self.name.replace("_", "-"),)

    @property
    def choices(self) -> tuple[str, ...] | None:
        if self.option.choices is not None:
            return self.option.choices
        if typing.get_origin(self.type) is typing.Literal:
            return typing.get_args(self.type)
        if isinstance(self.type, type) and issubclass(self.type, enum.Enum):
            return tuple(m.value for m in self.type)
        return None


def _split(annotation: Any) -> tuple[Any, Option | None, bool]:
    """(type without Annotated and None, its Option, whether None is allowed)."""
    option = None
    if typing.get_origin(annotation) is typing.Annotated:
        annotation, *extras = typing.get_args(annotation)
        option = next((e for e in extras if isinstance(e, Option)), None)
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        rest = tuple(a for a in args if a is not type(None))
        return (rest[0] if len(rest) == 1 else typing.Union[rest]), option, True  # noqa: UP007
    return annotation, option, False


def _is_struct(kind: Any) -> bool:
    return isinstance(kind, type) and issubclass(kind, msgspec.Struct)


def option_fields(root: type, path: tuple[str, ...] = ()) -> tuple[OptionField, ...]:
    """Every option of `root` and of the structs it nests, in declaration order."""
    found: list[OptionField] = []
    for info in msgspec.structs.fields(root):
        kind, option, optional = _split(info.type)
        if _is_struct(kind):
            found.extend(option_fields(kind, (*path, info.name)))
        elif option is not None:
            default = info.default
            if default is msgspec.NODEFAULT and info.default_factory is not msgspec.NODEFAULT:
                default = info.default_factory()
            name = option.name or info.name
            found.append(
                OptionField(name, (*path, info.name), kind, optional, default, option, root)
            )
    return tuple(found)


def _nested(root: type, options: Mapping[str, Any], what: str) -> dict[tuple[str, ...], dict]:
    """Flat options grouped by the struct path that declares them (unknown names refused)."""
    fields = {f.name: f for f in option_fields(root)}
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ConfigurationError(
            tuple(unknown), f"unknown {what} option(s); known: {sorted(fields)}"
        )
    grouped: dict[tuple[str, ...], dict] = {}
    for name, value in options.items():
        field = fields[name]
        grouped.setdefault(field.path[:-1], {})[field.path[-1]] = value
    return grouped


def build_options(root: type[S], options: Mapping[str, Any], *, what: str = "engine") -> S:
    """`root` built from flat options (`option_fields` names), each nested struct from its
    defaults and its own options; unknown names raise ConfigurationError naming them."""
    return replace_options(root(), options, what=what)


def replace_options(tree: S, options: Mapping[str, Any], *, what: str = "engine") -> S:
    """A copy of `tree` with these flat options changed (each changed struct re-validated)."""
    grouped = _nested(type(tree), options, what)

    def replace(struct: Any, path: tuple[str, ...]) -> Any:
        changes = dict(grouped.get(path, {}))
        for info in msgspec.structs.fields(struct):
            if any(p[: len(path) + 1] == (*path, info.name) for p in grouped if len(p) > len(path)):
                changes[info.name] = replace(getattr(struct, info.name), (*path, info.name))
        return msgspec.structs.replace(struct, **changes) if changes else struct

    return replace(tree, ())


def check_option_values(struct: msgspec.Struct) -> None:
    """The checks each option field's type implies (module doc); enum values given as their
    strings are converted to the enum."""
    for field in option_fields(type(struct)):
        if len(field.path) != 1:
            continue  # a nested struct checked itself when it was built
        value = getattr(struct, field.path[0])
        if value is None and field.optional:
            continue
        kind, name = field.type, field.name
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            try:
                msgspec.structs.force_setattr(struct, field.path[0], kind(value))
            except ValueError:
                raise ConfigurationError(
                    name, f"must be one of {list(field.choices)}, got {value!r}"
                ) from None
        elif field.choices is not None and value not in field.choices:
            raise ConfigurationError(name, f"must be one of {list(field.choices)}, got {value!r}")
        elif kind is bool and not isinstance(value, bool):
            raise ConfigurationError(name, f"must be True or False, got {value!r}")
        elif field.option.positive and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ConfigurationError(name, f"must be a positive integer, got {value!r}")
