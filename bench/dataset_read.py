"""Reading a large dataset's token lengths: time and peak memory (issue 25, item 2).

    python bench/dataset_read.py [--gb 1.0] [--tokenizer PATH]

Writes a JSON-lines file of about ``--gb`` GB of text samples (lengths drawn from a fixed seed,
1-8,000 words) to a temporary folder, reads it with ``planner.dataset.read_lengths`` and prints
the samples, tokens, seconds, MB/s and the process's peak resident memory before and after the
read: the reader keeps a count per length, so the peak must not grow with the file. Speed and
memory are reported, not asserted.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def write(path: Path, gb: float) -> int:
    rng = random.Random(0)
    words = ["lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit"]
    target, written = int(gb * (1 << 30)), 0
    with path.open("w") as f:
        while written < target:
            n = rng.randint(1, 8000)
            line = json.dumps({"text": " ".join(rng.choice(words) for _ in range(n))}) + "\n"
            f.write(line)
            written += len(line)
    return written


def main() -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--gb", type=float, default=1.0)
    args.add_argument("--tokenizer", default=None)
    opts = args.parse_args()
    from planner.dataset import read_lengths

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.jsonl"
        size = write(path, opts.gb)
        before = _peak_mb()
        start = time.perf_counter()
        lengths, histogram = read_lengths(path, tokenizer=opts.tokenizer)
        seconds = time.perf_counter() - start
        print(f"{size / 1e9:.2f} GB, {lengths.samples:,} samples, {lengths.tokens:,} tokens ({lengths.counted_by}), "
              f"longest {lengths.longest:,}; {len(histogram):,} distinct lengths")
        print(f"read in {seconds:.1f} s ({size / 1e6 / seconds:.0f} MB/s); peak RSS {before:.0f} MB before the read, "
              f"{_peak_mb():.0f} MB after")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
