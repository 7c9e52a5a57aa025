"""`rlt --version`: the installed versions of rlt's distributions (the engine, each package,
the services), then of the libraries a bug report needs (Python, torch, transformers).

Read from the installed distributions' metadata (`importlib.metadata`), so nothing is imported:
`rlt --version` answers at once, and says what is installed, not what a source tree holds.
"""

from __future__ import annotations

import argparse
import platform
from importlib import metadata

# the libraries whose versions decide rlt's behaviour, after rlt's own
LIBRARIES = ("torch", "triton", "transformers", "tokenizers", "xgrammar")


def rlt_distributions() -> dict[str, str]:
    """{name: version} of every installed distribution named rlt or rlt-*, sorted with rlt
    first."""
    found = {}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name == "rlt" or name.startswith("rlt-"):
            found[name] = dist.version
    return dict(sorted(found.items(), key=lambda item: (item[0] != "rlt", item[0])))


def versions_text() -> str:
    """One line per rlt distribution, then one line of the libraries under it."""
    lines = [f"{name} {version}" for name, version in rlt_distributions().items()]
    libraries = [f"python {platform.python_version()}"]
    for name in LIBRARIES:
        try:
            libraries.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    lines.append("with " + ", ".join(libraries))
    return "\n".join(lines)


class VersionsAction(argparse._VersionAction):
    """`--version`: print `versions_text()` (computed only when asked) and exit 0."""

    def __init__(
        self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None
    ):
        super().__init__(
            option_strings,
            dest=dest,
            default=default,
            help=help or "print the versions of rlt's distributions (and torch's, ...) and exit",
        )

    def __call__(self, parser, namespace, values, option_string=None):
        print(versions_text())  # on stdout, as argparse's own --version
        parser.exit()
