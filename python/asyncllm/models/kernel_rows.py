"""The row count a step's linear layers choose their kernel by.

Each linear layer picks its kernel by the rows of the step (`linear_kernels`,
`gguf.layers`), and kernels differ in float rounding. A speculative verification
step stands for the decode steps it replaces: its requests bring k+1 rows each, so
by row count it would take another kernel than those decode steps, and a request's
tokens would then depend on whether speculation is on (issue 29: 16 GGUF streams
kept only 25-68 % of their tokens). The runner therefore sets, for a step whose
rows are all decodes and their drafts, the row count of the decode step it stands
for; every kernel computes a row the same way whatever rows run beside it, so each
row then gets the bits its decode step would have given.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

# 0: each layer goes by its own input's rows (every step but a verification).
rows = 0


@contextmanager
def choose_by(num_rows: int) -> Iterator[None]:
    """Within, linear layers choose their kernel as for a step of `num_rows` rows."""
    global rows
    rows = num_rows
    try:
        yield
    finally:
        rows = 0
