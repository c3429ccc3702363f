"""The sampled tokens in flight between two overlapped steps (worker/in_flight.py):
the next step's inputs get them on the device, the host arrays get them once they
arrive, and a row whose request left meanwhile is not written."""

from __future__ import annotations

import numpy as np
import torch

from asyncllm.worker.in_flight import InFlightTokens
from asyncllm.worker.input_batch import InputBatch


def test_tokens_reach_next_inputs_and_host_rows():
    ib = InputBatch(max_num_seqs=4, max_model_len=16, max_blocks_per_req=4)
    flight = InFlightTokens(4, torch.device("cpu"))
    rows = np.array([0, 2, 3])
    positions = np.array([5, 7, 2])
    resolve = flight.put(torch.tensor([11, 22, 33]), None, rows, positions, [100, 102, 103])

    # next step: rows 2 and 0 decode their in-flight token; row 1 prefills
    tok_rows = np.array([2, 0, 1, 1])
    pos = np.array([7, 5, 0, 1])
    ids = torch.tensor([-1, -1, 40, 41])
    flight.feed(ids, tok_rows, pos)
    assert ids.tolist() == [22, 11, 40, 41]

    flight.drop(3)  # row 3's request left: its row may hold another one now
    ib.token_ids[3, 2] = 77
    flight.settle(ib)
    assert ib.token_ids[0, 5] == 11 and ib.token_ids[2, 7] == 22
    assert ib.token_ids[3, 2] == 77
    assert resolve() == {100: 11, 102: 22, 103: 33}

    # settled: nothing in flight, the next step's inputs are left alone
    ids = torch.tensor([-1, -1])
    flight.feed(ids, np.array([0, 2]), np.array([5, 7]))
    assert ids.tolist() == [-1, -1]


def test_rows_without_a_finite_maximum_are_logged_on_resolve(caplog):
    flight = InFlightTokens(2, torch.device("cpu"))
    resolve = flight.put(
        torch.tensor([3, 4]),
        torch.tensor([False, True]),
        np.array([0, 1]),
        np.array([1, 1]),
        [7, 8],
    )
    with caplog.at_level("WARNING"):
        assert resolve() == {7: 3, 8: 4}
    assert "rows [1] have no finite maximum" in caplog.text
