"""Command-line flags generated from option structs (`rlt_contracts.options`): one flag per
field, with the field's name (or its declared vLLM spelling), type, default, help and choices;
one argument group per struct, titled by the first line of its docstring. A tuple field is
repeatable (each flag one item) unless its `parse` reads the whole tuple from one value (a
command split like a shell's); a dict field with `parse` is repeatable too, each flag one
(key, value) item (e.g. NAME=AMOUNT; without `parse`, one JSON object).

`add_engine_flags(parser)` gives a command every engine option (`rlt_contracts.EngineOptions`)
plus vLLM's aliases of them (--enforce-eager; --trust-remote-code, --tensor-parallel-size:
rlt_serve.vllm_flags). `rlt generate`, `rlt serve`, `rlt pd serve`, `rlt ray serve` and
`rlt ray pd serve` all take their engine options from it, so an option added to a struct
appears on each of them with the same help. `engine_options_from_args(args)` reads them back
as the flat keywords of `EngineConfig.from_options`.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import typing
from collections.abc import Collection
from typing import Any

from rlt_contracts.engine_options import EngineOptions
from rlt_contracts.options import OptionField, option_fields

from rlt_serve.vllm_flags import add_model_arguments

VLLM_GROUP = "flags from vLLM (docs/serving.md)"
# engine options of `rlt serve` alone (an instance's PD role): the other commands run whole
# engines or assign the roles themselves
INSTANCE_ONLY = ("pd_role",)


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _checked(parse):
    def checked(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    checked.__name__ = parse.__name__
    return checked


def int_or_auto(text: str) -> int | str:
    return "auto" if text.lower() == "auto" else int(text)


def int_or_none(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def _value_type(field: OptionField):
    """The argparse `type` of a non-boolean option without choices."""
    if field.option.parse is not None:
        return _checked(field.option.parse)
    kind = field.type
    if kind is int:
        return int_or_none if field.optional and field.default is not None else int
    if kind is float:
        return float
    if typing.get_origin(kind) is dict:
        return json_object
    if int in typing.get_args(kind):  # int | Literal["auto"]
        return int_or_auto
    return None  # a string or a path


def flag_arguments(field: OptionField) -> dict[str, Any]:
    """`add_argument`'s keywords for one option."""
    option = field.option
    default = field.default if option.flag_default is ... else option.flag_default
    default = default.value if isinstance(default, enum.Enum) else default
    if option.env is not None:
        default = os.environ.get(option.env, default)
    kwargs: dict[str, Any] = {"dest": field.name, "default": default, "help": option.help}
    if option.metavar:
        kwargs["metavar"] = option.metavar
    if field.type is bool:
        negatable = option.negatable if option.negatable is not None else default is True
        if negatable:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["action"] = "store_false" if default else "store_true"
    elif field.choices is not None:
        kwargs["choices"] = list(field.choices)
    elif typing.get_origin(field.type) is dict and option.parse is not None:  # repeatable items
        kwargs.update(action="append", default=list(default.items()), type=_value_type(field))
    elif typing.get_origin(field.type) is tuple and option.parse is None:  # repeatable
        kwargs.update(action="append", default=list(default))
    else:
        kwargs["type"] = _value_type(field)
    return kwargs


def add_option_flags(
    parser: argparse.ArgumentParser,
    root: type,
    *,
    exclude: Collection[str] = (),
    only: Collection[str] | None = None,
) -> None:
    """A flag for every option of `root`'s tree (but `exclude`; only `only` when given)."""
    groups: dict[type, Any] = {}
    for field in option_fields(root):
        if field.name in exclude or (only is not None and field.name not in only):
            continue
        if field.owner not in groups:
            title = (field.owner.__doc__ or "").strip().splitlines()[0]
            groups[field.owner] = parser.add_argument_group(title)
        groups[field.owner].add_argument(*field.flags, **flag_arguments(field))


def add_engine_flags(
    parser: argparse.ArgumentParser,
    *,
    exclude: Collection[str] = INSTANCE_ONLY,
    only: Collection[str] | None = None,
) -> None:
    """Every engine option (module doc; not `INSTANCE_ONLY` unless `exclude` says otherwise)
    and vLLM's aliases of them."""
    add_option_flags(parser, EngineOptions, exclude=exclude, only=only)
    group = parser.add_argument_group(VLLM_GROUP)
    if only is None:
        group.add_argument(
            "--enforce-eager",
            action="store_true",
            help="no CUDA graphs: the same as --no-cuda-graphs (default: off, graphs on CUDA)",
        )
    add_model_arguments(group)


def options_from_args(args: argparse.Namespace, root: type) -> dict[str, Any]:
    """The flat options of `root`'s tree that parsed flags give (those the command declares;
    the rest keep their defaults); a repeated flag's values as a tuple (a dict's items as the
    dict)."""
    found = {}
    for field in option_fields(root):
        if hasattr(args, field.name):
            value = getattr(args, field.name)
            if isinstance(value, list):
                value = (dict if typing.get_origin(field.type) is dict else tuple)(value)
            found[field.name] = value
    return found


def engine_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flat engine options of parsed flags. vLLM's --enforce-eager turns the decode and
    prompt graphs off."""
    options = options_from_args(args, EngineOptions)
    if getattr(args, "enforce_eager", False):
        options.update(cuda_graphs=False, prefill_cuda_graphs=False)
    return options
