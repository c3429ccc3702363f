"""The wire's request schema is declared once (`engine/wire_schema.py`): the files
generated from it are current, and a request survives the trip through them."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

from asyncllm import _core
from asyncllm.engine import wire_schema
from asyncllm.engine.wire import from_wire, to_wire
from asyncllm.messages import EngineCoreRequest
from asyncllm.sampling_params import SamplingParams
from asyncllm.structured_output.params import StructuredOutputsParams

ROOT = Path(__file__).resolve().parent.parent


def test_generated_files_are_current() -> None:
    """CI fails here when the table changed and `python tools/gen_wire.py` was not rerun
    (or a generated file was edited by hand)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_wire.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr


def test_the_build_speaks_the_tables_version() -> None:
    assert _core.wire_version() == wire_schema.WIRE_VERSION


def test_every_field_has_a_known_kind_and_a_distinct_name() -> None:
    names = [f.name for f in wire_schema.ADD_REQUEST]
    assert len(names) == len(set(names))
    assert all(f.kind in wire_schema.KINDS for f in wire_schema.ADD_REQUEST)
    params = {f.name for f in dataclasses.fields(SamplingParams) if f.init}
    assert [f.name for f in wire_schema.ADD_REQUEST if f.param and f.name not in params] == []


def test_every_param_field_survives_the_wire() -> None:
    p = SamplingParams(
        max_tokens=40,
        min_tokens=3,
        temperature=0.5,
        top_p=0.75,
        top_k=7,
        min_p=0.125,
        seed=2**64 - 1,
        stop_token_ids=[2, 9],
        ignore_eos=True,
        logprobs=3,
        prompt_logprobs=1,
        repetition_penalty=1.25,
        frequency_penalty=-0.5,
        presence_penalty=1.5,
        cache_salt="s",
        structured_outputs=StructuredOutputsParams(choice=["a", "b"]),
        logit_bias={5: 100.0, 3: -2.5},
        allowed_token_ids=[3, 5, 8],
        bad_words_token_ids=[[4], [6, 7]],
    )
    req = EngineCoreRequest(7, [1, 2, 3], p, arrival_time=12.5, priority=-2)
    frame = _core.encode_add_requests([to_wire(req, max_model_len=100)])
    _, [decoded] = _core.decode_message(frame)
    back = from_wire(decoded)
    assert (back.request_id, back.prompt_token_ids) == (7, [1, 2, 3])
    assert (back.arrival_time, back.priority) == (12.5, -2)
    for f in wire_schema.ADD_REQUEST:
        if f.param:
            got, want = getattr(back.sampling_params, f.name), getattr(p, f.name)
            assert got == want, f.name
