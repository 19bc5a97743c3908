"""Model resolution, catalog listing, fingerprints, config errors and ``planner models``."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from planner.catalog import (
    catalog_ids,
    catalog_source,
    fingerprint,
    list_catalog,
    resolve_model,
    spec_from_config,
)
from planner.errors import ModelConfigError, UnknownModelError, UnsupportedError

#: a tiny but complete llama config.json
TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "max_position_embeddings": 256,
}


def write_config(folder, config) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return str(path)


# ---- catalog ----------------------------------------------------------------------------------


def test_catalog_covers_the_required_architectures():
    ids = catalog_ids()
    assert len(ids) >= 35
    assert ids == sorted(ids, key=str.lower)
    types = {spec.model_type for spec in list_catalog()}
    required = {
        "llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi", "phi3", "gpt2",
        "gpt_neox", "opt", "bloom", "falcon", "bert", "roberta", "starcoder2",
    }
    assert required <= types
    assert resolve_model("deepseek-ai/deepseek-llm-7b-base").model_type == "llama"


def test_resolve_catalog_id_exact_and_case_insensitive():
    spec = resolve_model("meta-llama/Llama-2-7b-hf")
    assert (spec.id, spec.source, spec.params_total) == ("meta-llama/Llama-2-7b-hf", "catalog", 6_738_415_616)
    assert resolve_model("META-LLAMA/llama-2-7B-HF") is spec  # cached, same spec
    assert resolve_model("Meta-Llama/Llama-2-7b-hf").id == "meta-llama/Llama-2-7b-hf"
    # legacy org-less ids live under an org on the Hub now
    assert resolve_model("openai-community/gpt2").id == "gpt2"
    assert resolve_model("FacebookAI/roberta-large").id == "roberta-large"


def test_catalog_specs_drop_private_keys_but_keep_provenance():
    spec = resolve_model("gpt2")
    assert not any(key.startswith("_") for key in spec.config)
    assert "mlc-ai/mlc-llm" in catalog_source("gpt2")


def test_spec_fields_from_config_quirks():
    roberta = resolve_model("roberta-large")
    assert roberta.max_seq_len == 514 - 2  # positions start after padding_idx=1
    assert roberta.is_encoder and roberta.position == "learned"
    falcon = resolve_model("tiiuae/falcon-7b")
    assert (falcon.num_kv_heads, falcon.parallel_block, falcon.max_seq_len) == (1, True, 2048)
    bloom = resolve_model("bigscience/bloom-7b1")
    assert (bloom.position, bloom.max_seq_len) == ("alibi", 2048)
    gpt2 = resolve_model("gpt2")
    assert (gpt2.attn_dropout, gpt2.hidden_dropout, gpt2.tied_embeddings) == (0.1, 0.1, True)
    assert resolve_model("bert-base-uncased").hidden_dropout == 0.1
    qwen3 = resolve_model("Qwen/Qwen3-8B")
    assert (qwen3.head_dim, qwen3.sliding_window) == (128, None)
    assert resolve_model("google/gemma-2-27b").head_dim == 128  # explicit, not 4608 / 32 = 144
    assert resolve_model("mistralai/Mistral-7B-v0.1").sliding_window == 4096
    assert resolve_model("microsoft/phi-2").linear_names() == ("q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2")


def test_list_catalog_search():
    llamas = list_catalog(search="LLAMA")
    assert llamas and all("llama" in s.id.lower() or s.model_type == "llama" for s in llamas)
    assert "TinyLlama/TinyLlama-1.1B-Chat-v1.0" in [s.id for s in llamas]
    assert [s.id for s in list_catalog(search="mixtral")] == ["mistralai/Mixtral-8x7B-v0.1"]
    assert list_catalog(search="no-such-model") == []


# ---- fingerprints -------------------------------------------------------------------------------


def test_fingerprint_is_sha256_of_canonical_public_config():
    expected = hashlib.sha256(
        json.dumps(TINY_LLAMA, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()
    shuffled = dict(reversed(list(TINY_LLAMA.items())), _name_or_path="x", _source="y")
    assert fingerprint(TINY_LLAMA) == fingerprint(shuffled) == expected
    spec = spec_from_config(shuffled, model_id="t", source="test")
    assert fingerprint(spec) == expected
    assert fingerprint({**TINY_LLAMA, "vocab_size": 101}) != expected
    assert fingerprint(resolve_model("gpt2")) != fingerprint(resolve_model("gpt2-medium"))


# ---- paths and the HF cache ---------------------------------------------------------------------


def test_resolve_config_file_and_directory(tmp_path):
    path = write_config(tmp_path / "mine", TINY_LLAMA)
    spec = resolve_model(path)
    assert (spec.id, spec.source) == (path, path)
    assert spec.params_total == 100 * 64 * 2 + 2 * (
        64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64
    ) + 64  # embed + lm_head + 2 layers (q,o 64x64; k,v 64x32; gate/up/down; 2 norms) + final norm
    by_dir = resolve_model(str(tmp_path / "mine"))
    assert by_dir.source == path and by_dir.params_total == spec.params_total

    named = write_config(tmp_path / "named", {**TINY_LLAMA, "_name_or_path": "acme/tiny"})
    assert (resolve_model(named).id, resolve_model(named).source) == ("acme/tiny", named)


def test_directory_without_config_is_a_config_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelConfigError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))


def make_snapshot(hub, repo, commit, hidden):
    return write_config(hub / repo / "snapshots" / commit, {**TINY_LLAMA, "hidden_size": hidden})


def test_resolve_from_hf_cache_follows_refs_main(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    main = make_snapshot(hub, "models--acme--tiny-llama", "a" * 40, hidden=64)
    newer = make_snapshot(hub, "models--acme--tiny-llama", "b" * 40, hidden=128)
    os.utime(newer, (2_000_000_000, 2_000_000_000))
    (hub / "models--acme--tiny-llama" / "refs").mkdir()
    (hub / "models--acme--tiny-llama" / "refs" / "main").write_text("a" * 40)
    spec = resolve_model("acme/tiny-llama")
    assert (spec.id, spec.source, spec.hidden_size) == ("acme/tiny-llama", main, 64)


def test_resolve_from_hf_cache_without_refs_takes_newest(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    hub = tmp_path / "hf" / "hub"
    old = make_snapshot(hub, "models--acme--tiny-llama", "a" * 40, hidden=64)
    new = make_snapshot(hub, "models--acme--tiny-llama", "b" * 40, hidden=128)
    os.utime(old, (1_000_000_000, 1_000_000_000))
    os.utime(new, (2_000_000_000, 2_000_000_000))
    spec = resolve_model("acme/tiny-llama")
    assert (spec.source, spec.hidden_size) == (new, 128)


def test_unknown_model_names_the_three_closest_ids(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(UnknownModelError) as err:
        resolve_model("llama-2-7b")
    message = str(err.value)
    assert "\n" not in message
    assert "closest catalog ids: meta-llama/Llama-2-7b-hf, meta-llama/Llama-2-70b-hf, meta-llama/Llama-2-13b-hf;" in message
    assert message.endswith("pass a path to a config.json to plan any model")
    # Qwen3-1.7B and Qwen3-4B share "qwen" and "b" as Qwen3-8B does, and more characters ("7b")
    with pytest.raises(UnknownModelError, match="closest catalog ids: Qwen/Qwen2.5-7B, Qwen/Qwen3-1.7B, Qwen/Qwen3-4B"):
        resolve_model("qwen-7b")


# ---- malformed configs -----------------------------------------------------------------------------

MALFORMED = {
    "not-json": ("{ not json", "not valid JSON"),
    "not-an-object": ("[1, 2, 3]", "must be a JSON object, got list"),
    "no-model-type": ({k: v for k, v in TINY_LLAMA.items() if k != "model_type"}, "missing model_type"),
    "unknown-type": ({**TINY_LLAMA, "model_type": "frobnicator"}, "unknown model_type 'frobnicator'; supported: bert, bloom"),
    "no-hidden-size": ({k: v for k, v in TINY_LLAMA.items() if k != "hidden_size"}, "missing hidden_size"),
    "no-layers": ({k: v for k, v in TINY_LLAMA.items() if k != "num_hidden_layers"}, "missing num_hidden_layers"),
    "zero-layers": ({**TINY_LLAMA, "num_hidden_layers": 0}, "num_hidden_layers must be a whole number >= 1, got 0"),
    "negative-layers": ({**TINY_LLAMA, "num_hidden_layers": -2}, "num_hidden_layers is -2: a size cannot be negative"),
    # sizes a llama does not read: refused all the same (they were dropped without a word)
    "negative-window": ({**TINY_LLAMA, "sliding_window": -1}, "sliding_window is -1: a size cannot be negative; fix it "
                                                               "in the config.json"),
    "negative-experts": ({**TINY_LLAMA, "num_experts": -4}, "num_experts is -4: a size cannot be negative"),
    "negative-local-experts": ({**TINY_LLAMA, "num_local_experts": -8}, "num_local_experts is -8: a size cannot be negative"),
    "negative-float-size": ({**TINY_LLAMA, "n_inner": -1.5}, "n_inner is -1.5: a size cannot be negative"),
    "float-size": ({**TINY_LLAMA, "hidden_size": 64.5}, "hidden_size must be a whole number >= 1, got 64.5"),
    "bool-size": ({**TINY_LLAMA, "vocab_size": True}, "vocab_size must be a whole number >= 1, got True"),
    "indivisible-heads": ({**TINY_LLAMA, "num_attention_heads": 5}, "hidden_size 64 is not divisible by num_attention_heads 5"),
    "kv-heads": ({**TINY_LLAMA, "num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    "dropout": ({**TINY_LLAMA, "attention_dropout": 1.5}, "attention_dropout must be a dropout probability"),
    "flag": ({**TINY_LLAMA, "tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_config_is_one_line_naming_the_file(tmp_path, case):
    content, problem = MALFORMED[case]
    path = write_config(tmp_path / case, content)
    with pytest.raises(ModelConfigError) as err:
        resolve_model(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    assert problem in message


def test_a_negative_size_in_a_wrapper_text_config_names_it(tmp_path):
    gemma3 = {"model_type": "gemma3", "text_config": {**TINY_LLAMA, "model_type": "gemma3_text", "sliding_window": -512}}
    path = write_config(tmp_path / "gemma3", gemma3)
    with pytest.raises(ModelConfigError, match=r" \(text_config\): sliding_window is -512: a size cannot be negative"):
        resolve_model(path)


def test_bart_is_unsupported_with_the_supported_list(tmp_path):
    bart = {"model_type": "bart", "d_model": 1024, "encoder_layers": 12, "vocab_size": 50265}
    path = write_config(tmp_path / "bart", bart)
    with pytest.raises(UnsupportedError) as err:
        resolve_model(path)
    assert "model_type bart (encoder-decoder) is not supported yet; supported: bert, bloom, deepseek_v3, falcon" in str(err.value)


# ---- laziness: no torch, no catalog read at import ------------------------------------------------


def run_python(code: str) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_resolving_models_never_imports_torch():
    out = run_python(
        "import sys, planner.catalog as c\n"
        "c.resolve_model('meta-llama/Llama-2-7b-hf'); c.list_catalog(search='qwen')\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    assert out.strip() == "[]"


def test_catalog_is_read_lazily_and_not_by_help():
    out = run_python(
        "import contextlib, io, planner.catalog as c\n"
        "from planner.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()): main(['--help'])\n"
        "before = c._catalog.cache_info().currsize\n"
        "c.resolve_model('gpt2')\n"
        "print(before, c._catalog.cache_info().currsize)"
    )
    assert out.split() == ["0", "1"]


# ---- planner models --------------------------------------------------------------------------------


def test_planner_models_table(cli):
    result = cli("models")
    assert result.code == 0, result
    assert "meta-llama/Llama-2-7b-hf" in result.out and "6.74B" in result.out
    assert "46.7B" in result.out and "12.9B" in result.out  # Mixtral total / active per token
    # every catalog model plans now (Llama 4 and Nemotron-H included): the column says so
    assert "no:" not in " ".join(result.out.split()) and "Llama-4-Scout" in result.out
    assert "124M" in result.out  # gpt2


def test_planner_models_search_json(cli):
    result = cli("models", "--search", "llama", "--json")
    assert result.code == 0, result
    rows = json.loads(result.out)
    assert [row["id"] for row in rows] == [spec.id for spec in list_catalog(search="llama")]
    assert {"id", "architecture", "params", "active_params", "max_seq_len"} <= set(rows[0])
    llama2 = next(row for row in rows if row["id"] == "meta-llama/Llama-2-7b-hf")
    assert (llama2["params"], llama2["max_seq_len"]) == (6_738_415_616, 4096)


def test_planner_models_nothing_matches(cli):
    result = cli("models", "--search", "zzz-nothing")
    assert result.code == 0, result
    assert "no catalog model matches 'zzz-nothing'" in result.out
