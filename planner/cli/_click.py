"""The click that typer runs on.

typer 0.28 and later vendor click as ``typer._click`` and no longer depend on click (a light
install has no ``click`` at all); older typer runs on click itself. The CLI reaches click only
through here, so it works with either.
"""

from __future__ import annotations

from types import ModuleType


def click_module() -> ModuleType:
    try:
        from typer import _click  # typer >= 0.28

        return _click
    except ImportError:  # pragma: no cover - typer < 0.28
        import click

        return click


def exception_types() -> dict[str, tuple[type[BaseException], ...]]:
    """The exception classes ``main`` turns into exit codes, for the running typer."""
    import typer

    errors = click_module().exceptions
    # typer >= 0.29 has its own Exit/Abort; older typer re-exports click's
    optional = lambda name: (getattr(errors, name),) if hasattr(errors, name) else ()  # noqa: E731
    return {
        "exit": (typer.Exit, *optional("Exit")),
        "abort": (typer.Abort, *optional("Abort")),
        "no_args": (errors.NoArgsIsHelpError,),
        "usage": (errors.UsageError,),
        "missing": (errors.MissingParameter,),
    }


def echo(message: str, *, err: bool = False) -> None:
    click_module().echo(message, err=err)


__all__ = ["click_module", "echo", "exception_types"]
