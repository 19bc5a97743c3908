"""``POST /v1/check``'s body: the training config's files sent as text, the device and the model.

Over HTTP the files are sent, never named: a file one of them refers to (TrainingArguments'
``deepspeed``, an accelerate config's ``deepspeed_config_file``) is looked up among those sent by
its base name, and the server reads nothing from its own disk (``planner.check.read_texts``).
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from planner.service.schemas import ModelChoice, Size
from planner.service.settings import MAX_CONFIG_BYTES

#: files one check may send: the arguments, the accelerate config, the DeepSpeed JSON, the adapter
#: and bitsandbytes configs
MAX_FILES = 5


class ConfigText(BaseModel):
    """One file of the training setup, as text."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200, pattern=r"^[^/\\]+\.(json|ya?ml)$", examples=["sft.yaml"],
                      description="The file's name (no folder): its suffix says JSON or YAML, and another file "
                                  "refers to it by this name.")
    content: str = Field(max_length=MAX_CONFIG_BYTES, description=f"The file's text (at most {MAX_CONFIG_BYTES // 1024} KiB).")


class CheckBody(ModelChoice):
    """``POST /v1/check``: ``planner check`` of files sent inline."""

    model: Optional[str] = Field(default=None, min_length=1, max_length=200, examples=["meta-llama/Llama-2-7b-hf"],
                                 description="A catalog id, or the name to give the inline `config` (default: the "
                                             "arguments' model_name_or_path, which must then be a catalog id).")
    files: list[ConfigText] = Field(min_length=1, max_length=MAX_FILES, description="The training config's files.")
    gpus: Optional[StrictInt] = Field(default=None, description="GPUs (default: the accelerate config's num_processes, else 1).")
    cpu_mem: Size = Field(default=None, description="Host RAM of the node for offload: bytes or a size like \"192GiB\".")
    trainer: Optional[str] = Field(default=None, pattern="^(hf|trl|axolotl|llama-factory|torchtune)$",
                                   description="hf|trl|axolotl|llama-factory|torchtune: read the file with this "
                                               "trainer's schema (default: the one whose keys the file has).")

    def texts(self) -> dict[str, Any]:
        """The files by name; a name sent twice is refused (the last would silently win)."""
        from planner.errors import InvalidConfigError

        names = [f.name for f in self.files]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise InvalidConfigError(f"files: {', '.join(twice)} sent more than once: send each file once, under "
                                     "the name the others refer to it by")
        return {f.name: f.content for f in self.files}


__all__ = ["CheckBody", "ConfigText", "MAX_FILES"]
