"""The one place ``planner check`` makes a ``TrainConfig`` and reads its sharding back in the
spelling the files it reads use (``Sharding.payload``: DeepSpeed's ZeRO stage, or the FSDP scheme
of an ``fsdp_config``, and the offload)."""

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


def sharding(config: "TrainConfig") -> tuple[int | str, str]:
    """(ZeRO stage, offload) of a configuration, or (the scheme's name, offload) for a scheme no ZeRO
    stage names (FSDP1, FSDP2: the files ``check`` reads spell them in ``fsdp_config``): the one
    place ``planner check`` reads them."""
    payload = config.sharding.payload()
    return payload["zero"] if "zero" in payload else payload["sharding"], payload["offload"]


def spelled_schemes(trainer: str | None = None, config: "TrainConfig | None" = None) -> tuple[str, ...]:
    """The sharding schemes the files ``check`` reads can say, which its search tries: a ZeRO stage
    and an offload (DeepSpeed's JSON); a file that runs FSDP keeps its scheme (the change is written
    in its ``fsdp_config``, whose other strategies the memory model has not); torchtune's
    single-device recipes have none."""
    from planner.sharding import Scheme, Sharding

    if trainer == "torchtune":
        return ("none",)
    if config is not None and isinstance(spelled := sharding(config)[0], str):
        return (spelled,)
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

    spelled, offload = sharding(config)
    out = {name: getattr(config, name) for name in CONFIG_OPTIONS if name not in ("zero", "offload")}
    out.update(zero=spelled if isinstance(spelled, int) else None, offload=offload)
    if out.get("lora_targets") is not None:
        out["lora_targets"] = ",".join(out["lora_targets"])
    return out


__all__ = ["options_of", "sharding", "spellable", "spelled_schemes", "train_config"]
