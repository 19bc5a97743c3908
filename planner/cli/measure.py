"""Placeholder: commands of this module are being written."""


def register(app) -> None:  # pragma: no cover - replaced by the real module
    pass
