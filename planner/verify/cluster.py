"""Joining or starting Ray, and checking at once that the cluster can run the request.

With no address (and no ``RAY_ADDRESS``, which a Ray job's driver always has) Ray starts embedded
on this machine and is shut down afterwards; with one (``auto``, ``ray://HOST:10001`` or the
head's ``HOST:6379``) the run joins that cluster. Nothing waits for a node that does not exist:
a cluster without a node of the requested accelerator type is a one-line error at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections import Counter
from typing import TYPE_CHECKING, Any, Iterator

from planner.errors import ClusterUnavailableError, InvalidConfigError, MissingDependencyError, NoMatchingNodeError
from planner.verify.accelerators import node_accelerator_types, node_can_run, ray_accelerator

if TYPE_CHECKING:  # pragma: no cover
    from planner.gpus import GPUSpec

#: seconds to wait for a TCP answer from a cluster address before calling it unreachable
CONNECT_TIMEOUT_S = 5.0
#: where an address can come from, as messages name it: the option, or the environment variable Ray's own
#: ``ray.init()`` reads when given no address (a Ray job's driver has it set)
OPTION = "--ray-address"
ENV_VAR = "RAY_ADDRESS"
#: the address forms the option and the variable take
_FORMS = "auto, HOST:6379 (the head's GCS) or ray://HOST:10001"


def import_ray() -> Any:
    """``ray``, or one line naming the extra to install."""
    try:
        import ray
    except ImportError:
        raise MissingDependencyError(
            "verification runs on Ray, which is not installed: pip install 'oom-planner[ray]'"
        ) from None
    return ray


def _malformed(address: str, source: str, what: str, use: str = "") -> InvalidConfigError:
    """The one line for an address of no Ray form, naming where it came from (``source``) and how to fix it there."""
    if source == ENV_VAR:
        return InvalidConfigError(f"the environment variable {ENV_VAR}={address!r} {what}: {use}set it to {_FORMS}, "
                                  f"unset it (unset {ENV_VAR}) to start Ray on this machine, or give {OPTION}")
    return InvalidConfigError(f"{OPTION} {address!r} {what}: {use}give {_FORMS}")


def _host_port(address: str, source: str = OPTION) -> tuple[str, int] | None:
    """(host, port) of ``HOST:PORT`` or ``ray://HOST:PORT``; None for ``auto``. An address of no such form is
    bad input (exit 2, as every malformed option), not a cluster that cannot be reached (exit 4)."""
    if address == "auto":
        return None
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit() or not host or not 1 <= int(port) <= 65535:
        raise _malformed(address, source, "is not a Ray address")
    return host.strip("[]"), int(port)


def check_reachable(address: str, source: str = OPTION) -> None:
    """Fail in seconds, not minutes, when nothing listens at ``address`` (ray.init would retry); ``source`` is
    where the address came from (``OPTION`` or ``ENV_VAR``), which the messages name."""
    if address.startswith(("http://", "https://")):
        raise _malformed(address, source, "is a dashboard (job API) address",
                         "use it with 'planner submit --address'; for verification runs ")
    target = _host_port(address, source)
    if target is None:
        return
    try:
        socket.create_connection(target, timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise ClusterUnavailableError(
            f"cannot reach the Ray cluster at {address}{' (from ' + ENV_VAR + ')' if source == ENV_VAR else ''}: "
            f"{exc.strerror or exc}; start it with 'ray start --head' or check the address"
        ) from None


def check_joined(address: str | None) -> str | None:
    """The address a run joins, ``address`` (``OPTION``) or else ``ENV_VAR`` (None: Ray starts embedded), checked
    by ``check_reachable`` with the messages naming where it came from."""
    joined = address or os.environ.get(ENV_VAR)
    if joined:  # its own line: a malformed address (exit 2) or nothing listening there (exit 4)
        check_reachable(joined, OPTION if address else ENV_VAR)
    return joined


@contextlib.contextmanager
def ray_session(*, address: str | None, num_cpus: int | None = None) -> Iterator[str]:
    """Ray, initialised for the block: joined at ``address`` (or ``RAY_ADDRESS``), else started
    embedded with ``num_cpus`` and shut down at the end. Yields where it runs, for messages."""
    ray = import_ray()
    if ray.is_initialized():  # a caller (a test, a notebook) owns the session
        yield "the running Ray session"
        return
    joined = check_joined(address)
    quiet = {"logging_level": logging.ERROR, "log_to_driver": False}
    try:
        if joined:
            ray.init(address=joined, **quiet)
        else:
            ray.init(num_cpus=num_cpus, include_dashboard=False, **quiet)
    except (ConnectionError, RuntimeError, TimeoutError, ValueError) as exc:
        where = joined or "this machine"
        raise ClusterUnavailableError(f"cannot start or join Ray at {where}: {str(exc).strip().splitlines()[0]}") from None
    try:
        yield f"the Ray cluster at {joined}" if joined else "Ray embedded on this machine"
    finally:
        ray.shutdown()


def _describe(nodes: list[dict[str, Any]]) -> str:
    kinds = Counter(
        ", ".join(f"{int(n['Resources'].get('GPU', 0))} x {t}" for t in node_accelerator_types(n["Resources"]))
        or f"CPUs only ({int(n['Resources'].get('CPU', 0))})"
        for n in nodes
    )
    return "; ".join(f"{kind} on {count} node{'s' if count > 1 else ''}" for kind, count in sorted(kinds.items()))


def check_capacity(*, gpu: "GPUSpec", gpus: int, where: str) -> None:
    """At once: some alive node can run a verification of ``gpus`` x ``gpu``, else
    ``NoMatchingNodeError`` listing what the cluster has."""
    ray = import_ray()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if any(node_can_run(n["Resources"], gpu=gpu, gpus=gpus) for n in nodes):
        return
    accelerator = ray_accelerator(gpu)
    wanted = (f"{gpus} x {accelerator.accelerator_type} GPU" if accelerator
              else f"{gpus} CPUs (one per rank)" if gpus > 1 else "a CPU")
    hint = (
        f"; a node advertises it with: ray start --address HEAD:6379 --num-gpus {gpus} "
        f"--resources '{{\"{accelerator.resource}\": 1}}' (NVIDIA nodes do it by themselves)"
        if accelerator else ""
    )
    raise NoMatchingNodeError(
        f"no node of {where} has {wanted} for --gpu {gpu.name}: it has {_describe(nodes) or 'no alive node'}{hint}"
    )


__all__ = ["CONNECT_TIMEOUT_S", "ENV_VAR", "OPTION", "check_capacity", "check_joined", "check_reachable", "import_ray", "ray_session"]
