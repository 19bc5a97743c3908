"""The defaults a configuration takes where the user names no value: one home, read by ``planner
estimate`` / ``measure`` (``planner.estimation.build_config``) and stated beside what ``planner
suggest`` searches, so a method means the same recipe in both.

- Precision: full fine-tuning and QLoRA train under 16-bit autocast with fp32 weights where they
  train (the HF Trainer's ``bf16=True`` / ``fp16=True``): bf16-mixed where the GPU has bf16, else
  fp16-mixed. LoRA loads the frozen base in 16 bits (``torch_dtype=torch.bfloat16``; peft keeps the
  adapters in fp32, ``autocast_adapter_dtype=True``): pure bf16, or pure fp16 where the GPU has no
  bf16 — the recipe of the PEFT, TRL and Unsloth examples (PEFT docs "LoRA" quicktour, TRL
  "SFTTrainer" docs' ``model_init_kwargs={"torch_dtype": "bfloat16"}``, Unsloth notebooks'
  ``dtype=None`` -> bf16 on Ampere+, fp16 on T4/V100). A full-precision base under autocast
  (``bf16-mixed``) doubles the frozen weights for no change in what the adapters learn.
- Adapters: r 16 on every linear layer but the head (``planner.config.DEFAULT_LORA_R``,
  ``DEFAULT_LORA_TARGETS``): every linear is what the QLoRA paper found needed to match full
  fine-tuning (Dettmers et al. 2023, §4: "LoRA on all linear transformer block layers") and what
  axolotl (``lora_target_linear: true``), LLaMA-Factory (``lora_target: all``) and Unsloth
  (q, k, v, o, gate, up, down) examples adapt; r 16 is Unsloth's notebooks' rank, between
  LLaMA-Factory's and torchtune's 8 and axolotl's 32. ``suggest`` searches r 8-64 on every
  linear and on the attention projections, this default among them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from planner.config import Method
    from planner.gpus import GPUSpec


def default_precision(method: "Method | str", gpu: "GPUSpec") -> str:
    """The precision a configuration of ``method`` on ``gpu`` takes when none is given (a method
    that is not one is left to ``TrainConfig``, which says so in its one line)."""
    if str(method) == "lora":
        return "bf16" if gpu.bf16 else "fp16"
    return "bf16-mixed" if gpu.bf16 else "fp16-mixed"


__all__ = ["default_precision"]
