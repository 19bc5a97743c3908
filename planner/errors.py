"""The project's own error types.

Every user mistake is a ``PlannerError`` (a ``ValueError``) whose message is one line that says
what is wrong and how to fix it. The CLI prints that line and exits with ``exit_code``; the HTTP
layer maps it to a 4xx. ``assert`` is kept for internal invariants only.
"""

from __future__ import annotations


class PlannerError(ValueError):
    """A user mistake: one line with what is wrong and how to fix it."""

    #: exit code the CLI uses for this error
    exit_code: int = 2


class InvalidConfigError(PlannerError):
    """A training configuration that cannot exist (e.g. LoRA options with ``method=full``)."""


def choice(enum_type, value, name: str):
    """``value`` as a member of the str-valued ``enum_type``, or one line naming the option
    (``name`` with ``-`` for ``_``) and its choices: how every option with a fixed set of values
    is read (``TrainConfig``'s enums, ``Sharding``'s scheme and offload)."""
    if type(value) is enum_type:  # a member is of its class exactly (an enum with members has no subclasses)
        return value
    try:
        return enum_type(str(value))
    except ValueError:
        choices = "|".join(m.value for m in enum_type)
        option = name.replace("_", "-")
        raise InvalidConfigError(f"--{option} must be one of {choices}, got {value!r}") from None


class UnknownModelError(PlannerError):
    """A model id that is neither in the catalog, nor a local path, nor in the local HF cache."""


class ModelConfigError(PlannerError):
    """A config.json that cannot be read or lacks the fields the planner needs."""


class UnknownGPUError(PlannerError):
    """A GPU name that is not in the catalog."""


class UnsupportedError(PlannerError):
    """A combination the memory model does not cover; raised instead of leaving a term out."""


class NothingFitsError(PlannerError):
    """No configuration in the searched space fits the device.

    ``result`` (a ``planner.results.PlanResult`` without plans) carries the request and, per
    family, the closest try and why it does not fit, for ``--json``."""

    exit_code = 3

    def __init__(self, message: str, *, result: object = None) -> None:
        super().__init__(message)
        self.result = result


class MissingDependencyError(PlannerError):
    """An optional extra that a command needs is not installed."""


class StoreError(PlannerError):
    """The plan store cannot be used (unreachable database, unknown id, ...)."""


class SchemaOutOfDateError(StoreError):
    """The database schema is behind the code's models."""


class DatabaseMissingError(StoreError):
    """A store opened only to read (``create=False``) names an SQLite file that does not exist."""


class ClusterUnavailableError(PlannerError):
    """The Ray cluster (or its job API) cannot be reached, or has no node that can run the request."""

    exit_code = 4


class NoMatchingNodeError(ClusterUnavailableError):
    """The Ray cluster is up but no alive node has the requested accelerator type and count."""


class JobNotFoundError(PlannerError):
    """A Ray job id the cluster does not know."""


class RecordNotFoundError(StoreError):
    """An id (or id prefix) that names nothing in the store, or is not an id at all."""


class AmbiguousIdError(StoreError):
    """An id prefix that starts several ids."""


class UnstorableDataError(StoreError):
    """Data the store refuses to keep as it is (not plain JSON, a bad timestamp, an id too long)."""


class StatusTransitionError(StoreError):
    """A stored plan asked to leave a terminal status (verified, failed, measured), as Ray's
    ``JobStatus.is_terminal()`` jobs never leave theirs: plan again for a new verification."""


class NotEnoughMeasurementsError(PlannerError):
    """``planner calibrate`` has too few stored runs to fit any constant; the message says how
    many it needs and how to measure them."""

    exit_code = 5


class GPUDetectionError(UnknownGPUError):
    """``--gpu auto`` found no GPU it can plan for (no driver, no device, several models, or one
    the catalog does not hold)."""
