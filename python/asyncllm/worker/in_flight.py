"""The tokens a step sampled, kept on the device until the host needs them.

With overlap scheduling the runner prepares step N+1 while the device still runs
step N. Step N+1's inputs include the tokens step N samples, so instead of waiting
for them to reach host memory, the runner scatters them from the device tensor
into N+1's input ids (one indexed copy on the device) and lets their copy to the
host finish in the background: the busy loop waits for it only when it applies
step N's outputs, and the runner only after N+1's forward is queued, before
anything on the host reads the token (penalties, prompt logprobs). On the CPU
the "copy" is the tensor itself and every wait returns at once; the logic is the
same, so the test suite covers it on any machine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from asyncllm.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)


class _HostCopy:
    """One step's sampled tokens (and rows with no finite logit) on their way to
    host memory; `wait` blocks until they are there."""

    def __init__(self, sampled: torch.Tensor, nonfinite: torch.Tensor | None) -> None:
        self.device_tokens = sampled
        if sampled.device.type == "cpu":
            self._event = None
            self.tokens = sampled
            self.nonfinite = nonfinite
            return
        pin = torch.cuda.is_available()
        self.tokens = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=pin)
        self.tokens.copy_(sampled, non_blocking=True)
        self.nonfinite = None
        if nonfinite is not None:
            self.nonfinite = torch.empty(nonfinite.shape, dtype=torch.bool, pin_memory=pin)
            self.nonfinite.copy_(nonfinite, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def wait(self) -> np.ndarray:
        if self._event is not None:
            self._event.synchronize()
        return self.tokens.numpy()


class InFlightTokens:
    """Per row of the `InputBatch`: the position of its token still in flight
    (-1: none) and that token's index in the last step's sampled tensor."""

    def __init__(self, max_num_seqs: int, device: torch.device) -> None:
        self.device = device
        self.pos = np.full(max_num_seqs, -1, dtype=np.int64)
        self.src = np.zeros(max_num_seqs, dtype=np.int64)
        self._copy: _HostCopy | None = None
        self._rows = np.zeros(0, dtype=np.int64)
        self._positions = np.zeros(0, dtype=np.int64)

    def put(
        self,
        sampled: torch.Tensor,
        nonfinite: torch.Tensor | None,
        rows: np.ndarray,
        positions: np.ndarray,
        req_ids: list[int],
    ) -> Callable[[], dict[int, int]]:
        """Record a step's sampled tokens (row `rows[i]` got `sampled[i]` at
        `positions[i]`) and start their copy to the host; returns the call that
        waits for it and gives {request id: token}."""
        copy = _HostCopy(sampled, nonfinite)
        self._copy, self._rows, self._positions = copy, rows, positions
        self.pos[rows] = positions
        self.src[rows] = np.arange(len(rows))

        def resolve() -> dict[int, int]:
            tokens = copy.wait()
            if copy.nonfinite is not None and copy.nonfinite.any():
                logger.warning(
                    "logits of sampled rows %s have no finite maximum (NaN or inf): "
                    "each sampled its argmax",
                    copy.nonfinite.nonzero().flatten().tolist(),
                )
            return dict(zip(req_ids, tokens.tolist(), strict=True))

        return resolve

    def drop(self, row: int) -> None:
        """The row's request left the batch: its token in flight goes nowhere."""
        self.pos[row] = -1

    def feed(self, input_ids: torch.Tensor, tok_rows: np.ndarray, pos: np.ndarray) -> None:
        """Overwrite the entries of this step's `input_ids` (device) that are a
        token still in flight with that token, on the device."""
        if self._copy is None:
            return
        hit = self.pos[tok_rows] == pos
        if not hit.any():
            return
        dst = np.flatnonzero(hit)
        src = self.src[tok_rows[dst]]
        input_ids[torch.from_numpy(dst).to(self.device)] = self._copy.device_tokens[
            torch.from_numpy(src).to(self.device)
        ]

    def settle(self, ib: InputBatch) -> None:
        """Wait for the tokens in flight and write them into the batch's host
        arrays, for the rows that still hold their request."""
        copy = self._copy
        if copy is None:
            return
        tokens = copy.wait()
        rows, positions = self._rows, self._positions
        keep = self.pos[rows] == positions
        ib.token_ids[rows[keep], positions[keep]] = tokens[keep]
        self.pos[rows] = -1
        self._copy = None
