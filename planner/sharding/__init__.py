"""The sharding schemes the planner knows: one descriptor module each, read by name from here.

A scheme is how the model states are spread over the data-parallel ranks: none (one process),
DDP (whole replicas), DeepSpeed ZeRO-1/2/3. Each module of this package that defines ``SPECS`` (a
tuple of ``ShardingSpec``) adds its schemes: the registry below is built once, at import, from
the package's modules, and every other part of the planner (``TrainConfig``'s ``Sharding``, the
memory and throughput models, the search's axis, emit, the CLI and the API, the worker) reads
it. Adding a scheme (FSDP2 next, issue 24) is one module here and its tests. Like
``planner.optim``, the descriptors import nothing of the planner above the foundation.

A ``Sharding`` value is a scheme, its offload (``Offload``, the part of the state the host
holds) and, for a user's own library config, the buffer keys that file sets (``buffers``). The
planner's own values (no buffers: a few schemes times a few offloads) are interned, one instance
per pair, compared by identity; a user's buffer sets are as many as the files sent to
``planner check`` or ``POST /v1/check``, so those values compare by value and only the latest
``_BUFFERED_KEPT`` are kept for reuse (a long-running service's table stays bounded).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from types import MappingProxyType
from typing import Any, ClassVar, Mapping

from planner.errors import InvalidConfigError, choice
from planner.registry import discover
from planner.sharding.spec import BreakdownKey, Offload, ShardingSpec

#: Every descriptor of the package's modules, in registry order (names unique).
SPECS: tuple[ShardingSpec, ...] = discover(__name__, __path__, key=lambda s: (s.order, s.name),
                                           what="a sharding scheme")

#: The type of ``Sharding.scheme``: one str-valued member per registered name, in registry order.
Scheme = enum.StrEnum("Scheme", [(s.name.upper(), s.name) for s in SPECS], module=__name__)
Scheme.__doc__ = "A sharding scheme of the registry (``planner.sharding``), by its name."

def names() -> str:
    """``a|b|c``: the registered schemes' names, as the help lists them."""
    return "|".join(spec.name for spec in SPECS)


#: ``Offload.NONE`` bound once: reading a member through its class goes through
#: ``EnumType.__getattr__``'s slow attribute path on CPython 3.11 (``planner.config``'s note), and
#: the search asks ``Sharding.offloaded`` thousands of times a search.
_NO_OFFLOAD = Offload.NONE
#: (the ranking reads ``moving_parts`` of every plan it ties: thousands a search)
_OFFLOAD_PARAMS = Offload.OPTIMIZER_PARAMS

#: The descriptor of each scheme, by ``Scheme`` member (a plain name finds it too).
SCHEMES: Mapping[Scheme, ShardingSpec] = MappingProxyType({Scheme(s.name): s for s in SPECS})
def _keys() -> Mapping[str, BreakdownKey]:
    keys: dict[str, BreakdownKey] = {}
    for spec in SPECS:
        for k in spec.keys:
            if keys.setdefault(k.key, k) != k:
                raise AssertionError(f"breakdown key {k.key!r} declared twice, differently ({spec.name})")
    return MappingProxyType(keys)


#: Every breakdown key a scheme adds, by key (``ShardingSpec.keys``).
BREAKDOWN_KEYS: Mapping[str, BreakdownKey] = _keys()
#: The scheme each ``--zero`` stage names: the first of the registry with that stage (stage 0 is
#: none; ``for_gpus`` makes it DDP on more than one GPU).
_BY_STAGE: dict[int, Scheme] = {}
for _spec in SPECS:
    if _spec.zero_stage is not None:
        _BY_STAGE.setdefault(_spec.zero_stage, Scheme(_spec.name))


def _buffers(buffers: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...] | None:
    """``Sharding.buffers`` as a hashable value: the keys in order, each an int or "auto"."""
    if buffers is None:
        return None
    out = []
    for key, value in sorted(dict(buffers).items()):
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise InvalidConfigError(f"{key} must be a number of elements >= 0 or \"auto\", got {value!r}")
        out.append((str(key), value if value == "auto" else int(value)))
    return tuple(out)


class Sharding:
    """A sharding scheme with its offload: ``TrainConfig.sharding``. One instance per pair
    (``Sharding("zero2", "optimizer") is Sharding("zero2", "optimizer")``), immutable; made from
    the names or the members, refused in one line when a name is unknown. Whether the scheme takes
    the offload (and the rest of the configuration) is checked where the ``TrainConfig`` is made
    (``ShardingSpec.check``).

    ``buffers``: the buffer keys a user's own library config sets (DeepSpeed: ``zero_optimization``'s
    bucket keys, an element count or "auto" each), for a run that reads that file instead of the
    one the planner writes; the library's own defaults hold for the keys it leaves out
    (``planner.sharding.zero.zero_buckets``). None (the search's, emit's): the planner's file
    (``ShardingSpec.emitted_files``)."""

    __slots__ = ("scheme", "offload", "spec", "buffers")
    scheme: Scheme
    offload: Offload
    spec: ShardingSpec
    buffers: tuple[tuple[str, Any], ...] | None
    _interned: dict[tuple[Any, Any, Any], "Sharding"] = {}

    def __new__(cls, scheme: Scheme | str = "none", offload: Offload | str = Offload.NONE,
                buffers: Mapping[str, Any] | tuple[tuple[str, Any], ...] | None = None) -> "Sharding":
        if buffers is None:
            found = cls._interned.get((scheme, offload, None))
            if found is not None:
                return found
        b = _buffers(buffers)
        s = choice(Scheme, scheme, "sharding")
        o = choice(Offload, offload, "offload")
        if b is not None:
            return _Buffered.made(s, o, b)
        found = cls._interned.get((s, o, None))
        if found is None:
            found = Sharding._make(s, o, None)
        # the spelling it was asked by too (the members and the names): a handful of keys per pair
        cls._interned[(scheme, offload, None)] = cls._interned[(s, o, None)] = found
        return found

    @classmethod
    def _make(cls, s: Scheme, o: Offload, b: tuple[tuple[str, Any], ...] | None) -> Sharding:
        made = object.__new__(cls)
        for name, value in (("scheme", s), ("offload", o), ("spec", SCHEMES[s]), ("buffers", b)):
            object.__setattr__(made, name, value)
        return made

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Sharding is immutable: make Sharding({self.scheme!r}, ...) instead of setting {name}")

    def __reduce__(self):
        return Sharding, (str(self.scheme), str(self.offload), None if self.buffers is None else dict(self.buffers))

    def __repr__(self) -> str:
        tail = "" if self.buffers is None else f", {dict(self.buffers)!r}"
        return f"Sharding({str(self.scheme)!r}, {str(self.offload)!r}{tail})"

    def with_offload(self, offload: Offload | str) -> "Sharding":
        """The same scheme and buffers with another offload."""
        return Sharding(self.scheme, offload, self.buffers)

    @property
    def offloaded(self) -> bool:
        """Some of the state lives on the host (the optimizer steps there)."""
        return self.offload is not _NO_OFFLOAD

    @property
    def zero(self) -> int | None:
        """The ``--zero`` stage that names it (0: no DeepSpeed); None for a scheme ``--zero``
        does not name."""
        return self.spec.zero_stage

    @property
    def plain(self) -> bool:
        """Whole replicas on the device: no sharding library, nothing offloaded."""
        return self.spec.replicas and self.offload is _NO_OFFLOAD

    @property
    def moving_parts(self) -> int:
        """What the plan adds to plain training, for the ranking's ties: a sharding library, an
        offload, the parameters offloaded too."""
        return ((self.spec.library is not None) + (self.offload is not _NO_OFFLOAD)
                + (self.offload is _OFFLOAD_PARAMS))

    def label(self) -> str:
        """Its part of ``TrainConfig.label()``: ``zero3+offload:optimizer`` ("" for none/DDP)."""
        return self.spec.label(self.offload)

    def short(self) -> str:
        """Its cell in ``suggest``'s table: ``zero3+optimizer`` ("" for none/DDP)."""
        return self.spec.short(self.offload)

    def words(self, *, offload_none: bool = True) -> str:
        """How the CLI prints it, as the options that make it: ``zero 2, offload optimizer``
        (``offload_none``: say ``offload none`` too)."""
        stage = self.spec.zero_stage
        head = f"zero {stage}" if stage is not None else f"sharding {self.scheme}"
        if self.offload is Offload.NONE and not offload_none:
            return head
        return f"{head}, offload {self.offload}"

    def memory_key(self, gpus: int) -> "Sharding":
        """The sharding whose memory terms this one's equal on ``gpus`` ranks (a memo key)."""
        twin = self.spec.memory_twin(gpus)
        return self if twin == self.scheme else Sharding(twin, self.offload, self.buffers)

    def payload(self) -> dict[str, Any]:
        """Its entries of a ``TrainConfig.to_dict`` payload: the ``--zero`` stage and the offload
        (the shape payloads of versions 1 and 2 have), or the scheme's name for a scheme ``--zero``
        does not name (version 3); ``buffers`` when a user's file set them (no entry otherwise, so
        the planner's own plans keep their payloads)."""
        out: dict[str, Any] = ({"zero": self.spec.zero_stage, "offload": str(self.offload)}
                               if self.spec.zero_stage is not None else {"sharding": str(self.scheme), "offload": str(self.offload)})
        if self.buffers is not None:
            out["buffers"] = dict(self.buffers)
        return out


#: How many distinct user buffer sets ``_Buffered`` keeps for reuse: a request's values share one
#: instance (its memo keys hit by identity first); past this many, the oldest is dropped, and a value
#: made again afterwards is a new instance, equal to the old by value.
_BUFFERED_KEPT = 64


class _Buffered(Sharding):
    """A ``Sharding`` with a user's buffer keys: equal to another with the same scheme, offload and
    buffers, whichever instance it is (the planner's own values stay identity-compared: this class
    alone defines ``__eq__``, so their hashing and comparing stay the interpreter's own)."""

    __slots__ = ()
    _kept: ClassVar[OrderedDict[tuple[Any, Any, Any], _Buffered]] = OrderedDict()

    @classmethod
    def made(cls, s: Scheme, o: Offload, b: tuple[tuple[str, Any], ...]) -> _Buffered:
        key = (s, o, b)
        found = cls._kept.get(key)
        if found is None:
            found = cls._kept[key] = cls._make(s, o, b)
            if len(cls._kept) > _BUFFERED_KEPT:
                cls._kept.popitem(last=False)
        return found

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, Sharding) and (self.scheme, self.offload, self.buffers)
                                 == (other.scheme, other.offload, other.buffers))

    def __hash__(self) -> int:
        return hash((self.scheme, self.offload, self.buffers))


def from_zero(zero: Any, offload: Offload | str = Offload.NONE) -> Sharding:
    """The sharding ``--zero N --offload X`` names (0: no DeepSpeed; DDP on more than one GPU,
    see ``for_gpus``)."""
    if zero not in _BY_STAGE or isinstance(zero, bool):
        raise InvalidConfigError(f"--zero must be 0, 1, 2 or 3, got {zero!r}")
    return Sharding(_BY_STAGE[zero], offload)


#: The replicas scheme on one GPU and on more (none and DDP), by ``gpus > 1``.
_REPLICAS = {False: Scheme("none"), True: Scheme("ddp")}


def for_gpus(sharding: Sharding, gpus: int) -> Sharding:
    """``sharding`` on ``gpus`` ranks: whole replicas are DDP on more than one GPU and plain
    training on one (the one choice ``--zero 0`` names); any other scheme as it is."""
    if not sharding.spec.replicas:
        return sharding
    scheme = _REPLICAS[gpus > 1]
    return sharding if sharding.scheme is scheme else Sharding(scheme, sharding.offload)


def search_axis(*, allow_offload: bool, gpus: int, schemes: tuple[str, ...] | None = None) -> tuple[Sharding, ...]:
    """The shardings ``suggest`` tries on ``gpus`` GPUs, in its order: each scheme searched there
    without offload, then (when the space allows offload) each with each of its offloads
    (``ShardingSpec.searched_on``). ``schemes``: only these; where the search takes none of them on
    its own (FSDP1, chosen by name only), they are tried as named, without offload, so that ``planner
    check`` of a file that runs one searches its split and checkpointing."""
    offloads = [o for o in Offload if o is not Offload.NONE] if allow_offload else []
    axis = [Sharding(s.name) for s in SPECS if s.searched_on(gpus, Offload.NONE)]
    axis += [Sharding(s.name, o) for s in SPECS for o in s.offloads if o in offloads and s.searched_on(gpus, o)]
    if schemes is None:
        return tuple(axis)
    return tuple(s for s in axis if s.scheme in schemes) or tuple(Sharding(s.name) for s in SPECS if s.name in schemes)


def decode(data: Mapping[str, Any]) -> Sharding:
    """The sharding of a stored ``TrainConfig`` payload of any version: ``zero`` and ``offload``
    (versions 1 and 2, and the API's body), or ``sharding`` and ``offload`` (version 3)."""
    offload = data.get("offload", Offload.NONE)
    if data.get("sharding") is not None:
        return Sharding(data["sharding"], offload, data.get("buffers"))
    found = from_zero(data.get("zero", 0), offload)
    return found if data.get("buffers") is None else Sharding(found.scheme, found.offload, data["buffers"])


NONE = Sharding("none")

__all__ = ["BREAKDOWN_KEYS", "NONE", "SCHEMES", "BreakdownKey", "SPECS", "Offload", "Scheme", "Sharding", "ShardingSpec", "decode", "for_gpus",
           "from_zero", "search_axis"]
