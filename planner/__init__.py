"""OOM Planner: the fastest way to fine-tune a model on a GPU without running out of memory.

Importing ``planner`` loads nothing heavy: torch, transformers, deepspeed, ray and alembic are
imported inside the functions that need them.
"""

__version__ = "0.1.0"
