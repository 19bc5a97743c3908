"""Issue 12, the reproductions whose causes are in the catalog and the CLI's shared parts.

Item 1: user text is printed as text, never read as rich markup. Item 4/5: odd model names and
config.json files are one line and exit 2, never a traceback, and config sizes are bounded by what
real models hold. Item 8: closest-id suggestions, help at 80 columns, usage errors in one wording
that echoes the bad value.
"""

from __future__ import annotations

import json
import re

import pytest
from support.cli import ONE_ERROR_LINE, TINY, assert_user_error, write_config  # noqa: F401

# ---- item 1: markup ------------------------------------------------------------------------------


def test_an_id_with_markup_is_printed_stored_and_listed_as_written(cli, tmp_path):
    config = write_config(tmp_path / "m", _name_or_path="org/model[/bold]")
    estimated = cli("estimate", "-m", config, "-g", "a10g")
    assert estimated.code == 0, estimated
    assert estimated.out.startswith("org/model[/bold]: ")
    suggested = cli("suggest", "-m", config, "-g", "a10g", "-b", "4")
    assert suggested.code == 0 and "org/model[/bold] (" in suggested.out, suggested
    history = cli("history")
    assert history.code == 0 and "org/model[/bold]" in history.out, history
    plan_id = history.out.split("│")[history.out.split("│").index(" org/model[/bold] ") - 2].strip()
    shown = cli("show", plan_id)
    assert shown.code == 0 and "model org/model[/bold] " in shown.out, shown


@pytest.mark.parametrize("folder", ["llama[v2]", "runs[/exp1]", "x[bold]y", "fire:fire:"])
def test_a_folder_name_prints_as_it_is(cli, tmp_path, folder):
    config = write_config(tmp_path / folder)
    for args in (["estimate", "-m", config.parent, "-g", "a10g"], ["suggest", "-m", config.parent, "-g", "a10g", "-b", "2"]):
        result = cli(*args)
        assert result.code == 0, result
        assert result.out.startswith(str(config)), result


@pytest.mark.parametrize("search", ["[/]", "[bold]", "[/bold]", "llama[v2]", ":fire:"])
def test_models_search_with_brackets(cli, search):
    result = cli("models", "--search", search)
    assert result.code == 0, result
    assert f"no catalog model matches {search!r}" in result.out


def test_ids_from_config_json_are_kept_unless_unprintable_or_too_long():
    from planner.catalog import MAX_ID_CHARS, usable_name_or_path

    assert usable_name_or_path("org/model[/bold]") == "org/model[/bold]"
    assert usable_name_or_path("org/model\n[red]x") is None
    assert usable_name_or_path("org/\x1b[2Jmodel") is None  # a terminal escape sequence
    assert usable_name_or_path("a" * (MAX_ID_CHARS + 1)) is None
    assert usable_name_or_path(42) is None and usable_name_or_path("  ") is None


def test_an_unprintable_name_or_path_falls_back_to_the_file(tmp_path):
    from planner.catalog import resolve_model

    config = write_config(tmp_path / "m", _name_or_path="evil\x1b]0;title\x07")
    assert resolve_model(str(config)).id == str(config)


# ---- item 4/5: no traceback from names and config.json files ----------------------------------


def test_a_300_character_model_name(cli):
    result = cli("estimate", "-m", "a" * 300, "-g", "a10g")
    assert_user_error(result, "(300 characters) not found in the catalog")
    assert len(result.err) < 600


@pytest.mark.parametrize("name", ["a/" * 200 + "config.json", "x\x00y", "~nosuchuser/model", "/" + "b" * 5000])
def test_names_no_file_system_holds(cli, name):
    assert_user_error(cli("estimate", "-m", name, "-g", "a10g"))


BAD_CONFIGS = {
    "deep nesting": ("[" * 200_000, "nested too deeply to be a config.json"),
    "hidden_size 10^400": (
        json.dumps(TINY).replace('"hidden_size": 64', '"hidden_size": 1' + "0" * 400),
        "hidden_size 1000000000000000000000000000000000000... is past the bound on hidden size",
    ),
    "10^12 layers": ({**TINY, "num_hidden_layers": 10**12}, "num_hidden_layers 1000000000000 is past the bound on layers"),
    "10^7 layers": ({**TINY, "num_hidden_layers": 10**7}, "at most 2,048"),
    "5000-digit integer": ('{"hidden_size": 1' + "0" * 5000 + "}", "not a usable config.json"),
    "vocab 10^9": ({**TINY, "vocab_size": 10**9}, "vocab_size 1000000000 is past the bound on vocabulary"),
    "heads 10^6": ({**TINY, "num_attention_heads": 10**6}, "num_attention_heads 1000000 is past the bound"),
    "hidden as float inf": ('{"model_type": "llama", "hidden_size": Infinity}', "hidden_size must be a whole number >= 1, got inf"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_a_config_json_past_what_exists_is_one_line(cli, tmp_path, case):
    content, fragment = BAD_CONFIGS[case]
    path = tmp_path / "config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    for command in (["estimate", "-m", path, "-g", "a10g"], ["suggest", "-m", path, "-g", "a10g", "-b", "8"]):
        assert_user_error(cli(*command), str(path), fragment)


def test_a_huge_file_is_not_read_whole(cli, tmp_path):
    from planner.catalog import MAX_CONFIG_BYTES

    path = tmp_path / "config.json"
    path.write_bytes(b" " * (MAX_CONFIG_BYTES + 1))
    assert_user_error(cli("estimate", "-m", path, "-g", "a10g"), "too large for a config.json")


def test_every_real_config_is_inside_the_bounds():
    """The bounds leave every shipped catalog model (and a 10x larger one) accepted."""
    from planner.catalog import catalog_ids, resolve_model
    from planner.catalog.blocks import SIZE_BOUNDS

    for model_id in catalog_ids():
        spec = resolve_model(model_id)
        for key, (bound, _) in SIZE_BOUNDS.items():
            value = spec.config.get(key)
            if isinstance(value, int):
                assert 10 * value <= bound or key in ("max_position_embeddings", "sliding_window"), (model_id, key)


def test_the_largest_real_shapes_fit_the_bounds(tmp_path):
    """Llama-3.1-405B's config.json (hub: meta-llama/Llama-3.1-405B): 126 layers, hidden 16384."""
    from planner.catalog import resolve_model

    config = write_config(
        tmp_path / "405b", hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
        num_attention_heads=128, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
    )
    assert resolve_model(str(config)).num_layers == 126


# ---- item 8: closest ids, help, usage errors --------------------------------------------------------


@pytest.mark.parametrize("typed, first", [
    ("meta-llama/Llama-3-8B", "meta-llama/Meta-Llama-3-8B"),
    ("llama-3-8b", "meta-llama/Meta-Llama-3-8B"),
    ("llama3.1-8b", "meta-llama/Llama-3.1-8B"),
    ("Llama-2-7b", "meta-llama/Llama-2-7b-hf"),
    ("phi3", "microsoft/Phi-3-mini-4k-instruct"),
    ("qwen-7b", "Qwen/Qwen2.5-7B"),
    ("mistral-7b", "mistralai/Mistral-7B-v0.1"),
])
def test_the_closest_id_comes_first(cli, typed, first, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    result = cli("estimate", "-m", typed, "-g", "a10g")
    assert_user_error(result, f"closest catalog ids: {first}, ")


COMMANDS = ["estimate", "measure", "suggest", "models", "gpus", "history", "show", "db"]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_at_80_columns_keeps_every_choice_list_whole(cli, monkeypatch, command):
    from planner.cli import get_app

    monkeypatch.setenv("COLUMNS", "80")
    result = cli(command, "--help")
    if result.code == 2 and "no such command" in result.err:
        pytest.skip(f"no {command} command on this branch")
    assert result.code == 0, result
    assert "…" not in result.out
    assert all(len(line) <= 80 for line in result.out.splitlines()), result.out
    flat = " ".join(result.out.split())
    import typer.main

    group = typer.main.get_command(get_app())
    for param in group.commands[command].params:
        for choices in re.findall(r"\w[\w+\-]*(?:\|[\w+\-]+)+", getattr(param, "help", None) or ""):
            assert " | ".join(choices.split("|")) in flat, (choices, result.out)


@pytest.mark.parametrize("args, option, bad, expected", [
    # the option as it was typed: -n is not called --limit, -b not --target-batch
    (["history", "-n", "abc"], "-n", "abc", "a whole number"),
    (["history", "--limit", "abc"], "--limit", "abc", "a whole number"),
    (["suggest", "-m", "gpt2", "-g", "t4", "-b", "x"], "-b", "x", "a whole number"),
    (["suggest", "-m", "gpt2", "-g", "t4", "--target-batch", "x"], "--target-batch", "x", "a whole number"),
    (["estimate", "-m", "gpt2", "-g", "t4", "--gpus", "1.5"], "--gpus", "1.5", "a whole number"),
    (["estimate", "-m", "gpt2", "-g", "t4", "--micro-batch", "two"], "--micro-batch", "two", "a whole number"),
    (["measure", "-m", "gpt2", "--steps", "1e3"], "--steps", "1e3", "a whole number"),
    (["measure", "-m", "gpt2", "--timeout", "soon"], "--timeout", "soon", "a number"),
])
def test_integer_errors_echo_the_bad_value(cli, args, option, bad, expected):
    result = cli(*args)
    assert result.code == 2
    assert result.err == f"error: {option} must be {expected}, got {bad!r} (see 'planner {args[0]} --help')\n"


@pytest.mark.parametrize("args, line", [
    (["estimate", "-m", "gpt2"], "error: --gpu is required (see 'planner estimate --help')"),
    (["show"], "error: PLAN_ID is required (see 'planner show --help')"),
    (["models", "--json=3"], "error: option '--json' does not take a value (see 'planner models --help')"),
    (["estimate", "-m"], "error: option '-m' requires an argument (see 'planner estimate --help')"),
    (["nosuch"], "error: no such command 'nosuch' (see 'planner --help')"),
])
def test_usage_errors_share_the_library_wording(cli, args, line):
    result = cli(*args)
    assert (result.code, result.err) == (2, line + "\n")


# ---- the issue's other reproductions: no traceback, whoever's file the fix is in --------------------

ISSUE_REPRODUCTIONS = {
    "history -n 2**63": ["history", "-n", "9223372036854775808"],
    "history --since year 1": ["history", "--since", "0001-01-01T00:00:00+01:00"],
    "history --since year 9999": ["history", "--since", "9999-12-31T23:59:59-05:00"],
    "estimate markup path": ["estimate", "-m", "dir/runs[/exp1]", "-g", "a10g"],
    "models markup search": ["models", "--search", "[/]"],
    "300-character name": ["estimate", "-m", "a" * 300, "-g", "a10g"],
}


@pytest.mark.parametrize("argv", list(ISSUE_REPRODUCTIONS.values()), ids=list(ISSUE_REPRODUCTIONS))
def test_the_issue_reproductions_end_in_one_line(cli, argv):
    result = cli(*argv)
    assert result.code in (0, 2), result
    assert "Traceback" not in result.out + result.err
    assert result.code == 0 or ONE_ERROR_LINE.match(result.err), result
