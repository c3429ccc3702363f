"""Stub of the native module `asyncllm._core` (checked against the build by
`tests/test_native_stub.py`)."""

def native_version() -> str:
    """Version of the native module; equals `asyncllm.__version__`."""

def wire_version() -> int:
    """Version byte of the wire schema this build speaks."""

class WireError(ValueError):
    """A frame could not be decoded or a message could not be encoded."""

class DetokenizerError(ValueError):
    """The detokenizer was given something it cannot work with."""

# --- codec (rust/py/codec.rs) ---

# --- detokenizer (rust/py/detok.rs) ---

import collections.abc as _abc  # noqa: E402
import os  # noqa: E402
import typing as _typing  # noqa: E402

_StepResult = tuple[str, int | None, int, int]
"""Per request of a `Detokenizer.step`: `(text, stop_index, num_kept, num_tokens_released)`.

- `text`: the newly released text.
- `stop_index`: index into the request's `stop` list of the stop string that matched
  in this step, else None. After a match the request is stopped: later steps
  release nothing and keep no tokens; call `remove` (or `step(..., finished)`).
- `num_kept`: how many of this step's new token ids belong to the output: all of
  them, or after a match those up to and including the token that completed it.
- `num_tokens_released`: output tokens, counted from the first, whose text has
  been released in full; all kept tokens once stopped or finished.
"""

@_typing.final
class Detokenizer:
    """Batched incremental detokenizer with stop strings for one tokenizer.

    Holds per-request state keyed by an integer id. The text released over a
    request equals `D(prompt + output)` past its longest common prefix with
    `D(prompt)`, where `D` is `tokenizers`' `decode(ids, skip_special_tokens)`
    (with `spaces_between_special_tokens=False`: each run of non-added tokens
    decoded apart and added tokens' contents glued in); with stop strings, that
    text cut at the earliest-ending match. Released text is never retracted:
    incomplete UTF-8 and, while streaming, the longest suffix that may begin a
    stop string are held back until decided. The work runs with the GIL
    released. Raises `DetokenizerError` for tokenizers whose decoder can't be
    streamed exactly (`BPEDecoder`, `CTC`).
    """

    def __new__(cls, path: str | os.PathLike[str]) -> Detokenizer:
        """Loads the `tokenizer.json` at `path`."""

    @staticmethod
    def from_json(json: str) -> Detokenizer:
        """Builds a detokenizer from the text of a `tokenizer.json`."""

    def add_request(
        self,
        request_id: int,
        prompt_token_ids: _abc.Iterable[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: _abc.Sequence[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        """Adds a request, seeded from its prompt so the output continues it
        (first-token spacing, a character the prompt left unfinished). Stop
        strings only match text ending in the `min_tokens`-th output token or
        later. Raises `DetokenizerError` if the id is taken or a stop string is
        empty."""

    def remove(self, request_id: int) -> bool:
        """Drops a request's state; False if it had none."""

    def step(
        self,
        request_ids: _abc.Sequence[int],
        new_token_ids: _abc.Iterable[_abc.Iterable[int]],
        finished: _abc.Sequence[bool] | None = None,
    ) -> list[_StepResult]:
        """Advances each request by its new token ids (one engine step) and
        returns a `_StepResult` per request, in order. `finished[i]` true means
        request i ended for another reason (EOS, length, abort) with this step:
        its held-back text is released as the full decode ends it, and its state
        dropped. Raises `DetokenizerError`, changing nothing, if an id is
        unknown or repeated or the arguments differ in length."""

    def finish(self, request_id: int) -> _StepResult:
        """`step([request_id], [[]], [True])[0]`: releases what the request
        holds back and drops it."""

    @property
    def num_requests(self) -> int:
        """Number of requests with state."""

    def __len__(self) -> int: ...
    def __contains__(self, request_id: int, /) -> bool: ...
