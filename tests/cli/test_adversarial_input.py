"""Input a demanding new user sends that the fuzz grammar does not: each one line naming what is
wrong and the fix (exit 2), never a traceback, never an empty answer read as a result."""

from __future__ import annotations

import pytest
from support.cli import assert_user_error, write_config


@pytest.fixture
def tiny(tmp_path):
    return write_config(tmp_path / "tiny")


@pytest.mark.parametrize("epochs, tokens", [("1e300", "1e16"), ("1e10", "1e16")])
def test_epochs_times_the_epoch_tokens_past_the_bound_is_one_line_naming_both(cli, tiny, epochs, tokens):
    # 1e300 x 1e16 overflowed round() (OverflowError); 1e10 x 1e16 blamed a --tokens never given
    assert_user_error(cli("suggest", "-m", tiny, "-b", "8", "--gpu", "a10g,l4", "--epochs", epochs,
                          "--dataset-tokens", tokens), "--epochs", "more than 1e16")


def test_an_empty_gpu_list_is_refused_not_answered_with_no_option(tiny):
    from planner.errors import InvalidConfigError
    from planner.planning import SuggestRequest
    from planner.pricing import load_prices
    from planner.rent import compare_gpus, workload

    with pytest.raises(InvalidConfigError, match="no GPU type to compare"):
        compare_gpus(SuggestRequest(model=str(tiny), gpu="any", target_batch=8), workload=workload(),
                     prices=load_prices(), gpu_names=[])


@pytest.mark.parametrize("lines", [
    ['{"text": ""}'],
    ['{"messages": [{"role": "user"}]}', '{"messages": "hello"}'],
])
def test_a_dataset_of_empty_samples_names_the_data_not_a_seq_len_never_given(cli, tiny, tmp_path, lines):
    # padded, the longest batch was 0 tokens: "--seq-len must be a whole number >= 1, got 0";
    # packed, --gpu any priced 0 tokens at $0.00
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(lines) + "\n")
    for extra in (["--no-packing", "-g", "a10g", "--no-save"], ["-g", "a10g,l4", "--epochs", "1"]):
        assert_user_error(cli("suggest", "-m", tiny, "-b", "8", "--dataset", data, *extra), "hold", "no tokens",
                          "--dataset-field")


def test_a_jsonl_file_saved_with_a_byte_order_mark_is_read(cli, tiny, tmp_path):
    data = tmp_path / "bom.jsonl"
    data.write_bytes(b'\xef\xbb\xbf{"input_ids": [1, 2, 3, 4, 5]}\n{"input_ids": [1, 2]}\n')
    r = cli("suggest", "-m", tiny, "-g", "a10g", "-b", "2", "--dataset", data, "--no-packing", "--no-save")
    assert r.code == 0, r  # was: "line 1 is not JSON" for a file every JSON reader with utf-8-sig reads
    assert "2 samples, 7 tokens" in r.out + r.err and "longest 5" in r.out + r.err, r


def test_a_nested_token_list_names_the_field_and_the_fix(cli, tiny, tmp_path):
    data = tmp_path / "nested.jsonl"
    data.write_text('{"input_ids": [[1, 2], [3]]}\n')
    assert_user_error(cli("suggest", "-m", tiny, "-g", "a10g", "-b", "2", "--dataset", data, "--no-save"),
                      "'input_ids'", "--dataset-field")


@pytest.mark.parametrize("make, fragments", [
    (lambda p: p.mkdir(), ["a folder, not a file"]),                                      # said "no such file"
    (lambda p: p.write_text('{"warp-drive": 1.0}'), ["prices.json: unknown GPU 'warp-drive'"]),  # named no file
    (lambda p: p.write_text('{"a10g": 1460}'), ["more than 1,000", "not a month's"]),      # a monthly price
])
def test_a_bad_prices_file_says_which_file_and_what_to_give(cli, tiny, tmp_path, make, fragments):
    path = tmp_path / "prices.json"
    make(path)
    assert_user_error(cli("suggest", "-m", tiny, "-b", "8", "-g", "a10g,l4", "--gpus-max", "1", "--prices", path),
                      *fragments)
