"""``planner check FILE...``: an existing training config, planned as it stands, with the closest
change that makes it fit (or faster) as a diff of its own keys. Parse, call ``planner.check``,
print."""

from __future__ import annotations

from typing import List, Optional

import typer

from planner.cli.plan import _GPU, _GPU_MEM, _JSON

#: exit code when the file's configuration does not fit (as ``planner estimate``)
DOES_NOT_FIT = 3


def check(
    files: List[str] = typer.Argument(..., metavar="FILE...", help="The training config: TrainingArguments/TRL SFT JSON or YAML, an accelerate "
                                      "config YAML, an axolotl, LLaMA-Factory or torchtune YAML; its DeepSpeed JSON and an "
                                      "adapter_config.json beside it are read too."),
    gpu: str = _GPU,
    model: Optional[str] = typer.Option(None, "--model", "-m", help="The model (default: the file's model_name_or_path)."),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="GPUs (default: the accelerate config's num_processes, else 1)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens per sequence (default: the file's max_length, else "
                                          "min(2048, the model's maximum)."),
    gpu_mem: Optional[str] = _GPU_MEM,
    cpu_mem: Optional[str] = typer.Option(None, "--cpu-mem", help="Host RAM of the node for offload, e.g. 192GiB."),
    trainer: Optional[str] = typer.Option(None, "--trainer", help="hf|trl|axolotl|llama-factory|torchtune: read the file "
                                          "with this trainer's schema (default: the trainer whose keys it has; TRL's when "
                                          "it has a key only TRL has)."),
    as_json: bool = _JSON,
    db: Optional[str] = typer.Option(None, "--db", help="Database URL to read the device's calibration from."),
) -> None:
    """Check an existing training config: fits or not, the peak and where it is, the OOM risk, and the
    closest change that makes it fit (or faster) as a diff of the file's own keys (exit 3 when it does not fit)."""
    from planner.calibration.lookup import active_calibration
    from planner.check import check as check_files
    from planner.cli._common import catalog_gpu, console, console_to_stderr, print_json
    from planner.errors import InvalidConfigError
    from planner.units import parse_bytes

    from planner.check.trainers import MODULES

    if trainer is not None and trainer not in ("hf", "trl", *MODULES):
        raise InvalidConfigError(f"--trainer must be one of hf, trl, {', '.join(MODULES)}, got {trainer!r}")
    gpu = catalog_gpu(gpu)
    calibration, note = active_calibration(gpu, db=db)
    if note:
        console_to_stderr().print(note)
    result = check_files(files, gpu=gpu, model=model, gpus=gpus, seq_len=seq_len, trainer=trainer,
                         gpu_mem_bytes=parse_bytes(gpu_mem, option="--gpu-mem") if gpu_mem else None,
                         cpu_mem_bytes=parse_bytes(cpu_mem, option="--cpu-mem") if cpu_mem else None,
                         calibration=calibration)
    if as_json:
        print_json(result.to_dict())
    else:
        print_check(console(), result)
    if not result.fits:
        raise typer.Exit(DOES_NOT_FIT)


def print_check(out, result) -> None:
    from planner.cli.suggest_view import _risk
    from planner.units import format_bytes

    e = result.estimate
    out.print(f"read: {', '.join(result.files)} ({result.schema or 'accelerate config'})")
    out.print(f"{e['model']['id']} on {e['device']['name']}: {result.config.label()}, seq {result.config.seq_len}")
    verdict = "fits" if result.fits else "does NOT fit"
    out.print(f"{verdict}: peak {format_bytes(result.peak_bytes)} (process total) at {result.peak_phase} of "
              f"{format_bytes(e['device']['usable_bytes'])} usable; OOM risk {_risk(result.oom_probability)}"
              f"{', near the edge' if e['near_edge'] and result.fits else ''}; {e['throughput']['tokens_per_s']:,.0f} tokens/s")
    change = result.change
    if change is not None:
        c = change.estimate
        out.print(f"closest change that makes it {change.aim(fits=result.fits)}: {change.config.label()} "
                  f"(peak {format_bytes(c['memory']['process_total_bytes'])}, OOM risk {_risk(c['oom_probability'])}, "
                  f"{c['throughput']['tokens_per_s']:,.0f} tokens/s)")
        for key in change.keys:
            out.print(f"  {key.line()}")
    elif result.fits:
        out.print("no faster configuration at this batch that is not near the edge")
    for line in result.advice:
        out.print(line)
    for line in result.notes:
        out.print(f"  note: {line}")


def register(app: typer.Typer) -> None:
    app.command("check")(check)
