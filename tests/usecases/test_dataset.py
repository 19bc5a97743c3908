"""planner.dataset: token lengths read from the user's data, and the longest batch a collation
builds. Lengths and epochs are checked against numbers counted by hand; a real tokenizer (the
tokenizers library, built here with a word-level vocabulary) counts the text."""

from __future__ import annotations

import json

import pytest

from planner.dataset import BYTES_PER_TOKEN, TokenLengths, plan_batches, read_lengths
from planner.errors import InvalidConfigError

#: five samples of 3, 1, 6, 2 and 4 words
TEXTS = ["the cat sat", "hello", "a b c d e f", "one two", "w x y z"]
WORDS = [3, 1, 6, 2, 4]


@pytest.fixture
def tokenizer(tmp_path):
    """A word-level tokenizer that adds a BOS token: a sample of n words is n + 1 tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"[UNK]": 0, "<s>": 1, **{w: i + 2 for i, w in enumerate(sorted({w for t in TEXTS for w in t.split()}))}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    return path


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_text_is_counted_with_the_tokenizer_special_tokens_included(tmp_path, tokenizer):
    data = _jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS])
    lengths, histogram = read_lengths(data, tokenizer=tokenizer.parent)  # the folder that holds tokenizer.json
    counts = sorted(w + 1 for w in WORDS)  # [2, 3, 4, 5, 7]
    assert (lengths.samples, lengths.tokens, lengths.longest) == (5, sum(counts), 7)
    assert lengths.p50 == 4  # nearest rank: the 3rd of 5
    assert lengths.p99 == 7
    assert not lengths.estimated and "tokenizer" in lengths.counted_by
    assert histogram == {n: 1 for n in counts}


def test_token_ids_need_no_tokenizer(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", [{"input_ids": list(range(n))} for n in (10, 30, 20)])
    lengths, _ = read_lengths(data)
    assert (lengths.samples, lengths.tokens, lengths.longest, lengths.p50) == (3, 60, 30, 20)
    assert not lengths.estimated and lengths.counted_by == "input_ids"


def test_without_a_tokenizer_text_is_estimated_from_bytes_and_said_so(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", [{"text": "x" * 10}, {"text": "é" * 4}])  # 10 bytes, 8 bytes
    lengths, _ = read_lengths(data)
    assert lengths.estimated
    assert lengths.tokens == -(-10 // BYTES_PER_TOKEN) + -(-8 // BYTES_PER_TOKEN)  # 3 + 2
    plan = plan_batches(lengths, target_batch=1, packing=False, seq_len=None, model_max=4096, histogram=_)
    assert "estimated at 4 bytes per token" in plan.describe(lengths)


def test_chat_messages_count_their_turns(tmp_path, tokenizer):
    data = _jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "the cat"},
                                                       {"role": "assistant", "content": "sat"}]}])
    lengths, _ = read_lengths(data, tokenizer=tokenizer)
    assert lengths.tokens == 4  # <s> the cat sat


def test_text_lines_parquet_and_a_saved_dataset_read_alike(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    txt = tmp_path / "d.txt"
    txt.write_text("\n".join(TEXTS) + "\n\n")  # the empty line is no sample
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": TEXTS}), parquet)
    saved = tmp_path / "saved"
    Dataset.from_dict({"text": TEXTS}).save_to_disk(str(saved))
    seen = [read_lengths(p, tokenizer=tokenizer)[0] for p in (txt, parquet, saved)]
    assert all(s.tokens == sum(WORDS) + 5 and s.longest == 7 for s in seen), seen


def test_padding_plans_for_the_longest_sample_and_packing_for_the_row(tmp_path):
    lengths = TokenLengths(samples=10, tokens=10 * 300, p50=300, p99=900, longest=900, counted_by="input_ids",
                           estimated=False)
    histogram = {300 - 100: 3, 300: 3, 900: 1, 100: 3}  # (not consistent with tokens: only the part over the cut counts)
    padded = plan_batches(lengths, target_batch=4, packing=False, seq_len=None, model_max=4096, histogram=histogram)
    assert (padded.seq_len, padded.steps_per_epoch, padded.truncated) == (900, 3, 0)  # ceil(10 / 4)
    assert padded.padded_tokens_worst == 10 * 900
    cut = plan_batches(lengths, target_batch=4, packing=False, seq_len=512, model_max=4096, histogram=histogram)
    assert (cut.seq_len, cut.truncated, cut.tokens_per_epoch) == (512, 1, 3000 - (900 - 512))
    packed = plan_batches(lengths, target_batch=4, packing=True, seq_len=1024, model_max=4096)
    assert (packed.seq_len, packed.steps_per_epoch) == (1024, 1)  # ceil(3000 / 1024) = 3 rows: one step of 4
    default = plan_batches(lengths, target_batch=1, packing=True, seq_len=None, model_max=1024)
    assert default.seq_len == 1024 and default.steps_per_epoch == 3
    longer = plan_batches(lengths, target_batch=4, packing=False, seq_len=None, model_max=512, histogram=histogram)
    assert longer.seq_len == 512 and longer.truncated == 1  # the model's maximum cuts as the tokenizer would


def test_progress_is_reported_in_bytes_up_to_the_file_size(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 2, 3]}] * 3000)
    calls = []
    read_lengths(data, progress=lambda done, total: calls.append((done, total)))
    size = data.stat().st_size
    assert len(calls) == 3 and calls[-1] == (size, size)  # batches of 1,024 samples
    assert [c[0] for c in calls] == sorted(c[0] for c in calls)


@pytest.mark.parametrize("content, suffix, fragment", [
    ("{not json\n", ".jsonl", "line 1 is not JSON"),
    ('["a"]\n', ".jsonl", "line 1 is not a JSON object"),
    ('{"prompt": "x"}\n', ".jsonl", "no input_ids, text or messages field (it has prompt)"),
    ('{"text": 5}\n', ".jsonl", "neither text nor a list of token ids"),
    ("", ".jsonl", "holds no samples"),
    ("a,b\n", ".csv", "unknown format .csv"),
])
def test_bad_data_is_one_line_that_says_what_to_give(tmp_path, content, suffix, fragment):
    path = tmp_path / f"d{suffix}"
    path.write_text(content)
    with pytest.raises(InvalidConfigError) as raised:
        read_lengths(path)
    message = str(raised.value)
    assert fragment in message and "\n" not in message, message


def test_a_missing_file_or_tokenizer_is_one_line(tmp_path):
    with pytest.raises(InvalidConfigError, match="no such file or folder"):
        read_lengths(tmp_path / "none.jsonl")
    data = _jsonl(tmp_path / "d.jsonl", [{"text": "a"}])
    with pytest.raises(InvalidConfigError, match="no tokenizer.json there"):
        read_lengths(data, tokenizer=tmp_path)
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{}")
    with pytest.raises(InvalidConfigError, match="not a tokenizer.json"):
        read_lengths(data, tokenizer=bad)


def test_a_named_field_is_read_and_a_missing_one_named(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a b c", "ids": [1, 2]}])
    assert read_lengths(data, field="ids")[0].tokens == 2
    with pytest.raises(InvalidConfigError, match="has no field 'body'"):
        read_lengths(data, field="body")


def test_suggest_plans_for_the_longest_sample_of_the_data(cli, tmp_path):
    """The request's sequence length is the data's longest row: padded, the longest sample (3,000
    tokens); packed, the row length (--seq-len, or the default 2,048)."""
    data = _jsonl(tmp_path / "d.jsonl", [{"input_ids": list(range(n))} for n in (100, 3000, 250, 700)])
    padded = cli("suggest", "-m", "meta-llama/Llama-2-7b-hf", "-g", "a10g", "-b", "8", "--dataset", data,
                 "--no-packing", "--no-save", "--json")
    assert padded.code == 0, padded
    assert json.loads(padded.out)["request"]["seq_len"] == 3000
    assert "longest 3,000; padded to the longest sample of a batch: planning for 3,000 tokens" in padded.err
    packed = cli("suggest", "-m", "meta-llama/Llama-2-7b-hf", "-g", "a10g", "-b", "8", "--dataset", data,
                 "--seq-len", "1024", "--no-save", "--json")
    assert json.loads(packed.out)["request"]["seq_len"] == 1024
    assert "packed into rows of 1,024 tokens; an epoch is 1 optimizer step, 4,050 tokens" in packed.err


def test_suggest_with_a_dataset_name_plans_for_the_seq_len_and_says_why(cli, tmp_path):
    named = cli("suggest", "-m", "meta-llama/Llama-2-7b-hf", "-g", "a10g", "-b", "8", "--dataset", "org/no-such-local",
                "--seq-len", "512", "--no-save", "--json")
    assert named.code == 0, named
    assert json.loads(named.out)["request"]["seq_len"] == 512
    assert "no local file" in named.err


def test_tokenizer_without_a_dataset_is_one_line(cli):
    r = cli("suggest", "-m", "meta-llama/Llama-2-7b-hf", "-g", "a10g", "-b", "8", "--tokenizer", "t.json", "--no-save")
    assert r.code == 2 and r.err.startswith("error: --tokenizer and --dataset-field read the data of --dataset"), r
