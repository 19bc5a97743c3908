"""Real training runs that measure what a configuration uses.

``measure`` trains a configuration for a few optimizer steps in a fresh process and returns a
``planner.results.Measurement``; ``run_in_process`` is the same run in the current process
(leaving ``os.environ``'s rendezvous variables as it found them).
The measurement convention is in ``workers.train``, the probes in ``workers.probes``, the
generated DeepSpeed config in ``workers.deepspeed_config``. Importing this package does not
import torch.
"""

from __future__ import annotations

from workers.runner import measure, measure_with_details, run_in_process

__all__ = ["measure", "measure_with_details", "run_in_process"]
