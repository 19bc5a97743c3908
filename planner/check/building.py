"""The one place ``planner check`` makes a ``TrainConfig`` and reads its sharding back in the
DeepSpeed spelling the files it reads use (``Sharding.payload``: the ZeRO stage and the offload)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:  # pragma: no cover
    from planner.config import TrainConfig
    from planner.gpus import GPUSpec
    from planner.modelspec import ModelSpec


def train_config(spec: "ModelSpec", gpu: "GPUSpec", *, seq_len: int | None, options: Mapping[str, Any]) -> "TrainConfig":
    """The one place ``planner check`` makes a TrainConfig (through estimate's ``build_config``:
    the same checks and defaults as ``planner estimate``)."""
    from planner.estimation import build_config

    return build_config(spec, gpu, seq_len=seq_len, **options)


def sharding(config: "TrainConfig") -> tuple[int, str]:
    """(ZeRO stage, offload) of a configuration: the one place ``planner check`` reads them. A
    scheme no ZeRO stage names has no spelling in the files ``check`` reads: an invariant while the
    search offers ZeRO and DDP only."""
    payload = config.sharding.payload()
    assert "zero" in payload, f"{config.sharding} has no DeepSpeed spelling"
    return payload["zero"], payload["offload"]


def spelled_schemes(trainer: str | None = None) -> tuple[str, ...]:
    """The sharding schemes the files ``check`` reads can say (a ZeRO stage and an offload): its
    search tries these only (FSDP2 has no spelling there yet: ``check`` reads no ``fsdp_config``;
    torchtune's single-device recipes have none)."""
    from planner.sharding import Scheme, Sharding

    if trainer == "torchtune":
        return ("none",)
    return tuple(str(s) for s in Scheme if "zero" in Sharding(s).payload())


def spellable(trainer: str | None, config: "TrainConfig") -> bool:
    """Whether the trainer's file can say ``config`` (axolotl has no fp32 master weights, ...)."""
    if trainer is None:
        return True
    from planner.check.trainers import trainer as module
    from planner.errors import UnsupportedError

    try:
        module(trainer).write(config)
    except UnsupportedError:
        return False
    return True


def options_of(config: "TrainConfig") -> dict[str, Any]:
    """A configuration as ``build_config`` options again (its seq_len apart)."""
    from planner.estimation import CONFIG_OPTIONS

    zero, offload = sharding(config)
    out = {name: getattr(config, name) for name in CONFIG_OPTIONS if name not in ("zero", "offload")}
    out.update(zero=zero, offload=offload)
    if out.get("lora_targets") is not None:
        out["lora_targets"] = ",".join(out["lora_targets"])
    return out


__all__ = ["options_of", "sharding", "spellable", "spelled_schemes", "train_config"]
