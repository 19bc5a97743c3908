"""The ``planner`` command line: each command parses, calls the library, prints.

Commands live in one module each and register themselves on the app; nothing heavy is imported
until a command that needs it runs (``planner --help`` never loads torch).
"""

from __future__ import annotations

import functools
import sys
from typing import Sequence

#: command modules, each with ``register(app)``
_COMMAND_MODULES = (
    "planner.cli.plan",
    "planner.cli.suggest_cmd",
    "planner.cli.models_cmd",
    "planner.cli.gpus_cmd",
    "planner.cli.store",
    "planner.cli.emit_cmd",
)


@functools.cache
def get_app():
    import importlib

    import typer

    app = typer.Typer(
        name="planner",
        help="Find the fastest way to fine-tune a model on a GPU without running out of memory.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
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

    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(app)
    return app


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
    command = get_app()
    try:
        import typer.main

        click_cmd = typer.main.get_command(command)
        # without standalone mode, click returns a command's typer.Exit(n) code instead of raising
        result = click_cmd.main(args=args, prog_name="planner", standalone_mode=False)
        code = result if isinstance(result, int) and not isinstance(result, bool) else 0
    except exits as exc:  # --help, ctx.exit(n), typer.Exit(n)
        code = exc.exit_code
    except no_args as exc:
        echo(exc.ctx.get_help() if exc.ctx else "see 'planner --help'")
        code = 0
    except usage as exc:
        ctx = getattr(exc, "ctx", None)
        path = ctx.command_path if ctx is not None else "planner"
        where = f"planner {path.split(' ', 1)[1]} --help" if " " in path else "planner --help"
        echo(f"error: {exc.format_message()} (see '{where}')", err=True)
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

    if argv is None:
        sys.exit(code)
    return code
