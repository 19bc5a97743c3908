"""Property-based fuzzing (issue 12): no input makes the CLI or config.json parsing print a traceback.

``test_cli_never_prints_a_traceback`` runs ``planner.cli.main(argv)`` in-process on generated
argument lists over every command and option (``test_the_grammar_covers_every_option`` keeps the
grammar in step with the commands): catalog ids, config.json files (generated ones included),
odd names, numbers past every type's range, sizes, dates, markup. Every outcome must be exit
0/1/2/3 (or another ``PlannerError.exit_code``) with at most one ``error:`` line and no traceback. ``measure`` only ever gets a
``--gpus`` other than 1, which it refuses before anything runs, and the worker entry points are
replaced by a trap, so no training run starts. ``--db`` only names a file in the test's home.

``test_config_json_parsing_never_raises_anything_else`` sends generated JSON documents and
config.json dicts through ``resolve_model(path)``: a spec or one ``PlannerError`` line.

``bench/fuzz.py`` runs the same grammar 2,000 times and prints the counts by exit code.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.cli import exit_codes  # noqa: F401

#: examples per property in CI (the issue asks for at least 300); bench/fuzz.py runs 2,000
CI_EXAMPLES = 300

TINY = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 128,
}

# ---- the grammar ------------------------------------------------------------------------------------

_ODD_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30)
_MARKUP = st.sampled_from(["[/]", "[bold]x", "a[/bold]", "llama[v2]", ":fire:", "[link=x]y[/link]", "\\[", "%s", "{}", "\x1b[31m"])
_HUGE_INTS = st.sampled_from(["9223372036854775807", "9223372036854775808", "-9223372036854775809", "1" + "0" * 400, "1" * 5000])


def _mostly(good: st.SearchStrategy, *bad: st.SearchStrategy) -> st.SearchStrategy:
    """``good`` seven times in eight (so that most commands get as far as the library), else ``bad``."""
    return st.integers(0, 7).flatmap(lambda n: good if n else st.one_of(*bad))


def _ints(good: tuple[int, int]) -> st.SearchStrategy[str]:
    return _mostly(
        st.integers(*good).map(str),
        st.integers(-(2**70), 2**70).map(str), _HUGE_INTS,
        st.sampled_from(["", " ", "1.5", "1e3", "0x10", "two", "-0", "+3", "nan", " 4 "]), _ODD_TEXT,
    )


def _choice(*good: str) -> st.SearchStrategy[str]:
    return _mostly(st.sampled_from(good), st.sampled_from([g.upper() for g in good]), _ODD_TEXT, _MARKUP)


_SIZES = st.one_of(
    st.sampled_from(["20GiB", "24GB", "23028MiB", "4096B", "1TiB", "0GiB", "-1GiB", "20", "1e400GiB", "inf GiB",
                     "1024PiB", "1.5 GiB", "99999999999999999999TiB", "0.0000001B", "nan", "GiB"]),
    st.integers(-(2**70), 2**70).map(lambda n: f"{n}MiB"), _ODD_TEXT,
)
_FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr), st.sampled_from(["nan", "inf", "-inf", "1e400", "0", "-5", "0.001"]),
    _ODD_TEXT,
)
_DROPOUTS = _mostly(st.sampled_from(["0", "0.05", "0.1", "0.0"]),
                    st.sampled_from(["1", "0.999999", "-0.1", "nan", "inf", "-0", "1e-320", "5%", ""]), _FLOATS)
_GPUS = _choice("t4", "a10g", "l4", "h100", "h100-80gb", "a100-40gb", "rtx4090", "cpu", "A10G", "nvidia-t4", "auto")
_SINCE = st.one_of(
    st.sampled_from(["7d", "12h", "30m", "2026-11-01", "0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-05:00",
                     "0d", "-1d", "99999999999d", "9999999999999999999999h", "2026-13-45", "yesterday", "1e9d"]),
    _ODD_TEXT,
)


@dataclass(frozen=True)
class FuzzFiles:
    """What the grammar may name on disk; everything under the test's own temporary folder.

    ``closed_port``: a local port bound by the fuzzer and never listened on, so a connection to
    it is refused at once: every Ray or job-API address the grammar gives names it (never
    ``auto`` or a default, which could reach a real cluster on this machine)."""

    root: Path
    closed_port: int = 9

    def ray_addresses(self) -> list[str]:
        return [f"127.0.0.1:{self.closed_port}", f"ray://127.0.0.1:{self.closed_port}", f"http://127.0.0.1:{self.closed_port}"]

    def job_api_addresses(self) -> list[str]:
        return [f"http://127.0.0.1:{self.closed_port}", f"https://127.0.0.1:{self.closed_port}"]

    def paths(self) -> list[str]:
        return [str(self.root / name) for name in ("tiny", "tiny/config.json", "llama[v2]", "markup.json", "generated.json")]

    @property
    def generated(self) -> Path:
        return self.root / "generated.json"

    def emit_dirs(self) -> list[str]:
        """A new directory, one that holds files, a file, and one under a file."""
        return [str(self.root / "emit-new"), str(self.root / "tiny"), str(self.root / "markup.json"),
                str(self.root / "markup.json" / "below")]

    def db_urls(self) -> list[str]:
        return [f"sqlite:///{self.root / 'other.db'}", "not-a-url", "sqlite:///" + str(self.root / "missing-dir" / "x.db"),
                f"sqlite:///{self.old_db}"]

    @property
    def old_db(self) -> Path:
        """A database at schema 0002 (before calibrations, migration 0003): every command must
        say 'planner db upgrade' or go on without it, never fail on the missing table."""
        return self.root / "old-0002.db"

    def create(self) -> None:
        for folder, config in (("tiny", TINY), ("llama[v2]", TINY)):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
            (self.root / folder / "config.json").write_text(json.dumps(config))
        (self.root / "markup.json").write_text(json.dumps({**TINY, "_name_or_path": "org/model[/bold]"}))
        self.generated.write_text(json.dumps(TINY))
        if not self.old_db.exists():

            from planner.store.schema import alembic_command, alembic_config

            alembic_command("upgrade", alembic_config(url=f"sqlite:///{self.old_db}"), "0002")


def _models(files: FuzzFiles) -> st.SearchStrategy[str]:
    return _mostly(
        st.one_of(st.sampled_from(["gpt2", "Qwen/Qwen2.5-0.5B", "openai-community/gpt2", "bert-base-uncased",
                                   "mistralai/Mixtral-8x7B-v0.1", "google/gemma-2b", "meta-llama/Llama-2-7b-hf"]),
                  st.sampled_from(files.paths())),
        st.sampled_from(["meta-llama/Llama-3-8B", "", " ", "a" * 300, "x\x00y", "~nobody/x", "./nothing.json", "/", "."]),
        _ODD_TEXT, _MARKUP,
    )


def option_grammar(files: FuzzFiles, command: str) -> dict[str, st.SearchStrategy[str] | None]:
    """option -> strategy of its value (None: a flag), for one command."""
    shared = {
        "--model": _models(files), "--gpu": _GPUS, "--gpus": _ints((1, 17)), "--gpu-mem": _SIZES,
        "--method": _choice("full", "lora", "qlora", "auto"), "--json": None,
    }
    config = {
        "--precision": _choice("fp32", "fp16-mixed", "bf16-mixed", "fp16", "bf16", "auto"),
        "--optimizer": _choice("adamw", "adamw_8bit", "paged_adamw_8bit", "adafactor", "sgd"),
        "--micro-batch": _ints((1, 64)), "--seq-len": _ints((1, 8192)), "--grad-accum": _ints((1, 64)),
        "--grad-ckpt": None, "--no-grad-ckpt": None, "--attention": _choice("sdpa", "eager", "flash"),
        "--lora-r": _ints((1, 256)), "--lora-targets": _choice("all-linear", "q_proj,v_proj", ",", "q_proj,,v_proj"),
        "--zero": _ints((0, 3)), "--offload": _choice("none", "optimizer", "optimizer+params"),
        "--sharding": _choice("none", "ddp", "zero1", "zero2", "zero3", "fsdp2"),
    }
    # the recipe knobs of estimate, measure, suggest and submit (fixed by the user, given to every candidate)
    recipe = {"--lora-dropout": _DROPOUTS, "--loop": _choice("trainer", "manual"), "--fused-ce": None, "--no-fused-ce": None,
              "--packing": None, "--no-packing": None, "--use-cache": None, "--no-use-cache": None,
              # torchtune's recipe settings: in and past their bounds, and with what refuses them
              "--optimizer-in-bwd": None, "--no-optimizer-in-bwd": None, "--loss-chunks": _ints((1, 64)),
              # the loss' dtype (refused with --fused-ce and with an encoder's or encoder-decoder's loss)
              "--loss-upcast": None, "--no-loss-upcast": None,
              # transformers <= 4.45's loss (refused with --fused-ce, --loss-chunks and an encoder's loss)
              "--loss-shift": None, "--no-loss-shift": None,
              # transformers 4.46-4.48's loss (refused without --loss-shift)
              "--loss-returns-head": None, "--no-loss-returns-head": None,
              # transformers 4's reentrant checkpoint around each layer (FSDP1's retained gradients)
              "--reentrant-ckpt": None, "--no-reentrant-ckpt": None,
              # transformers 4's per-expert MoE modules (refused for a model type other than Mixtral)
              "--experts-loop": None, "--no-experts-loop": None,
              # transformers 4.36-4.39's list-indexed loop (refused without --experts-loop)
              "--experts-list-index": None, "--no-experts-list-index": None,
              # transformers 4's per-layer rotary tables (a no-op for learned positions)
              "--rope-caches": None, "--no-rope-caches": None,
              # the transformers release whose knobs the run takes: table boundaries, 5.x, too old, not a version
              "--transformers": st.one_of(_choice("4.36.0", "4.39.3", "4.40.0", "4.45.2", "4.46.0", "4.48.1", "4.49.0",
                                                  "5.0", "4.35.2", "4.x", ""), _ODD_TEXT),
              # torch.compile's fused kernels (the step's pricing only)
              "--compile": None, "--no-compile": None,
              # QLoRA's k-bit preparation (refused with any other method)
              "--kbit-upcast": None, "--no-kbit-upcast": None,
              # the evaluation pass (planner.memory.evaluation): sizes in and past their bounds
              "--eval-batch": _ints((1, 64)), "--eval-seq-len": _ints((1, 8192)), "--generate-tokens": _ints((1, 512)),
              # RoPE context extension: factors in and past their bounds, types known and not, a learned-position model
              "--rope-scaling": st.one_of(_choice("2", "linear:4", "yarn:8", "llama3:2", "dynamic:1", "0.5", "1025", "ntk:2", "x"),
                                          _ODD_TEXT)}
    shared.update(recipe)
    db = {"--db": st.sampled_from(files.db_urls())}
    picture = {
        "--timeline": st.sampled_from([str(files.root / n) for n in ("t.png", "t.svg", "t.html", "t.txt", "missing/t.png")]),
        "--alloc-conf": st.one_of(st.sampled_from(["max_split_size_mb:128,expandable_segments:True", "nonsense:1",
                                                   "max_split_size_mb:-5", ""]), _ODD_TEXT),
    }
    config.update(picture)
    emit = {"--emit": st.sampled_from(files.emit_dirs()), "--force": None,
            "--dataset": st.one_of(st.sampled_from(["data.jsonl", "wikitext"]), _ODD_TEXT),
            # suggest reads --dataset's lengths with these (submit has neither: it takes no local data)
            "--tokenizer": st.one_of(st.sampled_from(["tokenizer.json", "missing/"]), _ODD_TEXT),
            "--dataset-field": st.one_of(_choice("text", "input_ids", ""), _ODD_TEXT)}
    grammar: dict[str, dict[str, st.SearchStrategy[str] | None]] = {
        "estimate": {**shared, **config, **db, "--solve": _choice("seq-len", "micro-batch", "batch")},
        # --gpus is never 1, so measure refuses before it trains (see measure_never_trains)
        "measure": {**shared, **config, **db, "--gpus": st.integers().filter(lambda n: n != 1).map(str),
                    "--steps": _ints((2, 5)), "--timeout": _FLOATS, "--no-save": None},
        "suggest": {**shared, **db, **emit, "--target-batch": _ints((1, 512)), "--seq-len": _ints((1, 8192)),
                    "--precision": config["--precision"], "--no-offload": None, "--cpu-mem": _SIZES,
                    "--top-k": _ints((1, 10)), "--no-save": None, "--prefer": _choice("fidelity", "speed")},
        "emit": {**db, "--rank": _ints((-1, 10)), "--force": None, "--dataset": emit["--dataset"],
                 "--for": _choice("hf", "trl", "axolotl", "llama-factory", "torchtune", "unsloth")},
        # the port is always one serve refuses (see ALWAYS): no server ever starts
        "serve": {**db, "--port": st.sampled_from(["0", "70000", "-1"]), "--host": st.sampled_from(["127.0.0.1", "", "::1"]),
                  "--ray-address": st.sampled_from(files.job_api_addresses()), "--workers": _ints((0, 3)),
                  "--log-level": _choice("info", "debug", "loud"), "--graceful-timeout": _ints((1, 600))},
        "models": {"--search": st.one_of(_ODD_TEXT, _MARKUP, st.sampled_from(["llama", "qwen2", "", "Q"])), "--json": None},
        "gpus": {"--json": None},
        "history": {**db, "--model": _models(files), "--gpu": _GPUS, "--status": _choice("planned", "verified", "failed", "verifying"),
                    "--since": _SINCE, "--limit": _ints((0, 50)), "--json": None},
        "show": {**db, "--json": None},
        "db upgrade": {**db},
        "db current": {**db},
        "calibrate": {**db, "--gpu": _GPUS, "--reset": None, "--json": None},
        "check": {**db, "--gpu": _GPUS, "--model": _models(files), "--gpus": _ints((1, 17)), "--seq-len": _ints((1, 8192)),
                  "--gpu-mem": _SIZES, "--cpu-mem": _SIZES, "--trainer": _choice("hf", "trl", "axolotl", "llama-factory", "torchtune", "unsloth"), "--json": None},
    }
    verify = {"--verify-top": _ints((1, 5)), "--steps": _ints((2, 5)), "--run-timeout": _FLOATS}
    job_api = {"--address": st.sampled_from(files.job_api_addresses())}
    grammar.update({
        # the Ray address always names the closed port (see ALWAYS): nothing is ever verified
        "suggest": {**grammar["suggest"], **verify, "--verify": None, "--fresh": None,
                    "--ray-address": st.sampled_from(files.ray_addresses()),
                    # which GPU to rent (suggest only): comma lists of GPUs, not the whole catalog's
                    # ~90 searches per example
                    "--gpu": st.one_of(_GPUS, st.sampled_from(["a10g,l4", "t4,nope", "a10g,cpu", ",", "l4,L4"])),
                    "--gpus-max": _ints((0, 17)), "--tokens": st.one_of(_choice("1e9", "2B", "500M", "0", "-1", "1e30"),
                                                                        _ODD_TEXT),
                    "--epochs": _FLOATS, "--dataset-tokens": st.one_of(_choice("1e6", "abc"), _ODD_TEXT),
                    "--prices": st.one_of(st.sampled_from(["prices.json", "missing.yaml"]), _ODD_TEXT),
                    "--max-seq": None,
                    "--plan-id": st.one_of(st.text("0123456789abcdef", max_size=32), _ODD_TEXT)},
        "submit": {**{k: v for k, v in grammar["suggest"].items() if k not in ("--no-save", *emit)}, **verify,
                   **job_api, "--verify": None, "--no-verify": None},
        "jobs list": {**job_api, "--json": None},
        "jobs status": {**job_api, **db, "--wait": None, "--timeout": _FLOATS, "--json": None},
        "jobs logs": {**job_api},
        "jobs stop": {**job_api},
        # a job's entrypoint (hidden): not fuzzed (COMMANDS), its Ray address would be the closed port
        "jobs verify": {**verify, **db, "--model": _models(files), "--ray-address": st.sampled_from(files.ray_addresses()),
                        "--json": None},
    })
    return grammar[command]


COMMANDS = ("estimate", "measure", "suggest", "submit", "models", "gpus", "history", "show", "emit", "serve", "jobs list",
            "jobs status", "jobs logs", "jobs stop", "db upgrade", "db current", "calibrate", "check")
#: options given whenever a command runs, whatever else is drawn: measure with a --gpus it refuses
#: before training; every command that could reach Ray or its job API with the closed port
ALWAYS = {"measure": ["--gpus"], "serve": ["--port"], "submit": ["--address"], "jobs list": ["--address"], "jobs status": ["--address"],
          "jobs logs": ["--address"], "jobs stop": ["--address"]}
#: suggest reaches Ray only with --verify or --plan-id; then its --ray-address is the closed port
ALWAYS_WITH = {("suggest", "--verify"): "--ray-address", ("suggest", "--plan-id"): "--ray-address"}
#: commands with a positional argument, and what it is
POSITIONAL = {"show": "plan id", "emit": "plan id", "jobs status": "job id", "jobs logs": "job id", "jobs stop": "job id"}
_IDS = {"plan id": st.one_of(st.text("0123456789abcdef", min_size=0, max_size=40), _ODD_TEXT, _MARKUP),
        "job id": st.one_of(st.sampled_from(["raysubmit_abc123", "", "x" * 300]), _ODD_TEXT, _MARKUP)}
#: the short names the grammar may use instead of the long ones
SHORT = {"--model": "-m", "--gpu": "-g", "--target-batch": "-b", "--top-k": "-k", "--limit": "-n", "--search": "-s"}


@st.composite
def argv_and_config(draw, files: FuzzFiles):
    """(argv, config document to write to files.generated or None)."""
    command = draw(st.sampled_from(COMMANDS))
    grammar = option_grammar(files, command)
    argv = command.split()
    if command in POSITIONAL:
        argv.append(draw(_IDS[POSITIONAL[command]]))
    if command == "emit":
        argv.append(draw(st.sampled_from(files.emit_dirs())))
    if command == "check":  # a training config to read: the generated config.json, markup, a folder, nothing
        argv.append(draw(st.sampled_from([str(files.generated), *files.emit_dirs()[1:], str(files.root / "none.yaml")])))
    required = {"estimate": ["--model", "--gpu"], "check": ["--gpu"], "suggest": ["--model", "--gpu", "--target-batch"],
                "submit": ["--model", "--gpu", "--target-batch"], "measure": ["--model"]}.get(command, [])
    chosen = draw(st.lists(st.sampled_from(sorted(grammar)), max_size=6, unique=True))
    # usually complete (so the library runs), sometimes not (so the usage errors run)
    names = ([*required, *(n for n in chosen if n not in required)] if draw(st.integers(0, 9)) else chosen)
    forced = ALWAYS.get(command, []) + [then for (cmd, given), then in ALWAYS_WITH.items() if cmd == command and given in names]
    names += [name for name in forced if name not in names]
    for name in names:
        flag = SHORT.get(name, name) if draw(st.booleans()) else name
        value = grammar[name]
        argv += [flag] if value is None else [flag, draw(value)]
    if not draw(st.integers(0, 19)):  # an option no command has, or a stray word
        argv.insert(draw(st.integers(0, len(argv))), draw(st.sampled_from(["--bogus", "extra", "-x", "--json=3", "--"])))
    config = draw(st.one_of(st.none(), config_documents())) if files.generated.name in " ".join(argv) else None
    return argv, config


# ---- config.json documents ------------------------------------------------------------------------

_JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from([10**400, 2**63, -1, 0, 1]),
    st.floats(allow_nan=True, allow_infinity=True), _ODD_TEXT, _MARKUP,
)
_JSON_VALUES = st.recursive(_JSON_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                    st.dictionaries(_ODD_TEXT, inner, max_size=4)), max_leaves=12)
_SIZE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
              "intermediate_size", "max_position_embeddings", "head_dim", "num_local_experts", "num_experts_per_tok",
              "n_embd", "n_layer", "n_head", "n_positions", "n_inner", "ffn_dim", "sliding_window", "word_embed_proj_dim",
              "type_vocab_size", "pad_token_id", "seq_length", "num_kv_heads", "n_embed", "ffn_hidden_size")
_SIZE_VALUES = _mostly(
    st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, 256]),
    st.integers(-(2**70), 2**70), st.sampled_from([10**400, 10**12, 10**7, 2**63, 0, -1, 2048, 2049]), _JSON_SCALARS,
)
_MODEL_TYPES = _mostly(st.sampled_from(["llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gpt2", "gpt_neox",
                                          "bloom", "falcon", "opt", "phi", "phi3", "starcoder2", "bert", "roberta"]),
                       st.just("t5"), _JSON_SCALARS)


@st.composite
def config_dicts(draw):
    """A config.json dict: a real-looking base with some keys changed, added or removed."""
    config: dict = dict(TINY, model_type=draw(_MODEL_TYPES))
    for key in draw(st.lists(st.sampled_from(_SIZE_KEYS), max_size=4, unique=True)):
        config[key] = draw(_SIZE_VALUES)
    if not draw(st.integers(0, 3)):
        for key in draw(st.lists(st.sampled_from(sorted(TINY)), max_size=2, unique=True)):
            config.pop(key, None)
    extra = draw(st.dictionaries(st.sampled_from(["tie_word_embeddings", "attention_dropout", "hidden_dropout", "_name_or_path",
                                                  "num_ln_in_parallel_attn", "new_decoder_architecture", "rope_scaling",
                                                  "multi_query", "parallel_attn", "bias", "hidden_act", "partial_rotary_factor"]),
                                 _JSON_VALUES, max_size=3))
    return {**config, **extra}


def config_documents() -> st.SearchStrategy[str | dict]:
    """Text that may not be JSON at all, any JSON value, or a config.json dict."""
    return st.one_of(
        config_dicts(), config_dicts(), _JSON_VALUES,
        st.sampled_from(["[" * 200_000, "{" * 5000, '{"a": 1' + "0" * 5000 + "}", "", "\ufeff{}", "null", "{\"model_type\": NaN}"]),
        _ODD_TEXT,
    )


def write_document(path: Path, document: str | dict) -> None:
    text = document if isinstance(document, str) else json.dumps(document, allow_nan=True)
    path.write_text(text, encoding="utf-8")


# ---- running and judging ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    code: int
    out: str
    err: str


def run_cli(argv: list[str]) -> Outcome:
    """``planner.cli.main(argv)`` with stdout and stderr captured; exceptions propagate."""
    from planner.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return Outcome(code, out.getvalue(), err.getvalue())




def problems(outcome: Outcome) -> list[str]:
    """What is wrong with one outcome: an undocumented exit code, a traceback, a multi-line error."""
    found = []
    if outcome.code not in exit_codes():
        found.append(f"exit code {outcome.code}")
    if "Traceback (most recent call last)" in outcome.out + outcome.err:
        found.append("a traceback")
    error_lines = [line for line in outcome.err.splitlines() if line.startswith("error:")]
    if len(error_lines) > 1:
        found.append(f"{len(error_lines)} error lines")
    if outcome.code == 2 and (len(error_lines) != 1 or not outcome.err.rstrip("\n").splitlines()[-1].startswith("error: ")):
        found.append("exit 2 without exactly one closing 'error:' line")
    return found


class TrainingStarted(AssertionError):
    """The fuzzer reached a real training run: the grammar must only give measure bad values."""


@contextlib.contextmanager
def measure_never_trains():
    """Replace the entry points of training runs and of Ray sessions with a trap while the fuzzer runs."""
    import importlib

    def trap(*args, **kwargs):
        raise TrainingStarted("a fuzzed command started a training run or a Ray session")

    entry_points = {"workers": ("measure", "measure_with_details"), "workers.runner": ("measure", "measure_with_details", "run_job"),
                    "planner.verify.driver": ("verify_plan",), "planner.verify.cluster": ("ray_session",)}
    saved = {}
    for module_name, names in entry_points.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a branch without verification
            continue
        saved.update({(module, name): getattr(module, name) for name in names if hasattr(module, name)})
    try:
        for mod, name in saved:
            setattr(mod, name, trap)
        yield
    finally:
        for (mod, name), value in saved.items():
            setattr(mod, name, value)


def run_example(files: FuzzFiles, argv: list[str], config: str | dict | None) -> Outcome:
    write_document(files.generated, config if config is not None else TINY)
    return run_cli(argv)


# ---- the properties --------------------------------------------------------------------------------


@contextlib.contextmanager
def closed_port():
    """A local TCP port bound and never listened on: connecting to it is refused at once."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


#: environment a fuzzed command could otherwise follow to a real cluster or database
FOREIGN_ENV = ("RAY_ADDRESS", "PLANNER_DATABASE_URL")


@pytest.fixture
def fuzz_files(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    for name in FOREIGN_ENV:
        monkeypatch.delenv(name, raising=False)
    with closed_port() as port, measure_never_trains():
        files = FuzzFiles(tmp_path / "fuzz", closed_port=port)
        files.create()
        yield files


_SETTINGS = settings(max_examples=CI_EXAMPLES, deadline=None, derandomize=True, database=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                            HealthCheck.data_too_large, HealthCheck.large_base_example])


def test_the_grammar_covers_every_option():
    """Every command and option the CLI has is in the grammar (a new option must be added here)."""
    import typer.main

    from planner.cli import get_app

    files = FuzzFiles(Path("/nonexistent"))
    group = typer.main.get_command(get_app())
    seen = set()
    for name, command in group.commands.items():
        subcommands = getattr(command, "commands", None)
        for full, cmd in ([(f"{name} {s}", c) for s, c in subcommands.items()] if subcommands else [(name, command)]):
            seen.add(full)
            grammar = option_grammar(files, full)
            for param in cmd.params:
                options = [o for o in (*param.opts, *param.secondary_opts) if o.startswith("--")]
                assert not options or set(options) & set(grammar), (full, param.opts)
    assert seen == set(COMMANDS) | {"jobs verify"}  # the jobs' hidden entrypoint: in the grammar, not fuzzed


@_SETTINGS
@given(data=st.data())
def test_cli_never_prints_a_traceback(fuzz_files, data):
    argv, config = data.draw(argv_and_config(fuzz_files), label="argv, config")
    outcome = run_example(fuzz_files, argv, config)
    assert not problems(outcome), (argv, problems(outcome), outcome.err[-500:])


@_SETTINGS
@given(document=config_documents())
def test_config_json_parsing_never_raises_anything_else(tmp_path_factory, document):
    from planner.catalog import resolve_model
    from planner.errors import PlannerError

    path = tmp_path_factory.mktemp("config") / "config.json"
    write_document(path, document)
    try:
        spec = resolve_model(str(path))
    except PlannerError as exc:
        assert "\n" not in str(exc) and str(exc).startswith(str(path)), str(exc)[:300]
        assert len(str(exc)) < 2000
        return
    # a config that resolves describes a model the planner can size
    assert spec.params_total > 0 and spec.num_layers >= 1
    assert math.isfinite(float(spec.params_total))
    assert os.fspath(path) == spec.source
