"""The user's own data: its token lengths, and the longest batch a collation builds from them.

A plan is only as safe as its longest batch. With padding to the longest sample of a batch
(transformers' ``DataCollatorWithPadding`` / ``DataCollatorForSeq2Seq``, TRL's collator with
``packing=False``), the peak comes from the batch that holds the longest sample: every row of it
is padded to that sample's length. With packing (TRL ``packing=True``), every row is the packed
length. ``group_by_length`` changes which samples share a batch (less padding, faster), not the
longest batch. So the memory model needs one number, the length of the longest row, and the time
model the tokens of an epoch.

The reader streams: it keeps a count of samples per length, never the text, and
a file larger than ``PROGRESS_BYTES`` shows a progress bar on stderr. Formats: JSON lines (one
object per line with ``input_ids``, ``text``, or chat ``messages``/``conversations``), plain text
(one sample per line, as ``datasets``' text builder reads it), Parquet (one column), and a folder
written by ``datasets.Dataset.save_to_disk``. Tokenizers are read from local files only: a
``tokenizer.json`` (the ``tokenizers`` library), a folder with one, or the model's own beside its
config.json (a local folder or the local Hugging Face cache). Without one, tokens are estimated
from bytes (``BYTES_PER_TOKEN``), and the answer says so.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from planner.errors import InvalidConfigError, MissingDependencyError

#: Bytes of UTF-8 text per token when no tokenizer is at hand: "one token generally corresponds to
#: ~4 characters of text for common English text" (OpenAI, "What are tokens and how to count
#: them", help.openai.com); Llama-2's and Llama-3's BPE tokenizers are within 10-20% of it on
#: English prose, and far off on code or other scripts: the answer says it is an estimate.
BYTES_PER_TOKEN = 4

#: Files at least this large show a progress bar (reading 1 GB of JSON lines takes a while).
PROGRESS_BYTES = 64 << 20

#: Samples tokenized per call (``Tokenizer.encode_batch`` runs them on its thread pool).
ENCODE_BATCH = 1024

#: The keys of a chat sample, as TRL's SFT datasets have them ("conversational" format).
CHAT_KEYS = ("messages", "conversations")


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenLengths:
    """The token lengths of a dataset's samples, summarised."""

    samples: int
    tokens: int
    p50: int
    p99: int
    longest: int
    counted_by: str
    """How the lengths were counted: "input_ids", "tokenizer <path>" or the byte estimate."""
    estimated: bool
    """True when no tokenizer counted them (``BYTES_PER_TOKEN``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchPlan:
    """What a collation makes of the lengths, for a global batch of ``target_batch`` sequences."""

    seq_len: int
    """The length of the longest row a batch can have: what the memory model plans for."""
    packing: bool
    truncated: int
    """Samples longer than ``seq_len`` (cut by the trainer's max length; with packing, split)."""
    steps_per_epoch: int
    tokens_per_epoch: int
    """Tokens the model trains on in an epoch (padding excluded)."""
    padded_tokens_worst: int
    """Rows x row length of an epoch if every batch were padded to the longest sample (the bound
    ``group_by_length`` approaches from below); equals ``tokens_per_epoch`` with packing."""

    def describe(self, lengths: TokenLengths) -> str:
        how = (f"packed into rows of {self.seq_len:,} tokens" if self.packing
               else f"padded to the longest sample of a batch: planning for {self.seq_len:,} tokens")
        cut = f"; {self.truncated:,} samples longer than {self.seq_len:,} are cut" if self.truncated and not self.packing else ""
        counted = (f"estimated at {BYTES_PER_TOKEN} bytes per token (no tokenizer: give --tokenizer PATH for exact lengths)"
                   if lengths.estimated else f"counted with {lengths.counted_by}")
        return (f"dataset: {lengths.samples:,} sample{'s' if lengths.samples != 1 else ''}, {lengths.tokens:,} "
                f"token{'s' if lengths.tokens != 1 else ''} ({counted}); length p50 {lengths.p50:,}, "
                f"p99 {lengths.p99:,}, longest {lengths.longest:,}; {how}{cut}; an epoch is "
                f"{self.steps_per_epoch:,} optimizer step{'s' if self.steps_per_epoch != 1 else ''}, "
                f"{self.tokens_per_epoch:,} tokens")


def plan_batches(lengths: TokenLengths, *, target_batch: int, packing: bool, seq_len: int | None,
                 model_max: int, histogram: dict[int, int] | None = None) -> BatchPlan:
    """The longest row and an epoch's size under packing or padding. ``seq_len``: the trainer's
    max length (TRL ``max_length``; the packed length with packing); None: the longest sample
    without packing, min(DEFAULT_SEQ_LEN, the model's maximum) with packing, as ``planner suggest`` defaults.
    ``histogram``: samples by length (``read_lengths``), to count what truncation cuts."""
    if target_batch < 1:
        raise InvalidConfigError(f"--target-batch must be a whole number >= 1, got {target_batch!r}")
    from planner.estimation import DEFAULT_SEQ_LEN  # (suggest's default length, said once there)

    cap = min(seq_len or model_max, model_max)
    if packing:
        row = min(seq_len or DEFAULT_SEQ_LEN, model_max)
        rows = math.ceil(lengths.tokens / row)
        return BatchPlan(seq_len=row, packing=True, truncated=0, steps_per_epoch=math.ceil(rows / target_batch),
                         tokens_per_epoch=lengths.tokens, padded_tokens_worst=lengths.tokens)
    row = min(lengths.longest, cap)
    kept = lengths.tokens
    truncated = 0
    if lengths.longest > row:
        assert histogram is not None, "the lengths are needed to count what truncation cuts"
        over = {n: k for n, k in histogram.items() if n > row}
        truncated = sum(over.values())
        kept -= sum(n * k for n, k in over.items()) - row * truncated
    return BatchPlan(seq_len=row, packing=False, truncated=truncated,
                     steps_per_epoch=math.ceil(lengths.samples / target_batch), tokens_per_epoch=kept,
                     padded_tokens_worst=lengths.samples * row)


# ---- reading ---------------------------------------------------------------------------------------
class _Counter:
    """Token counts of samples that are token ids (their length) or text (a tokenizer's count, or
    the byte estimate), remembering which of the two it saw."""

    def __init__(self, tokenizer: str | os.PathLike | None, label: str | None = None) -> None:
        self.encode, self.tokenizer = _encoder(tokenizer, label)
        self.saw_ids = self.saw_text = False

    def lengths(self, batch: list) -> list[int]:
        texts = [s for s in batch if isinstance(s, str)]
        if len(texts) < len(batch):
            self.saw_ids = True
        if not texts:
            return [len(s) for s in batch]
        self.saw_text = True
        if self.encode is not None:
            counted = iter(self.encode(texts))
        else:
            counted = iter(math.ceil(len(t.encode("utf-8")) / BYTES_PER_TOKEN) for t in texts)
        return [next(counted) if isinstance(s, str) else len(s) for s in batch]

    def counted_by(self) -> str:
        parts = (["input_ids"] if self.saw_ids else []) + (
            [f"the tokenizer {self.tokenizer}" if self.encode is not None else "the byte estimate"] if self.saw_text else [])
        return " and ".join(parts)


def read_lengths(path: str | os.PathLike, *, tokenizer: str | os.PathLike | None = None, field: str | None = None,
                 progress: Callable[[int, int], None] | None = None,
                 tokenizer_label: str | None = None) -> tuple[TokenLengths, dict[int, int]]:
    """(summary, samples by length) of the dataset at ``path``: memory grows with the number of
    distinct lengths, not of samples. ``tokenizer``: a tokenizer.json
    or a folder holding one; ``field``: the text or token column (default: ``input_ids``, then
    ``text``, then chat messages). ``progress(done_bytes, total_bytes)`` is called as it reads.
    ``tokenizer_label``: how an error names the tokenizer (default ``--tokenizer PATH``)."""
    source = Path(path).expanduser()
    if not source.exists():
        raise InvalidConfigError(f"--dataset {path}: no such file or folder: give a .jsonl, .txt or .parquet file "
                                 "or a folder saved with datasets' save_to_disk")
    counter = _Counter(tokenizer, tokenizer_label)
    histogram: Counter[int] = Counter()
    for batch, done, total in _batches(source, field):
        histogram.update(counter.lengths(batch))
        if progress is not None:
            progress(done, total)
    samples = sum(histogram.values())
    if not samples:
        raise InvalidConfigError(f"--dataset {path}: holds no samples: give a file with at least one sample")
    if not any(histogram.keys() - {0}):  # padded to its longest, the batch would be 0 tokens long
        raise InvalidConfigError(f"--dataset {path}: its {samples:,} sample{'s hold' if samples != 1 else ' holds'} no "
                                 "tokens (empty text, or chat turns without content): check the file, or name the "
                                 "text or token column with --dataset-field")
    summary = TokenLengths(samples=samples, tokens=sum(n * k for n, k in histogram.items()),
                           p50=_quantile(histogram, samples, 0.50), p99=_quantile(histogram, samples, 0.99),
                           longest=max(histogram), counted_by=counter.counted_by(),
                           estimated=counter.saw_text and counter.encode is None)
    return summary, dict(histogram)


def _quantile(histogram: dict[int, int], samples: int, q: float) -> int:
    """The nearest-rank quantile: the smallest length that at least a share ``q`` of samples do not exceed."""
    rank, seen = max(math.ceil(q * samples), 1), 0
    for length in sorted(histogram):
        seen += histogram[length]
        if seen >= rank:
            return length
    raise AssertionError("rank beyond the samples")


def _encoder(tokenizer: str | os.PathLike | None, label: str | None = None):
    """(encode(texts) -> token counts, the tokenizer's path) or (None, None) without one.
    ``label``: how an error names it (default ``--tokenizer PATH``, the user's option)."""
    if tokenizer is None:
        return None, None
    label = label or f"--tokenizer {tokenizer}"
    path = Path(tokenizer).expanduser()
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise InvalidConfigError(f"{label}: no tokenizer.json there: give a tokenizer.json file or "
                                 "the model folder that holds one")
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - transformers depends on it
        raise MissingDependencyError("reading a tokenizer needs the tokenizers package: pip install tokenizers") from None
    try:
        loaded = Tokenizer.from_file(str(file))
    except Exception as exc:  # the library's own parse errors: one line, not its traceback
        fix = (": give the model's own tokenizer.json (from its Hub folder)" if label.startswith("--tokenizer")
               else ": give --tokenizer PATH of a good one, or move it away")
        raise InvalidConfigError(f"{label}: not a tokenizer.json the tokenizers library reads "
                                 f"({str(exc).splitlines()[0][:120]}){fix}") from None

    def encode(texts: list[str]) -> list[int]:
        # special tokens (BOS/EOS) as the trainer's tokenizer call adds them (add_special_tokens=True)
        return [len(e.ids) for e in loaded.encode_batch(texts, add_special_tokens=True)]

    return encode, str(file)


def model_tokenizer(config_path: str | os.PathLike | None) -> Path | None:
    """The tokenizer.json beside a model's config.json (a local folder or a snapshot of the local
    Hugging Face cache), or None."""
    if config_path is None:
        return None
    candidate = Path(config_path).expanduser().parent / "tokenizer.json"
    return candidate if candidate.is_file() else None


def _sample(record: dict, field: str | None, where: str):
    """A record's token ids (a list) or its text (a str)."""
    if field is not None:
        if field not in record:
            raise InvalidConfigError(f"{where}: has no field {field!r} (it has {', '.join(sorted(record))[:200]}): "
                                     "name the text or token column with --dataset-field")
        value = record[field]
    elif "input_ids" in record:
        value = record["input_ids"]
    elif "text" in record:
        value = record["text"]
    elif any(k in record for k in CHAT_KEYS):
        turns = next(record[k] for k in CHAT_KEYS if k in record)
        # the chat template adds a few tokens per turn; the turns' text is what the data holds
        value = "\n".join(str(t.get("content") or t.get("value") or "") for t in turns if isinstance(t, dict))
    else:
        raise InvalidConfigError(f"{where}: no input_ids, text or messages field (it has "
                                 f"{', '.join(sorted(record))[:200]}): name the column with --dataset-field")
    if isinstance(value, str) or (isinstance(value, list) and all(type(i) is int for i in value[:8])):
        return value
    name = field or ("input_ids" if "input_ids" in record else "text")
    raise InvalidConfigError(f"{where}: field {name!r} is neither text nor a list of token ids (got "
                             f"{type(value).__name__}): give text or a list of integers there, or name another "
                             "column with --dataset-field")


def _batches(source: Path, field: str | None) -> Iterator[tuple[list, int, int]]:
    """(samples, bytes read so far, bytes in all) in batches of ENCODE_BATCH."""
    if source.is_dir():
        yield from _saved_dataset(source, field)
        return
    suffix = source.suffix.lower()
    if suffix == ".parquet":
        yield from _parquet(source, field)
    elif suffix in (".jsonl", ".json", ".ndjson"):
        yield from _lines(source, lambda line, n: _sample(_json(line, source, n), field, f"{source}:{n}"))
    elif suffix == ".txt":
        yield from _lines(source, lambda line, n: line.rstrip("\r\n"))
    else:
        raise InvalidConfigError(f"--dataset {source}: unknown format {suffix or '(no suffix)'}: give a .jsonl, .txt "
                                 "or .parquet file or a folder saved with datasets' save_to_disk")


def _json(line: str, source: Path, n: int) -> dict:
    try:
        record = json.loads(line)
    except ValueError:
        raise InvalidConfigError(f"--dataset {source}: line {n} is not JSON: give one JSON object per line") from None
    if not isinstance(record, dict):
        raise InvalidConfigError(f"--dataset {source}: line {n} is not a JSON object: give one object per line")
    return record


def _lines(source: Path, sample) -> Iterator[tuple[list, int, int]]:
    """One sample per non-empty line, read in binary so the byte count is exact."""
    total = source.stat().st_size
    done, batch = 0, []
    with source.open("rb") as f:
        for n, raw in enumerate(f, 1):
            done += len(raw)
            line = raw.decode("utf-8-sig" if n == 1 else "utf-8", errors="replace")  # (a BOM: Windows editors' UTF-8)
            if not line.strip():
                continue
            batch.append(sample(line, n))
            if len(batch) == ENCODE_BATCH:
                yield batch, done, total
                batch = []
    if batch:
        yield batch, done, total


def _parquet(source: Path, field: str | None) -> Iterator[tuple[list, int, int]]:
    import pyarrow.parquet as pq  # lazy: only Parquet needs it

    try:
        file = pq.ParquetFile(source)
    except Exception as exc:
        raise InvalidConfigError(f"--dataset {source}: not a Parquet file pyarrow reads ({str(exc).splitlines()[0][:120]})") from None
    names = file.schema_arrow.names
    column = field or next((c for c in ("input_ids", "text", *CHAT_KEYS) if c in names), None)
    if column not in names:
        raise InvalidConfigError(f"--dataset {source}: no column {column or 'input_ids, text or messages'} (it has "
                                 f"{', '.join(names)[:200]}): name the column with --dataset-field")
    total, done = file.metadata.num_rows, 0
    for part in file.iter_batches(batch_size=ENCODE_BATCH, columns=[column]):
        rows = part.column(0).to_pylist()
        done += len(rows)
        yield [_sample({column: r}, column, f"{source}") for r in rows], done, total


def _saved_dataset(source: Path, field: str | None) -> Iterator[tuple[list, int, int]]:
    """A folder written by ``datasets.Dataset.save_to_disk`` (its Arrow files, read in batches)."""
    if not (source / "dataset_info.json").is_file() and not (source / "state.json").is_file():
        raise InvalidConfigError(f"--dataset {source}: a folder, but not one saved with datasets' save_to_disk "
                                 "(no state.json): give the data file itself")
    try:
        from datasets import load_from_disk
    except ImportError:
        raise MissingDependencyError("reading a saved dataset needs the datasets package: pip install datasets") from None
    data = load_from_disk(str(source))
    if hasattr(data, "keys"):  # a DatasetDict: the training split
        data = data["train"] if "train" in data else next(iter(data.values()))
    column = field or next((c for c in ("input_ids", "text", *CHAT_KEYS) if c in data.column_names), None)
    if column not in data.column_names:
        raise InvalidConfigError(f"--dataset {source}: no column {column or 'input_ids, text or messages'} (it has "
                                 f"{', '.join(data.column_names)[:200]}): name the column with --dataset-field")
    total = len(data)
    for start in range(0, total, ENCODE_BATCH):
        rows = data[start:start + ENCODE_BATCH][column]
        yield [_sample({column: r}, column, f"{source}") for r in rows], min(start + ENCODE_BATCH, total), total


#: what only a local file is called: a datasets name is "owner/name" (tatsu-lab/alpaca), which
#: ends in no data file's suffix and starts with no path's prefix
_LOCAL_SUFFIXES = (".jsonl", ".json", ".ndjson", ".txt", ".parquet", ".csv", ".arrow")
_LOCAL_PREFIXES = ("/", "./", "../", "~", ".\\", "..\\")


def _names_a_local_file(dataset: str) -> bool:
    return dataset.lower().endswith(_LOCAL_SUFFIXES) or dataset.startswith(_LOCAL_PREFIXES)


def is_datasets_name(dataset: str) -> bool:
    """True for what only train.py loads (a datasets name): no local file or folder by that name,
    and not named like one."""
    return not Path(dataset).expanduser().exists() and not _names_a_local_file(dataset)


@dataclass(frozen=True, slots=True, kw_only=True)
class DataPlan:
    """What ``--dataset`` decided: the lengths read and the batch planned from them."""

    lengths: TokenLengths
    batches: BatchPlan

    def describe(self) -> str:
        return self.batches.describe(self.lengths)


def plan_for_data(dataset: str, *, config_source: str, model_max: int, target_batch: int, packing: bool,
                  seq_len: int | None, tokenizer: str | None = None, field: str | None = None,
                  progress: Callable[[int, int], None] | None = None) -> DataPlan | None:
    """The longest batch of the data at ``dataset`` (``plan_batches``), or None when ``dataset`` is
    no local file or folder (a datasets name that only the emitted train.py loads). ``tokenizer``:
    given, else the model's own beside its config.json (``config_source``), else the byte estimate."""
    if not Path(dataset).expanduser().exists():
        if not _names_a_local_file(dataset):  # a datasets name (``is_datasets_name``): train.py's alone
            return None
        # a typo, not a datasets name: planning for --seq-len would hide it
        raise InvalidConfigError(f"--dataset {dataset}: no such file or folder: check the path (a .jsonl, .txt "
                                 "or .parquet file, or a folder saved with datasets' save_to_disk)")
    label = None
    if tokenizer is None:
        found = model_tokenizer(config_source) if config_source else None
        tokenizer = str(found) if found is not None else None
        label = f"the model's tokenizer {found}" if found is not None else None
    lengths, histogram = read_lengths(dataset, tokenizer=tokenizer, field=field, progress=progress,
                                      tokenizer_label=label)
    return DataPlan(lengths=lengths, batches=plan_batches(lengths, target_batch=target_batch, packing=packing,
                                                          seq_len=seq_len, model_max=model_max, histogram=histogram))


__all__ = ["BYTES_PER_TOKEN", "BatchPlan", "DataPlan", "TokenLengths", "is_datasets_name", "model_tokenizer", "plan_batches",
           "plan_for_data", "read_lengths"]
