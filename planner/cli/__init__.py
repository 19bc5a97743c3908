"""The ``planner`` command line: each command parses, calls the library, prints.

Commands live in one module each and register themselves on the app; nothing heavy is imported
until a command that needs it runs (``planner --help`` never loads torch).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import re
import sys
from typing import Sequence

#: command modules, each with ``register(app)``
_COMMAND_MODULES = (
    "planner.cli.plan",
    "planner.cli.suggest_cmd",
    "planner.cli.jobs_cmd",
    "planner.cli.models_cmd",
    "planner.cli.gpus_cmd",
    "planner.cli.store",
    "planner.cli.emit_cmd",
    "planner.cli.serve_cmd",
    "planner.cli.calibrate_cmd",
    "planner.cli.check_cmd",
)
#: each command (or command group) of the app and the module that registers it
#: (tests/cli/test_cli_plan.py checks this against what the modules register): a run that names its
#: command builds only that module's commands, not every command's options
COMMANDS = {
    "estimate": "planner.cli.plan", "measure": "planner.cli.plan", "suggest": "planner.cli.suggest_cmd",
    "submit": "planner.cli.jobs_cmd", "jobs": "planner.cli.jobs_cmd", "models": "planner.cli.models_cmd",
    "gpus": "planner.cli.gpus_cmd", "history": "planner.cli.store", "show": "planner.cli.store", "db": "planner.cli.store",
    "emit": "planner.cli.emit_cmd", "serve": "planner.cli.serve_cmd", "calibrate": "planner.cli.calibrate_cmd",
    "check": "planner.cli.check_cmd",
}


@functools.cache
def get_app(command: str | None = None):
    """The typer app with every command, or only the commands of ``command``'s module."""
    import importlib

    import typer

    app = typer.Typer(
        name="planner",
        help="Find the fastest way to fine-tune a model on a GPU without running out of memory.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        # click's own help layout: rich's option table cuts a word longer than its column with
        # an ellipsis, and the choice lists ("full|lora|qlora", the optimizers' names) are one
        # word, so at 80 columns they were cut; click's wraps them, losing nothing
        rich_markup_mode=None,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    def show_version(value: bool) -> None:
        if value:
            from planner import __version__

            typer.echo(f"planner {__version__}")
            raise typer.Exit()

    @app.callback()
    def options(
        version: bool = typer.Option(False, "--version", callback=show_version, is_eager=True, help="Print the version and exit."),
    ) -> None:
        """Find the fastest way to fine-tune a model on a GPU without running out of memory."""

    for name in (COMMANDS[command],) if command in COMMANDS else _COMMAND_MODULES:
        importlib.import_module(name).register(app)
    return app


#: ``a|b|c`` in an option's help: a list of choices, written as one word
_CHOICES_RE = re.compile(r"(?<=[\w)])\|(?=[\w(])")


def _wrappable_help(group):
    """Show every choice list ``a|b|c`` of the options' help as ``a | b | c``.

    The help wraps at spaces only; one long word such as the list of the optimizers' names (48
    characters and more) was cut mid-name (or, by rich's layout, with an ellipsis) at 80 columns."""
    commands = [group, *getattr(group, "commands", {}).values()]
    for command in commands:
        for param in command.params:
            if getattr(param, "help", None):
                param.help = _CHOICES_RE.sub(" | ", param.help)
    return group


#: what a value of each pydantic error family (typer >= 0.29 converts option values with
#: pydantic: ``int_parsing``, ``float_parsing``, ``bool_parsing``; ``_click_problems`` words
#: older typer's click errors alike) must be
_EXPECTED = {"int": "a whole number", "float": "a number", "bool": "true or false"}


#: a whole number as the user may type it: echoed as a number (``got -1``), as the library's
#: errors echo theirs, not as a quoted string
_WHOLE_NUMBER = re.compile(r"[+-]?\d+")


def _shown(value: object, limit: int = 60) -> str:
    text = value.strip() if isinstance(value, str) and _WHOLE_NUMBER.fullmatch(value.strip()) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _typed(param: object, args: Sequence[str] = ()) -> tuple[str | None, str | None]:
    """(the option as the user typed it, its value): ``-n`` or ``--limit``, the last spelling of it
    in ``args``, whose value click keeps (None, None when it was not typed)."""
    opts = [o for o in getattr(param, "opts", None) or [] if isinstance(o, str)]
    options = [o for o in (*opts, *(getattr(param, "secondary_opts", None) or [])) if isinstance(o, str) and o.startswith("-")]
    typed, value = None, None
    for n, arg in enumerate(args):
        if arg == "--":
            break
        for option in options:
            long = option.startswith("--")
            if arg == option:
                typed, value = option, args[n + 1] if n + 1 < len(args) else None
            elif arg.startswith(option + "=" if long else option) and (long or len(option) == 2):
                typed, value = option, arg[len(option) + long:]
    return typed, value


def _param_name(param: object, args: Sequence[str] = ()) -> str | None:
    """The option as the user typed it (``_typed``), else its longest name; ``PLAN_ID`` for an
    argument."""
    typed = _typed(param, args)[0]
    if typed:
        return typed
    opts = [o for o in getattr(param, "opts", None) or [] if isinstance(o, str)]
    options = [o for o in (*opts, *(getattr(param, "secondary_opts", None) or [])) if isinstance(o, str) and o.startswith("-")]
    if options:
        return max((o for o in options if o in opts), key=len, default=max(options, key=len))
    return opts[0].upper() if opts else None


def _limits(param: object) -> tuple[object, object]:
    """An option's ``min``/``max``: typer >= 0.29 keeps them on the option, older typer on its
    click range type."""
    kept = getattr(param, "min", None), getattr(param, "max", None)
    if kept != (None, None):
        return kept
    kind = getattr(param, "type", None)
    return getattr(kind, "min", None), getattr(kind, "max", None)


def _click_problems(exc: BaseException, param: object, args: Sequence[str]) -> list[dict]:
    """click's own conversion errors as the pydantic problems ``usage_line`` words (typer < 0.29
    converts option values with click's types: "'abc' is not a valid integer", "0 is not in the
    range 1<=x<=100000"): the kind of value expected and the value as it was typed."""
    from planner.cli._click import click_module

    types = click_module().types
    kind = getattr(param, "type", None)
    family = ("int" if isinstance(kind, types.IntParamType) else "float" if isinstance(kind, types.FloatParamType)
              else None)
    value = _typed(param, args)[1]
    if family is None or value is None or not isinstance(exc, click_module().exceptions.BadParameter):
        return []
    try:
        number = int(value) if family == "int" else float(value)
    except ValueError:
        return [{"type": f"{family}_parsing", "input": value}]
    low, high = _limits(param)
    if low is not None and number < low:
        return [{"type": "greater_than_equal", "input": value}]
    if high is not None and number > high:
        return [{"type": "less_than_equal", "input": value}]
    return []


def _bounds(param: object, kind: str) -> str | None:
    """``a whole number from 1 to 100,000`` for an option declared with ``min``/``max`` that a
    value broke (pydantic's ``greater_than_equal``/``less_than_equal``), in the library's words."""
    if kind not in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        return None
    low, high = _limits(param)
    fmt = lambda v: f"{v:,}" if isinstance(v, int) else f"{v:g}"  # noqa: E731
    what = "a whole number" if isinstance(low if low is not None else high, int) else "a number"
    if low is not None and high is not None:
        return f"{what} from {fmt(low)} to {fmt(high)}"
    return f"{what} >= {fmt(low)}" if low is not None else f"{what} <= {fmt(high)}" if high is not None else None


def usage_line(exc: BaseException, *, missing: tuple[type[BaseException], ...], command: str | None = None,
               args: Sequence[str] = ()) -> str:
    """One line for a usage error, in the wording of the library's errors: ``error: --limit must
    be a whole number, got 'abc' (see 'planner history --help')``; the bad value is echoed and
    the option named as it was typed in ``args`` (``-n`` or ``--limit``).

    ``command``: the subcommand the arguments named, for errors click raises without a context
    (an option missing its value)."""
    ctx = getattr(exc, "ctx", None)
    path = ctx.command_path if ctx is not None else f"planner {command}" if command else "planner"
    where = f"planner {path.split(' ', 1)[1]} --help" if " " in path else "planner --help"
    param = getattr(exc, "param", None)
    name = _param_name(param, args)
    cause = exc.__cause__
    problems = (cause.errors() if hasattr(cause, "errors") and callable(cause.errors)
                else _click_problems(exc, param, args))
    if name and isinstance(exc, missing):
        problem = f"{name} is required"
    elif name and problems:
        kind, bad = str(problems[0].get("type", "")), problems[0].get("input")
        expected = _bounds(param, kind) or _EXPECTED.get(kind.split("_")[0])
        problem = (f"{name} must be {expected}, got {_shown(bad)}" if expected
                   else f"{name} {_shown(bad)} is not valid: {str(problems[0].get('msg', '')).lower()}")
    else:  # click's own wording ("No such option: --x (Possible options: ...)."), as a clause
        text = exc.format_message().strip().rstrip(".")
        problem = text[:1].lower() + text[1:]
    return f"error: {problem} (see '{where}')"


#: errors of writing the output (the device is full, over quota, failing)
_OUTPUT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point. Returns (and as a script exits with) the process exit code.

    User mistakes print one line on stderr: ``error: <what is wrong and how to fix it>``.
    """
    from planner.cli._click import echo, exception_types
    from planner.errors import PlannerError

    # typer's own Exit/Abort and its click's usage errors: a usage error is always one line
    types = exception_types()
    exits, aborts, no_args, usage = types["exit"], types["abort"], types["no_args"], types["usage"]

    args = list(sys.argv[1:] if argv is None else argv)
    import typer.main

    named = args[0] if args and args[0] in COMMANDS else None
    click_cmd = _wrappable_help(typer.main.get_command(get_app(named)))
    try:
        # without standalone mode, click returns a command's typer.Exit(n) code instead of raising
        result = click_cmd.main(args=args, prog_name="planner", standalone_mode=False)
        code = result if isinstance(result, int) and not isinstance(result, bool) else 0
    except exits as exc:  # --help, ctx.exit(n), typer.Exit(n)
        code = exc.exit_code
    except no_args as exc:
        echo(exc.ctx.get_help() if exc.ctx else "see 'planner --help'")
        code = 0
    except usage as exc:
        echo(usage_line(exc, missing=types["missing"], command=named, args=args), err=True)
        code = 2
    except aborts:
        echo("error: aborted", err=True)
        code = 1
    except PlannerError as exc:
        echo(f"error: {exc}", err=True)
        code = exc.exit_code
    except KeyboardInterrupt:
        echo("error: interrupted", err=True)
        code = 130
    except SystemExit as exc:  # click exits 1 itself when the reader of stdout went away (EPIPE)
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    except OSError as exc:
        # the output itself cannot be written (stdout on a full disk or /dev/full, a dead terminal):
        # the commands' own files are checked where they are written, as PlannerErrors
        if exc.errno not in _OUTPUT_ERRNOS:
            raise
        with contextlib.suppress(OSError):
            echo(f"error: cannot write the output ({exc.strerror}): free space, or send it to another file", err=True)
        code = 1

    if argv is None:
        sys.exit(code)
    return code
