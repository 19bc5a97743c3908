"""Small helpers shared by the command modules: output and option parsing."""

from __future__ import annotations

import json
from typing import Any


def print_json(obj: Any) -> None:
    """Print one JSON document on stdout (sorted keys stay in the order we built them)."""
    from planner.cli._click import echo

    echo(json.dumps(obj, indent=2, default=str))


def user_text(text: object) -> str:
    """``text`` made safe to print with rich: its ``[...]`` is shown, never read as markup.

    Every string the user or a config.json supplied (model ids, paths, names, search words)
    goes through this before rich renders it: ``org/model[/bold]`` would otherwise raise
    ``rich.errors.MarkupError`` and a folder ``llama[v2]`` would print as ``llama``."""
    from rich.markup import escape

    return escape(str(text))


#: How every console of the CLI reads strings: as plain text. The CLI styles with ``style=``
#: arguments, never with markup, and most of what it prints comes from the user or a
#: config.json (model ids, paths, LoRA targets, error texts): with markup on, ``org/model[/bold]``
#: raised ``rich.errors.MarkupError`` (after the plan was stored, so every later ``history``
#: crashed too), a folder ``llama[v2]`` printed as ``llama`` and ``:fire:`` became an emoji.
#: Off here, no print site can forget to escape; tests/cli/test_hardening_cli.py holds every
#: command to it.
PLAIN_TEXT = {"markup": False, "emoji": False, "highlight": False}


def console():
    """A rich console on stdout; wide enough that tables are not wrapped in pipes and tests."""
    from rich.console import Console

    return Console(soft_wrap=False, width=max(160, Console().width), **PLAIN_TEXT)


def console_to_stderr():
    """A rich console on stderr, for what --json output must not be mixed with."""
    from rich.console import Console

    return Console(stderr=True, **PLAIN_TEXT)


def catalog_gpu(gpu: str) -> str:
    """``--gpu`` as the library takes it: ``auto`` finds this machine's GPU through NVML and says
    on stderr what it found (``planner.detect``); any other name is passed on as given."""
    from planner.detect import AUTO, detect_gpu

    if gpu.strip().lower() != AUTO:
        return gpu
    detected = detect_gpu()
    console_to_stderr().print(detected.describe())
    return detected.name
