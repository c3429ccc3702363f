"""Faults injected into the engine core's threads, from outside the product code.

Its own module, importing only the core and its messages: a core process imports it
through `sitecustomize` at start, and importing the test module instead (transformers,
torch) would add seconds to every such start.
"""

from __future__ import annotations

from asyncllm.engine.core import EngineCore
from asyncllm.messages import StepOutputs

POISON = 999  # a prompt holding this token id triggers the injected fault


class Panic(BaseException):
    """Stands in for pyo3_runtime.PanicException: a BaseException, not an Exception."""


def install_fault(thread: str) -> None:
    """Make the core's `thread` raise Panic once a POISON prompt reaches it. Runs
    in the test (in-thread mode) or in the child via sitecustomize."""
    poisoned: set[int] = set()
    make_request, add_request = EngineCore.make_request, EngineCore.add_request
    encode = StepOutputs.encode

    def make_request_(self, req):  # runs on the input thread
        if thread == "input" and POISON in req.prompt_token_ids:
            raise Panic("input fault")
        return make_request(self, req)

    def add_request_(self, request):  # runs on the busy loop
        if POISON in request.prompt_token_ids:
            if thread == "busy":
                raise Panic("busy fault")
            poisoned.add(request.request_id)
        return add_request(self, request)

    def encode_(self):  # runs on the output thread
        if thread == "output" and poisoned.intersection(self.req_ids):
            raise Panic("output fault")
        return encode(self)

    EngineCore.make_request = make_request_
    EngineCore.add_request = add_request_
    StepOutputs.encode = encode_


SITECUSTOMIZE = """
import os
if os.environ.get("FAULT_THREAD"):
    import sys
    sys.path.insert(0, {tests!r})
    from fault_injection import install_fault
    install_fault(os.environ["FAULT_THREAD"])
"""
