"""Command lines that explain themselves: every option's help shows its default, and a bad
command line prints the usage of the (sub)command it was given to.

`rlt`, `rlt pd serve` and `rlt ray ...` build their parsers with argparse and pass them through
`explain_defaults(parser)` once built; they parse with `parse_command_line(parser, argv)`.

- A help text that already says its default (e.g. "default: the model depth") is left as it
  is; otherwise the formatter appends the default: `(default: 8000)`, a flag's `(default: off)`
  (or `on`), a repeatable option's `(default: none)`. An option whose default is None must say
  what None means itself (the formatter cannot know: "sized from free memory" is not "none");
  `undocumented_options` lists the ones that do not, and a test walks every command with it.
- argparse reports an unknown flag given to a subcommand with the top-level usage (the parent
  collects the subcommand's leftovers); `parse_command_line` reports it with the usage of the
  innermost subcommand that was chosen, as every other error of that subcommand is.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence

# the namespace attribute naming the innermost chosen (sub)command's parser
COMMAND_PARSER = "_command_parser"


def default_text(action: argparse.Action) -> str | None:
    """How the help shows `action`'s default; None where the help text must say it."""
    default = action.default
    if default is None or default is argparse.SUPPRESS:
        return None
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, list | tuple) and not default:
        return "none"
    return str(default).replace("%", "%%")  # the help is %-formatted after this


def says_its_default(help_text: str) -> bool:
    return "default" in help_text.lower()


class _DefaultsShown:
    """Formatter mix-in: the default appended to a help text that does not give it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if not action.option_strings or says_its_default(help_text):
            return help_text
        shown = default_text(action)
        if shown is None:
            return help_text
        return f"{help_text} (default: {shown})" if help_text else f"(default: {shown})"


def commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """(command words, parser) of `parser` and of every subcommand below it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))


def explain_defaults(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Give `parser` and its subcommands the defaults-showing formatter (keeping each one's
    own way of laying out its description) and mark each subcommand's parser so that
    `parse_command_line` reports errors with its usage. Returns `parser`."""
    for _, command in commands(parser):
        base = command.formatter_class
        if not issubclass(base, _DefaultsShown):
            command.formatter_class = type(
                f"DefaultsShown{base.__name__}", (_DefaultsShown, base), {}
            )
        command.set_defaults(**{COMMAND_PARSER: command})
    return parser


def parse_command_line(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """`parser.parse_args(argv)`, except that an unknown argument is reported with the usage of
    the subcommand it was given to (exit 2)."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = getattr(args, COMMAND_PARSER, None) or parser
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def rendered_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """`action`'s help as `parser --help` shows it (defaults appended, %-expanded)."""
    formatter = parser._get_formatter()
    return formatter._expand_help(action) if action.help else ""


def undocumented_options(parser: argparse.ArgumentParser) -> list[str]:
    """The options of `parser` (not its subcommands) whose help lacks a meaning or a default:
    "--flag: why" each. -h/--help and --version explain themselves."""
    found = []
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._HelpAction | argparse._VersionAction):
            continue
        name = "/".join(action.option_strings)
        shown = rendered_help(parser, action)
        meaning = shown.lower().split("(default")[0].split("default:")[0].strip(" ;,(")
        if len(meaning.split()) < 2:
            found.append(f"{name}: no meaning in its help ({shown!r})")
        elif not says_its_default(shown):
            found.append(f"{name}: its help does not say its default ({shown!r})")
    return found
