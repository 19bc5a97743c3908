"""The emitted ``train.py``: a short script that trains with exactly the emitted settings.

The script is a ``string.Template`` (``$name`` placeholders: Python code has no ``$``); only its
header constants vary between plans, everything else reads the JSON files next to it.
"""

from __future__ import annotations

import inspect
from string import Template

from planner.emit.causal_lm_loss import calls_loss_function, causal_lm_loss_448
from planner.emit.settings import scale_rope

_TEMPLATE = Template('''\
"""Fine-tune $model as planned by OOM Planner: plan $plan_id, #$rank.

    $label

Run it from anywhere, the settings are read from this file's folder:

    accelerate launch --config_file accelerate_config.yaml train.py --dataset DATA
    python train.py --dataset DATA            # one device

DATA is a .txt file, a .json/.jsonl file with one {"text": ...} (or {"input_ids": [...]}) per
line, or a Hugging Face datasets name (needs `pip install datasets`). Text is tokenized with the
model's tokenizer and $data_doc, which is what the memory prediction in PLAN.md assumes. So are
training_args.json, lora_config.json, bnb_config.json and ds_config.json: change a value there and
the prediction no longer holds.
"""

import argparse
import json
import pathlib
${launch_env}
HERE = pathlib.Path(__file__).resolve().parent
MODEL = $model_repr  # a Hugging Face id or a local folder with the weights (--model overrides)
DATASET = $dataset_repr  # --dataset overrides
SEQ_LEN = $seq_len  # tokens per sequence
MODEL_DTYPE = $dtype_repr  # $dtype_why
ATTENTION = $attention_repr  # transformers' attn_implementation
MASKED_LM = $masked_lm  # True for an encoder (BERT-like), trained as masked LM
SEQ2SEQ = $seq2seq  # True for an encoder-decoder (T5-like): the labels are the input, shifted by the model
PACKED = $packed  # True: sequences packed to SEQ_LEN; False: one row per sequence, padded per batch
USE_CACHE = $use_cache  # transformers' use_cache in the training forward
KBIT_UPCAST = $kbit_upcast  # QLoRA: peft's prepare_model_for_kbit_training upcasts the non-4-bit parameters to fp32
LOSS_UPCAST = $loss_upcast  # transformers' causal-LM loss upcasts the logits to fp32; False: the loss below
LOSS_SHIFT = $loss_shift  # the loss as transformers <= 4.45 computed it, on a shifted copy of the logits (below)
LOSS_RETURNS_HEAD = $loss_returns_head  # the loss as transformers 4.46-4.48 computed it: the model's loss_function (below)
EVAL_SEQUENCES = $eval_sequences  # sequences held out of the dataset for evaluation (0: no evaluation)
EVAL_SEQ_LEN = $eval_seq_len  # tokens per eval sequence (the prompt's when generating)
GENERATE_TOKENS = $generate_tokens  # tokens generated from the first eval batch at each evaluation (0: none)
ROPE_SCALING = $rope  # RoPE context extension merged into the model config's rope_parameters (None: none)


def read_settings(name):
    path = HERE / name
    return json.loads(path.read_text()) if path.exists() else None


def load_model(name):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM, BitsAndBytesConfig

    bnb = read_settings("bnb_config.json")
    auto = AutoModelForMaskedLM if MASKED_LM else AutoModelForSeq2SeqLM if SEQ2SEQ else AutoModelForCausalLM
    model = auto.from_pretrained(
        name, dtype=getattr(torch, MODEL_DTYPE), attn_implementation=ATTENTION,
        quantization_config=BitsAndBytesConfig(**bnb) if bnb else None,
        **({"config": scaled_config(name)} if ROPE_SCALING else {}),
    )
    model.config.use_cache = USE_CACHE
    if LOSS_RETURNS_HEAD:
        if not calls_loss_function(model):
            raise SystemExit(f"{type(model).__name__}.forward computes its own loss, not self.loss_function: "
                             "plan this model without --loss-returns-head")
        model.loss_function = causal_lm_loss_448  # the forward calls it on the head's output, which it returns
    return model


def scaled_config(name):
    """The model's config with ROPE_SCALING (scale_rope, below)."""
    from transformers import AutoConfig

    return scale_rope(AutoConfig.from_pretrained(name), ROPE_SCALING)


${scale_rope}


def add_adapters(model, args):
    lora = read_settings("lora_config.json")
    if lora is None:
        return model
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if read_settings("bnb_config.json") and KBIT_UPCAST:
        # upcasts the non-4-bit parameters to fp32 (the plan counts them so; without it they stay
        # in MODEL_DTYPE, as the plan counts them then)
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=args.activation_checkpointing,
            gradient_checkpointing_kwargs=args.activation_checkpointing_kwargs,
        )
    return get_peft_model(model, LoraConfig(**lora))


def read_rows(name):
    path = pathlib.Path(name)
    if path.suffix == ".txt":
        return [{"text": path.read_text(encoding="utf-8")}]
    if path.suffix in (".json", ".jsonl"):
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    import datasets

    return datasets.load_dataset(name, split="train")


def packed_sequences(rows, model_name):
    """Token ids of every row, concatenated and cut into SEQ_LEN blocks (the rest is dropped)."""
    tokenizer = None
    ids = []
    for row in rows:
        if "input_ids" in row:
            ids += list(row["input_ids"])
            continue
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_name)
        end = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
        ids += tokenizer(row["text"])["input_ids"] + ([end] if end is not None else [])
    blocks = [ids[i : i + SEQ_LEN] for i in range(0, len(ids) - SEQ_LEN + 1, SEQ_LEN)]
    if not blocks:
        raise SystemExit(f"the dataset holds {len(ids)} tokens, fewer than one sequence of {SEQ_LEN}")
    return blocks, tokenizer


def padded_rows(rows, model_name):
    """One sequence per row, truncated to SEQ_LEN tokens; the collator pads each batch to its longest."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    blocks = [list(row["input_ids"])[:SEQ_LEN] if "input_ids" in row
              else tokenizer(row["text"], truncation=True, max_length=SEQ_LEN)["input_ids"] for row in rows]
    return [b for b in blocks if b], tokenizer


def split_off_evaluation(data):
    """The last EVAL_SEQUENCES sequences, cut to EVAL_SEQ_LEN tokens, become the eval dataset."""
    if not EVAL_SEQUENCES:
        return data, None
    if len(data) <= EVAL_SEQUENCES:
        raise SystemExit(f"the dataset holds {len(data)} sequences: {EVAL_SEQUENCES} are held out for evaluation "
                         "and none would be left to train on")
    held_out = [{key: value[:EVAL_SEQ_LEN] for key, value in row.items()} for row in data[-EVAL_SEQUENCES:]]
    return data[:-EVAL_SEQUENCES], held_out


def generating_callback(trainer, held_out):
    """After each evaluation: greedy generation of GENERATE_TOKENS tokens from the first eval batch,
    with the KV cache on (what the plan counts as its generation moment)."""
    import torch
    from transformers import TrainerCallback

    class Generate(TrainerCallback):
        def on_evaluate(self, args, state, control, **kwargs):
            batch = trainer.data_collator(held_out[: args.per_device_eval_batch_size])
            prompts = batch["input_ids"].to(trainer.model.device)
            mask = batch.get("attention_mask")
            with torch.no_grad():
                out = trainer.model.generate(
                    input_ids=prompts, attention_mask=None if mask is None else mask.to(prompts.device),
                    max_new_tokens=GENERATE_TOKENS, min_new_tokens=GENERATE_TOKENS, do_sample=False, use_cache=True,
                )
            print(f"generated {out.shape[1] - prompts.shape[1]} tokens for {len(prompts)} eval prompts")

    return Generate()


def loss_in_logits_dtype(outputs, labels, num_items_in_batch=None):
    """transformers' ForCausalLMLoss without its `logits.float()` (transformers/loss/loss_utils.py):
    the cross-entropy on the logits in the head's 16-bit dtype, autocast off so that it does not
    upcast them either (the plan counts 16-bit log-probabilities and loss gradients)."""
    import torch

    logits = outputs.logits
    labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous().to(logits.device)
    with torch.autocast(logits.device.type, enabled=False):
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100,
                                                 reduction="mean" if num_items_in_batch is None else "sum")
    if num_items_in_batch is None:
        return loss
    return loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch)


${causal_lm_loss_448}


${calls_loss_function}


def shifted_copy_loss(outputs, labels, num_items_in_batch=None):
    """The causal-LM loss as transformers <= 4.45 computed it in the model's forward (4.45.2
    models/llama/modeling_llama.py l.1214-1229): the logits upcast (LOSS_UPCAST) and returned in
    their place, a contiguous copy of all but each sequence's last position, the cross-entropy on
    it (the plan counts that copy and the zero gradient of the whole logits its backward makes)."""
    import contextlib

    import torch

    logits = outputs.logits.float() if LOSS_UPCAST else outputs.logits
    outputs["logits"] = logits  # the model returned the upcast logits: the head's own output is dropped
    shift_logits = logits[..., :-1, :].contiguous()
    shift_labels = labels[..., 1:].contiguous().to(logits.device)
    with contextlib.nullcontext() if LOSS_UPCAST else torch.autocast(logits.device.type, enabled=False):
        loss = torch.nn.functional.cross_entropy(shift_logits.view(-1, shift_logits.shape[-1]), shift_labels.view(-1),
                                                 ignore_index=-100,
                                                 reduction="mean" if num_items_in_batch is None else "sum")
    if num_items_in_batch is None:
        return loss
    return loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL, help=f"model id or folder (default {MODEL})")
    parser.add_argument(
        "--dataset", default=DATASET, required=DATASET is None, help="a .txt or .jsonl file or a datasets name"
    )
    parser.add_argument("--output-dir", default=None, help="where the model is saved (default: training_args.json)")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    parser.add_argument("--eval-steps", type=int, default=None, help="evaluate every this many optimizer steps "
                        "(default: training_args.json; only where the plan evaluates)")
    return parser.parse_args(argv)


def build_trainer(argv=None):
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments, default_data_collator

    cli = parse_args(argv)
    settings = read_settings("training_args.json")
    if "deepspeed" in settings:
        settings["deepspeed"] = str(HERE / settings["deepspeed"])
    settings["output_dir"] = cli.output_dir or settings["output_dir"]
    if cli.max_steps:
        settings["max_steps"] = cli.max_steps
    if cli.eval_steps and EVAL_SEQUENCES:
        settings["eval_steps"] = cli.eval_steps
    # before the model is loaded: with ZeRO-3 the weights load already partitioned
    args = TrainingArguments(**settings)
    model = add_adapters(load_model(cli.model), args)
    rows = read_rows(cli.dataset)
    blocks, tokenizer = packed_sequences(rows, cli.model) if PACKED else padded_rows(rows, cli.model)
    if not PACKED and not MASKED_LM:
        # pads input_ids and the attention mask; labels are input_ids with padding set to -100
        collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
        data = [{"input_ids": b} for b in blocks]
    elif MASKED_LM:
        from transformers import AutoTokenizer

        collator = DataCollatorForLanguageModeling(tokenizer or AutoTokenizer.from_pretrained(cli.model), mlm=True)
        data = [{"input_ids": b} for b in blocks]
    else:
        collator = default_data_collator  # the model shifts the labels itself
        data = [{"input_ids": b, "labels": b} for b in blocks]
    data, held_out = split_off_evaluation(data)
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=held_out, data_collator=collator,
                      compute_loss_func=None if LOSS_RETURNS_HEAD else shifted_copy_loss if LOSS_SHIFT
                      else None if LOSS_UPCAST else loss_in_logits_dtype)
    if GENERATE_TOKENS:
        trainer.add_callback(generating_callback(trainer, held_out))
    if "8bit" in args.optim:
        # the Trainer keeps embedding states in 32 bits with 8-bit optimizers (transformers
        # trainer.py create_optimizer); the plan counts them in 8 bits like every other tensor
        import bitsandbytes

        trainer.create_optimizer()
        bitsandbytes.optim.GlobalOptimManager.get_instance().module_weight_config_triple.clear()
    return trainer


def main(argv=None):
    trainer = build_trainer(argv)
    trainer.train()
    trainer.save_model()


if __name__ == "__main__":
    main()
''')


def render_train_script(
    *, model: str, plan_id: str, rank: int, label: str, seq_len: int, dtype: str, dtype_why: str,
    attention: str, masked_lm: bool, dataset: str | None, seq2seq: bool = False, packed: bool = True,
    use_cache: bool = False, launch_env: dict[str, str] | None = None, eval_sequences: int = 0,
    eval_seq_len: int = 0, generate_tokens: int = 0, kbit_upcast: bool = True, loss_upcast: bool = True,
    loss_shift: bool = False, loss_returns_head: bool = False, rope: dict | None = None,
) -> str:
    """The text of ``train.py`` for one plan; ``launch_env``: variables it sets as ``accelerate launch``
    would (``planner.emit.settings.launch_env``), before TrainingArguments reads them."""
    env = "".join(f"os.environ.setdefault({k!r}, {v!r})\n" for k, v in (launch_env or {}).items())
    if env:
        env = ("import os\n\n# as accelerate_config.yaml sets them under `accelerate launch`, so that `python train.py` "
               "trains alike\n" + env)
    data_doc = ("packed into sequences of exactly SEQ_LEN tokens: nothing is padded, no attention mask is built"
                if packed else "each row is one sequence of at most SEQ_LEN tokens, padded to the longest in its "
                "batch with an attention mask (the plan counts batches whose longest is SEQ_LEN)")
    return _TEMPLATE.substitute(
        scale_rope=inspect.getsource(scale_rope).rstrip("\n"),  # the worker's own function, as its text
        # the worker's own loss for loss_returns_head and its check, as their text
        causal_lm_loss_448=inspect.getsource(causal_lm_loss_448).rstrip("\n"),
        calls_loss_function=inspect.getsource(calls_loss_function).rstrip("\n"),
        model=model, plan_id=plan_id, rank=rank, label=label, model_repr=repr(model), dataset_repr=repr(dataset),
        seq_len=seq_len, dtype_repr=repr(dtype), dtype_why=dtype_why, attention_repr=repr(attention),
        masked_lm=masked_lm, seq2seq=seq2seq, packed=packed, use_cache=use_cache, data_doc=data_doc, launch_env=env,
        eval_sequences=eval_sequences, eval_seq_len=eval_seq_len or seq_len, generate_tokens=generate_tokens,
        kbit_upcast=kbit_upcast, loss_upcast=loss_upcast, loss_shift=loss_shift,
        loss_returns_head=loss_returns_head, rope=repr(rope),
    )


__all__ = ["render_train_script"]
