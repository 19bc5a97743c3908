"""The emitted accelerate config as ``accelerate launch`` reads it (the FSDP tests' shared step)."""

from __future__ import annotations

from pathlib import Path

from planner.config import TrainConfig


def launch_env(config: TrainConfig, tmp_path: Path) -> dict[str, str]:
    """The environment ``accelerate launch --config_file`` gives its processes for the file
    ``planner emit`` writes for ``config`` (accelerate's own loader, validation and launch env)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    from planner.emit import settings

    path = tmp_path / "accelerate_config.yaml"
    path.write_text(settings.to_yaml(settings.accelerate_config(config, on_cpu=False)))
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, _, _ = _validate_launch_command(args)
    assert args.use_fsdp and args.num_processes == config.gpus
    return prepare_multi_gpu_env(args)
