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
# Frames are `[message type: u8][wire version: u8][msgpack body]`; the layouts are
# documented in rust/protocol/mod.rs. Every encoder and `decode_message` release
# the GIL for the byte work; only extracting arguments and wrapping results hold it.
# Every problem with a frame or with an encoder's arguments raises `WireError`,
# whose message names the field (e.g. "AddRequests[3].prompt_token_ids").

# Imports here, not at the top, so that this section stays self-contained.
from collections.abc import Iterable, Sequence  # noqa: E402
from typing import Any, Final, Literal, Self, final  # noqa: E402

# Integer sequences: a list or tuple of ints (fastest), a buffer of 4- or 8-byte
# ints (numpy array, array.array), or any iterable of ints.
_Ints = Sequence[int] | Iterable[int]
_Floats = Sequence[float] | Iterable[float]
_FinishReason = Literal["stop", "length", "abort", "error"]
# Dynamic values of utility calls: None, bool, int (-2**63 .. 2**64-1), float, str,
# bytes, list/tuple (decoded as list), dict with str keys, nested at most 64 deep.
_Value = Any

MSG_ADD_REQUESTS: Final = 1
MSG_ABORT: Final = 2
MSG_UTILITY_CALL: Final = 3
MSG_SHUTDOWN: Final = 4
MSG_OUTPUT_BATCH: Final = 16
MSG_UTILITY_RESULT: Final = 17
MSG_READY: Final = 18
MSG_ENGINE_ERROR: Final = 19
DEFAULT_MAX_FRAME_SIZE: Final = 268435456
"""Frames above this many bytes (256 MiB) are rejected unless `decode_message` is
given a larger `max_frame_size`."""

@final
class AddRequest:
    """A new request for EngineCore: the prompt and every sampling field it needs.

    Immutable. Values are carried as given (`top_k` 0 and -1 both mean disabled;
    the codec does not normalise). The defaults are `SamplingParams`' defaults.
    List getters build a new list on each call; `num_prompt_tokens` does not.
    Equality compares every field, floats bit for bit.
    """

    def __new__(
        cls,
        wire_id: int,
        prompt_token_ids: _Ints,
        *,
        arrival_time: float = 0.0,
        priority: int = 0,
        max_tokens: int = 16,
        min_tokens: int = 0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
        stop_token_ids: _Ints | None = None,
        ignore_eos: bool = False,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        repetition_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        cache_salt: str | None = None,
        structured_outputs: tuple[str, str] | None = None,
    ) -> Self: ...
    @property
    def wire_id(self) -> int: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def arrival_time(self) -> float: ...
    @property
    def priority(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def min_tokens(self) -> int: ...
    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def min_p(self) -> float: ...
    @property
    def seed(self) -> int | None: ...
    @property
    def stop_token_ids(self) -> list[int]: ...
    @property
    def ignore_eos(self) -> bool: ...
    @property
    def logprobs(self) -> int | None: ...
    @property
    def prompt_logprobs(self) -> int | None: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def cache_salt(self) -> str | None: ...
    @property
    def structured_outputs(self) -> tuple[str, str] | None:
        """(kind, spec) of the output constraint (StructuredOutputsParams), or None."""

@final
class SchedulerStats:
    """The scheduler's counters after a step (immutable)."""

    def __new__(
        cls,
        *,
        num_running: int = 0,
        num_waiting: int = 0,
        kv_cache_usage: float = 0.0,
        prefix_cache_queries: int = 0,
        prefix_cache_hits: int = 0,
        num_preemptions: int = 0,
    ) -> Self: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def kv_cache_usage(self) -> float:
        """Stored as float32 on the wire."""
    @property
    def prefix_cache_queries(self) -> int: ...
    @property
    def prefix_cache_hits(self) -> int: ...
    @property
    def num_preemptions(self) -> int: ...

@final
class Ready:
    """The handshake EngineCore sends once it is ready to serve (immutable)."""

    def __new__(
        cls,
        *,
        max_model_len: int,
        num_kv_blocks: int,
        block_size: int,
        vocab_size: int,
        eos_token_ids: _Ints,
    ) -> Self: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def num_kv_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_token_ids(self) -> list[int]: ...

@final
class Logprobs:
    """Log-probabilities of `num_positions` positions with `width` entries each: the
    sampled (or, for prompts, the actual) token first, then the top-N.

    `token_ids` and `logprobs` are flat, row-major `num_positions * width`;
    `ranks[k]` is the rank of the sampled/actual token at position k. The
    constructor infers `width = len(token_ids) // len(ranks)` (0 without
    positions) and rejects inconsistent lengths. Values travel as float32.
    Equality is bit-exact.
    """

    def __new__(cls, token_ids: _Ints, logprobs: _Floats, ranks: _Ints) -> Self: ...
    @property
    def num_positions(self) -> int: ...
    @property
    def width(self) -> int: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def logprobs(self) -> list[float]: ...
    @property
    def ranks(self) -> list[int]: ...

_LogprobsInput = Logprobs | tuple[_Ints, _Floats, _Ints] | None

@final
class OutputBatch:
    """A decoded output batch: one engine step's outputs, one entry per request.

    Columns are built when accessed (each access builds new lists), so no Python
    int exists for a token until `new_token_ids(i)` or `all_new_token_ids()` is
    called. Indices accept negative values like a list's.
    """

    def __len__(self) -> int: ...
    @property
    def wire_ids(self) -> list[int]: ...
    def new_token_ids(self, i: int) -> list[int]:
        """The new token ids of output `i`; `IndexError` when out of range."""
    def all_new_token_ids(self) -> list[list[int]]:
        """The new token ids of every output, one list each."""
    @property
    def num_new_tokens(self) -> list[int]: ...
    @property
    def finish_reasons(self) -> list[_FinishReason | None]: ...
    @property
    def stop_reasons(self) -> list[int | None]:
        """The stop token id that finished each request, if one did."""
    @property
    def errors(self) -> list[str | None]:
        """Why a request failed on its own (with finish reason "error")."""
    @property
    def finished_indices(self) -> list[int]:
        """Indices of the outputs whose request finished in this step."""
    @property
    def num_cached_tokens(self) -> dict[int, int]:
        """Output index -> prompt tokens served from the prefix cache, for the
        outputs that carry it (each request's first output); usually empty."""
    def logprobs(self, i: int) -> Logprobs | None: ...
    def prompt_logprobs(self, i: int) -> Logprobs | None: ...
    @property
    def stats(self) -> SchedulerStats: ...
    @property
    def timestamp(self) -> float: ...

def encode_add_requests(requests: Iterable[AddRequest]) -> bytes:
    """A burst of new requests as one `MSG_ADD_REQUESTS` frame."""

def encode_add_request(request: AddRequest) -> bytes:
    """One new request: a `MSG_ADD_REQUESTS` frame holding a burst of one."""

def encode_abort(wire_ids: _Ints) -> bytes:
    """A `MSG_ABORT` frame: abort these requests."""

def encode_utility_call(call_id: int, method: str, args: _Value) -> bytes:
    """A `MSG_UTILITY_CALL` frame: call `method(args)` on EngineCore."""

def encode_utility_result(call_id: int, ok: bool, value: _Value) -> bytes:
    """A `MSG_UTILITY_RESULT` frame: the call's return value when `ok`, else `value`
    is the error message (a str)."""

def encode_ready(ready: Ready) -> bytes:
    """A `MSG_READY` frame: the handshake."""

def encode_engine_error(message: str) -> bytes:
    """A `MSG_ENGINE_ERROR` frame: EngineCore hit a fatal error and is going away."""

def encode_shutdown() -> bytes:
    """A `MSG_SHUTDOWN` frame."""

def encode_output_batch(
    wire_ids: _Ints,
    new_token_ids: Sequence[_Ints] | _Ints,
    stats: SchedulerStats,
    timestamp: float,
    *,
    finish_reasons: Sequence[str | None] | None = None,
    stop_reasons: Sequence[int | None] | None = None,
    errors: Sequence[str | None] | None = None,
    logprobs: Sequence[_LogprobsInput] | None = None,
    prompt_logprobs: Sequence[_LogprobsInput] | None = None,
    num_cached_tokens: Sequence[int | None] | None = None,
) -> bytes:
    """A `MSG_OUTPUT_BATCH` frame from per-request columns: output i is
    `wire_ids[i]`, `new_token_ids[i]`, and entry i of each optional column (a
    column left as None means None for every request; one given must have one
    entry per wire id). `new_token_ids` may also be flat, one id per request (a
    list of ints or an integer buffer such as a 1-D numpy array): the common
    decode step, and the cheapest to extract. Finish reasons are "stop",
    "length", "abort" or "error". Logprobs entries are None, a `Logprobs`
    (fastest), or a
    `(token_ids, logprobs, ranks)` tuple as for the `Logprobs` constructor.
    `num_cached_tokens` gives a request's prompt tokens found in the prefix cache,
    sent with its first output only."""

def decode_message(
    frame: bytes | bytearray | memoryview, max_frame_size: int | None = None
) -> tuple[int, Any]:
    """Decodes one frame into `(message type, payload)`:

    - `MSG_ADD_REQUESTS`: `list[AddRequest]`
    - `MSG_ABORT`: `list[int]` (wire ids)
    - `MSG_UTILITY_CALL`: `(call_id, method, args)`
    - `MSG_UTILITY_RESULT`: `(call_id, ok, value or error message)`
    - `MSG_READY`: `Ready`
    - `MSG_ENGINE_ERROR`: `str`
    - `MSG_SHUTDOWN`: `None`
    - `MSG_OUTPUT_BATCH`: `OutputBatch`

    `bytes` are read in place; other buffers are copied first. Raises `WireError`
    for a frame larger than `max_frame_size` (None: `DEFAULT_MAX_FRAME_SIZE`),
    truncated, of an unknown type or wire version, with a field of the wrong type
    or an array of the wrong length, or with bytes after its body.
    """

# --- prefix-cache block keys (rust/py/prefix_hash.rs) ---
# SHA-256 chained block by block (layout in rust/prefix_hash.rs): a key stands for
# its whole prefix and the cache salt, so equal keys mean equal prefixes.

BLOCK_HASH_LEN: Final = 32

def block_hash_root(cache_salt: str | None = None) -> bytes:
    """The parent key of a sequence's first block; different salts give
    different roots, so their sequences never share a block key."""

def hash_blocks(parent: bytes, token_ids: _Ints, block_size: int) -> list[bytes]:
    """The key of every full block of `token_ids` (a trailing partial block is
    left out), chained from `parent`: the key of the block before `token_ids[0]`,
    or `block_hash_root(...)`. Runs of 1024 tokens or more are hashed with the GIL
    released. Raises ValueError for a parent that is not 32 bytes, a block_size of
    0 or a token id outside 0..2**32."""

# --- detokenizer (rust/py/detok.rs) ---

import collections.abc as _abc  # noqa: E402
import os  # noqa: E402
import typing as _typing  # noqa: E402

@_typing.final
class DetokenizerOutput:
    """What one `Detokenizer.step` released, per request in the order given.

    Indexing gives `(text, stop_index, num_kept, num_tokens_released)` of one request.
    `texts` is built with the output (the same list at each read); the other
    properties build a new list when read.
    """

    @property
    def texts(self) -> list[str]:
        """The newly released text of each request."""

    @property
    def stops(self) -> list[tuple[int, int, int]]:
        """`(position in the batch, stop string index, num_kept)` of each request whose
        stop string matched in this step. Such a request is stopped: later steps
        release nothing and keep no tokens; `remove` it (or name it in `finished`)."""

    @property
    def num_kept(self) -> list[int]:
        """How many of each request's new token ids belong to its output: all of them,
        or after a match those up to and including the token that completed it
        (0 for a request stopped earlier)."""

    @property
    def num_tokens_released(self) -> list[int]:
        """Output tokens of each request, counted from the first, whose text has been
        released in full (all kept tokens once stopped or finished)."""

    def __len__(self) -> int: ...
    def __getitem__(self, i: int, /) -> tuple[str, int | None, int, int]: ...

@_typing.final
class Detokenizer:
    """Batched incremental detokenizer with stop strings for one tokenizer.

    Holds per-request state keyed by an integer id. The text released over a
    request equals `D(prompt + output)` past its longest common prefix with
    `D(prompt)`, where `D` is `tokenizers`' `decode(ids, skip_special_tokens)`
    (with `spaces_between_special_tokens=False`: each run of non-added tokens
    decoded apart and added tokens' contents glued in); with stop strings, that
    text cut at the earliest-ending match (ties: the longest). Released text is never retracted:
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
        new_token_ids: _abc.Iterable[int | _abc.Iterable[int]],
        finished: _abc.Iterable[int] | None = None,
    ) -> DetokenizerOutput:
        """Advances each request by its new token ids (one engine step).

        `new_token_ids[i]` is request i's new ids: an int (one token) or a sequence
        of ints; or `new_token_ids` is a buffer of 32/64-bit ints (`array.array`,
        NumPy), one token per request, which avoids Python ints altogether.
        `finished` names requests of this batch that ended for another reason
        (EOS, length, abort) with this step: their held-back text is released as
        the full decode ends it, and their state dropped. Raises
        `DetokenizerError`, changing nothing, if an id is unknown or repeated, a
        finished id is not in the batch, or the arguments differ in length."""

    def finish(self, request_id: int) -> tuple[str, int | None]:
        """Releases what the request holds back and drops it (`step` with no
        tokens and the request finished): `(text, stop_index)`."""

    @property
    def num_requests(self) -> int:
        """Number of requests with state."""

    def __len__(self) -> int: ...
    def __contains__(self, request_id: int, /) -> bool: ...

# --- kernels (rust/py/kernels.rs) ---
# CPU compute kernels over buffer-protocol arrays: pass `tensor.numpy()`, zero-copy
# for CPU tensors. Every argument is checked before anything is written, and every
# problem raises ValueError. Private to the package: the GIL is released while a
# kernel computes and the KV cache is read in place, so the one caller
# (asyncllm.models.attention) guarantees that no other thread writes the cache or
# touches `out` meanwhile.

import numpy as _np  # noqa: E402
from typing_extensions import Buffer as _PyBuffer  # noqa: E402

# numpy's stubs declare the buffer protocol only for Python >= 3.12.
_Buffer = _PyBuffer | _np.ndarray

def _paged_decode_attention(
    out: _Buffer,
    q: _Buffer,
    kv_cache: _Buffer,
    block_tables: _Buffer,
    seq_lens: _Buffer,
    scale: float,
    num_threads: int,
    window: int = 0,
) -> None:
    """Decode attention for `num_seqs` sequences of one query token each, reading
    K/V in place through block tables (rust/kernels/paged_attention.rs).

    Writes `out` [num_seqs, num_heads * head_dim] float32 with, for each sequence b
    and query head h, softmax(scale * q[b, h] . K_b) V_b over the first seq_lens[b]
    tokens of the sequence, token t sitting in block block_tables[b, t // block_size]
    at offset t % block_size. Query head h reads KV head h // (num_heads //
    num_kv_heads) (grouped-query attention).

    q: [num_seqs, num_heads, head_dim] float32. kv_cache: [2, num_blocks,
    block_size, num_kv_heads, head_dim] float32, or bfloat16 passed as its bits
    (`tensor.view(torch.int16).numpy()`; accumulation stays float32, and q is then
    rounded to bfloat16 where the CPU's AVX512-BF16 dot products run) (0 = K,
    1 = V). block_tables:
    [num_seqs, blocks_per_seq] int64 or int32; entries past a sequence's last block
    are not read. seq_lens: [num_seqs] int64 or int32, each in
    1..blocks_per_seq * block_size. All C-contiguous; `out` writable and apart from
    kv_cache (q, block_tables and seq_lens are copied before the GIL is released).
    The work is split over `num_threads` threads (at least 1; pass
    `torch.get_num_threads()`). `window` > 0 (sliding-window layers): each
    sequence attends to its last `window` tokens only and the blocks before them
    are not read; 0: all its tokens. Raises ValueError on a wrong dtype, shape or
    layout, a seq_len out of range or a block id outside 0..num_blocks."""

def _kernel_isa(dtype: str) -> str:
    """The instruction-set variant `_paged_decode_attention` runs on this CPU for a
    cache of `dtype` ("float32" or "bfloat16"): "portable", "avx2" or "avx512bf16",
    within the cap of $ASYNCLLM_KERNEL_ISA ("auto", "avx512", "avx2", "portable";
    "avx512" runs the attention kernel's AVX2 variant). For tests
    and benchmarks. Raises ValueError on another dtype or a bad variable."""

def _linear(out: _Buffer, x: _Buffer, w: _Buffer, bias: _Buffer | None, num_threads: int) -> None:
    """out[m, n] = x[m, k] . w[n, k]^T (+ bias[n]) (rust/kernels/linear.rs): the
    weight read once for all of x's rows, each output element in one reduction
    order whatever m or the thread count (a row gives the same bits alone and in a
    batch). x, w and out share a dtype: float32, or bfloat16 passed as its bits
    (`tensor.view(torch.int16).numpy()`; accumulation is float32); bias is float32.
    All C-contiguous, out writable and apart from w. Raises ValueError on a wrong
    dtype, shape or layout, before anything is written. Private: the one caller
    (asyncllm.models.linear_kernels) promises no thread writes w or out meanwhile."""

def _gguf_dequantize(qtype_name: str, raw: _Buffer, out: _Buffer) -> None:
    """out[rows, k] = the GGUF blocks raw[rows, row_bytes] (uint8) of type
    `qtype_name` ("Q4_0", "Q4_K", "F16", ...) dequantized to float32, equal to
    gguf-py's `dequantize` bit for bit (rust/kernels/gguf.rs). Raises ValueError
    on an unknown type or a shape that is not whole blocks, before writing."""

def _gguf_linear(qtype_name: str, out: _Buffer, x: _Buffer, w: _Buffer, num_threads: int) -> None:
    """out[m, n] = x[m, k] . dequantize(w)[n, k]^T for GGUF blocks w [n, row_bytes]
    (uint8): each weight row decoded once into a cache-resident buffer and dotted
    with every row of x (float32, as out). Raises ValueError on a wrong type or
    shape, before writing. Private: the one caller (asyncllm.models.gguf.layers)
    promises no thread writes w or out meanwhile."""

def _linear_isa() -> str:
    """The variant `_linear` runs on this CPU: "portable", "avx2" or "avx512", within
    the cap of $ASYNCLLM_KERNEL_ISA ("auto", "avx512", "avx2", "portable")."""

@final
class _DecodePlan:
    """Every decoder layer of a Llama-shaped model for one-call decode steps
    (rust/kernels/decode_layers.rs, asyncllm.models.fused_decode). `layers`: per
    layer (input_norm, qkv, qkv_bias or None, o, post_norm, gate_up, down, kv_cache)
    as buffers: weights float32 or bfloat16 bits (int16), one dtype for all; the bias
    float32; the cache [2, num_blocks, block_size, num_kv_heads, head_dim] float32 or
    bfloat16 bits. The plan holds them for its lifetime and reads them with the GIL
    released: no other thread may write them meanwhile. Raises ValueError on a
    dtype or shape problem."""

    def __new__(
        cls,
        layers: list[tuple[Any, ...]],
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        intermediate: int,
        eps: float,
        scale: float,
    ) -> Self: ...
    def run(
        self,
        hidden: _Buffer,
        cos_sin: _Buffer,
        slots: _Buffer,
        block_tables: _Buffer,
        seq_lens: _Buffer,
        num_threads: int,
    ) -> None:
        """Every layer over `hidden` [m, hidden] (updated in place) for m decode rows:
        cos_sin [m, 2, head_dim / 2] in the model's dtype, slots [m], block_tables
        [m, n] and seq_lens [m] int64. Raises ValueError, writing nothing, on any
        shape, slot, length or block id out of range."""

def _rms_norm(out: _Buffer, x: _Buffer, weight: _Buffer, eps: float, num_threads: int) -> None:
    """out = rms_norm(x) * weight, row by row (rows of len(weight); rust/kernels/
    elementwise.rs): float32, or bfloat16 as int16 bits, one dtype for all; in
    float32, rounded where asyncllm.models.layers.rms_norm rounds. C-contiguous, out
    writable and apart from the rest. Raises ValueError on a dtype or shape problem."""

def _add_rms_norm(
    out: _Buffer, residual: _Buffer, x: _Buffer, weight: _Buffer, eps: float, num_threads: int
) -> None:
    """residual += x (rounded to the dtype, in place), then out = rms_norm(residual) *
    weight, row by row; as `_rms_norm` otherwise (residual also writable and apart)."""

def _silu_mul(out: _Buffer, gate_up: _Buffer, num_threads: int) -> None:
    """out[r] = silu(gate[r]) * up[r] from the fused gate/up rows [rows, 2 * inter]
    (gate first) into out [rows, inter]; as `_rms_norm` otherwise."""

def _fma_peak(num_threads: int, iters: int) -> tuple[float, str]:
    """(float operations per second, ISA variant) of `num_threads` threads each
    running `iters` rounds of 12 independent vector fused multiply-adds: the CPU's
    FMA peak, for the roofline benchmark."""

def _read_bandwidth(data: _Buffer, num_threads: int) -> float:
    """Bytes per second of `num_threads` threads summing disjoint parts of `data`
    (1-D float32, read in place): memory read bandwidth when `data` is far larger
    than the caches."""

def _sample(
    logits: _Buffer,
    params_f: _Buffer,
    params_i: _Buffer,
    seen_offsets: _Buffer,
    seen_tokens: _Buffer,
    seen_counts: _Buffer,
    banned_offsets: _Buffer,
    banned_tokens: _Buffer,
    sampled: _Buffer,
    ranks: _Buffer,
    logprob_ids: _Buffer,
    logprob_values: _Buffer,
    num_threads: int,
    bitmask: _Buffer | None = None,
    bitmask_rows: _Buffer | None = None,
) -> list[int]:
    """Samples every row of `logits` [n, vocab] float32 in one call (rust/sampler),
    reading it in place with the GIL released. Private: its one caller,
    asyncllm.worker.sampler_kernel, guarantees no other thread writes `logits` or
    touches the outputs meanwhile.

    params_f: [n, 6] float32 (temperature, top_p, min_p, repetition, frequency,
    presence); params_i: [n, 6] int64 (greedy, top_k, num_logprobs or -1, seed and
    stream as uint64 bits, output position): the columns F_*/I_* of
    asyncllm.worker.input_batch. Token lists in CSR form (int64): row r's seen
    tokens are seen_tokens[seen_offsets[r]:seen_offsets[r+1]] with seen_counts their
    occurrences among the outputs; banned_* likewise (min_tokens). Writes sampled
    [n] and ranks [n] int64, logprob_ids [n, w] int64 and logprob_values [n, w]
    float32 (w = 0, or >= 1 + every row's num_logprobs; padded with -1 / NaN).
    Constrained rows: bitmask [m, words] int32 and bitmask_rows [m] int64 (distinct
    rows); row bitmask_rows[i] samples as if every token row i of the bitmask does
    not allow had logit -inf (logprobs and ranks too), masked as the kernel reads
    it. Returns the rows whose logits had no finite maximum (sampled as their
    argmax). Raises ValueError, writing nothing, on a bad dtype, shape, parameter
    or token id."""

# -- constrained decoding (rust/structured, rust/py/structured.rs) ------------------

GRAMMAR_RUNNING: Final[int]
GRAMMAR_COMPLETE: Final[int]
GRAMMAR_ERROR: Final[int]

@final
class Grammar:
    """A compiled constraint, shared by every request with the same one."""

    @property
    def kind(self) -> str: ...
    @property
    def size_bytes(self) -> int:
        """Heap bytes the compiled grammar holds (measured when it was compiled)."""
    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of this grammar."""

@final
class GrammarMatcher:
    """One request's walk through a grammar."""

    def consume(self, tokens: list[int]) -> int:
        """Consumes `tokens` in order; stops at the end of the grammar. Returns
        GRAMMAR_RUNNING, GRAMMAR_COMPLETE or GRAMMAR_ERROR."""
    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` consumed tokens."""
    @property
    def status(self) -> int: ...
    @property
    def error(self) -> str | None: ...

@final
class GrammarCompiler:
    """Compiles constraints for one tokenizer and model vocabulary (llguidance);
    build it once: it walks the whole vocabulary."""

    def __new__(cls, tokenizer_path: str, eos_token_ids: list[int], vocab_size: int) -> Self: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def words(self) -> int:
        """int32 words per bitmask row: ceil(vocab_size / 32)."""
    def compile(self, kind: str, spec: str, timeout_s: float | None = None) -> Grammar:
        """Compiles (kind, spec) on the compiler's threads at the lowest scheduling
        priority, waiting (GIL released) at most `timeout_s`; ValueError names the
        problem, or the limit the grammar went past (the deadline included)."""
    def fill_bitmasks(
        self, matchers: list[GrammarMatcher], out: _Buffer, rows: list[int], threads: int = 1
    ) -> list[int]:
        """Writes each matcher's allowed tokens into row rows[i] of `out` (int32
        [N, words]) with the GIL released; matchers in the same state (grammar and
        tokens) share one computed mask; `threads` > 1 computes the distinct masks
        on a pool of that many threads, 1 serially on the calling thread. Returns
        the indices of matchers in error (their rows allow EOS only)."""
    def advance(self, matchers: list[GrammarMatcher], tokens: list[int]) -> bytes:
        """Advances matchers[i] by tokens[i]; per matcher a GRAMMAR_* status (a byte)."""
    def advance_fill(
        self,
        advance: list[GrammarMatcher],
        tokens: list[int],
        fill: list[GrammarMatcher],
        out: _Buffer,
        rows: list[int],
        threads: int = 1,
    ) -> MaskJob:
        """Queues on the extension's grammar thread the advance of advance[i] by
        tokens[i], then the fill of fill[i]'s mask into row rows[i] of `out` (as
        `fill_bitmasks`), and returns at once; jobs run in the order queued. The
        caller leaves those rows of `out` alone until the job is waited for."""

@final
class MaskJob:
    """A queued `advance_fill`; it holds `out` until it has ended, and dropping it
    unfinished waits for it."""

    def wait(self) -> list[int]:
        """Waits with the GIL released; the indices of the fills in error, or
        RuntimeError with why the job failed."""
    @property
    def run_seconds(self) -> float:
        """Seconds the job ran on the grammar thread (waits for it first)."""
