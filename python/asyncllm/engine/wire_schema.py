"""The wire's request schema, declared once: every field an `AddRequest` carries,
in wire order, with its kind, its default and how it is read from and back into
the Python request.

`tools/gen_wire.py` writes from this table the Rust struct with its msgpack
reader and writer (`rust/protocol/add_request.rs`), the PyO3 class
(`rust/py/codec/add_request.rs`), the Python converters (`engine/wire.py`) and
the `AddRequest` part of `_core.pyi`; `tests/test_wire_schema.py` fails when one
of them is stale. A new request field is one row here (after its definition and
validation in `SamplingParams`), then `python tools/gen_wire.py`. Any change to
the rows changes the wire: bump `WIRE_VERSION` with it and rewrite the golden
frames (`python tests/fixtures/make_wire_fixtures.py`).

A leaf module: imports nothing of asyncllm, so tools, tests and benchmarks read
it without the extension.
"""

from __future__ import annotations

from dataclasses import dataclass

# Carried by every frame; bumped on any change to the table below.
WIRE_VERSION = 6


@dataclass(frozen=True, slots=True)
class WireKind:
    """How a kind of field travels. `rust` and `py` are its types on each side;
    `encoded` is how the golden-frame writer packs it (tests/fixtures)."""

    rust: str
    py: str
    encoded: str


# The kinds a field may have. Token arrays are msgpack `bin` of little-endian
# u32 ("words"); the three list kinds are nil when empty, so a request without
# them pays one byte each.
KINDS: dict[str, WireKind] = {
    "u64": WireKind("u64", "int", "int"),
    "u32": WireKind("u32", "int", "int"),
    "i32": WireKind("i32", "int", "int"),
    "f32": WireKind("f32", "float", "f32"),
    "f64": WireKind("f64", "float", "f64"),
    "bool": WireKind("bool", "bool", "bool"),
    "opt_u64": WireKind("Option<u64>", "int | None", "int"),
    "opt_u32": WireKind("Option<u32>", "int | None", "int"),
    "opt_str": WireKind("Option<String>", "str | None", "str"),
    # token ids, `bin` of u32 (an empty list is an empty bin)
    "u32s": WireKind("Vec<u32>", "list[int]", "words"),
    # token id -> bias: nil, or [ids: bin u32, biases: bin f32] sorted by id
    "token_bias": WireKind("Vec<(u32, f32)>", "dict[int, float]", "token_bias"),
    # lists of token ids: nil, or an array of `bin` u32
    "u32_lists": WireKind("Vec<Vec<u32>>", "list[list[int]]", "words_lists"),
    # the output constraint: nil, or [kind: str, spec: str] (protocol::StructuredSpec)
    "structured": WireKind("Option<StructuredSpec>", "tuple[str, str] | None", "structured"),
}


@dataclass(frozen=True, slots=True)
class WireField:
    """One `AddRequest` field.

    `default` is its Python literal (None: a required, positional argument).
    `to_wire` is the Python expression that computes it in `wire.to_wire` from
    `req` (the EngineCoreRequest), `p` (its SamplingParams) and `max_model_len`;
    `from_wire` the one that turns `add` (the decoded AddRequest) back into a
    SamplingParams argument ("" when the field is not one).
    """

    name: str
    kind: str
    doc: str
    default: str | None
    to_wire: str = ""
    from_wire: str = ""
    # False for the fields that live on the EngineCoreRequest, not its params
    param: bool = True

    def wire_expr(self) -> str:
        return self.to_wire or f"p.{self.name}"

    def param_expr(self) -> str:
        return self.from_wire or f"add.{self.name}"


def _f(name: str, kind: str, doc: str, default: str | None, **kw: str | bool) -> WireField:
    return WireField(name, kind, doc, default, **kw)  # type: ignore[arg-type]


ADD_REQUEST: tuple[WireField, ...] = (
    _f("wire_id", "u64", "The request's compact id on the wire.", None, param=False),
    _f("prompt_token_ids", "u32s", "The prompt.", None, param=False),
    _f("arrival_time", "f64", "Seconds since the epoch.", "0.0", param=False),
    _f("priority", "i32", "Lower is served first (priority scheduling).", "0", param=False),
    _f(
        "max_tokens",
        "u32",
        "Resolved by the front end: never more than max_model_len allows.",
        "16",
        to_wire="clamp_max_tokens(p.max_tokens, len(req.prompt_token_ids), max_model_len)",
    ),
    _f(
        "min_tokens",
        "u32",
        "Stop tokens are banned until this many were generated.",
        "0",
        from_wire="min(add.min_tokens, add.max_tokens)",
    ),
    _f("temperature", "f32", "0 (or below 1e-5) is greedy.", "1.0"),
    _f("top_p", "f32", "1 is off.", "1.0"),
    _f("top_k", "i32", "0 or -1 is off (carried as given).", "0"),
    _f("min_p", "f32", "0 is off.", "0.0"),
    _f("seed", "opt_u64", "None: drawn under the engine's seed.", "None"),
    _f("stop_token_ids", "u32s", "Tokens that finish the request.", "None"),
    _f("ignore_eos", "bool", "Keep going past EOS.", "False"),
    _f("logprobs", "opt_u32", "Top logprobs per output token.", "None"),
    _f("prompt_logprobs", "opt_u32", "Top logprobs per prompt token.", "None"),
    _f("repetition_penalty", "f32", "1 is off.", "1.0"),
    _f("frequency_penalty", "f32", "0 is off.", "0.0"),
    _f("presence_penalty", "f32", "0 is off.", "0.0"),
    _f(
        "cache_salt",
        "opt_str",
        "Requests share cached prefix blocks only when their salts are equal.",
        "None",
    ),
    _f(
        "structured_outputs",
        "structured",
        "(kind, spec) of the output constraint, or None.",
        "None",
        to_wire="None if p.structured_outputs is None else "
        "(p.structured_outputs.kind, p.structured_outputs.spec())",
        from_wire="None if add.structured_outputs is None else "
        "StructuredOutputsParams.from_spec(*add.structured_outputs)",
    ),
    _f(
        "logit_bias",
        "token_bias",
        "Token id -> bias added to its logit before sampling (OpenAI's logit_bias).",
        "None",
        to_wire="p.logit_bias or None",
        from_wire="add.logit_bias or None",
    ),
    _f(
        "allowed_token_ids",
        "u32s",
        "Only these tokens may be sampled (empty: no restriction).",
        "None",
        to_wire="p.allowed_token_ids",
        from_wire="add.allowed_token_ids or None",
    ),
    _f(
        "bad_words_token_ids",
        "u32_lists",
        "The bad words, tokenized by the front end: a word's last token is banned "
        "when the output ends with the tokens before it.",
        "None",
        to_wire="p.bad_words_token_ids",
        from_wire="add.bad_words_token_ids",
    ),
    _f(
        "pooling",
        "opt_str",
        'None: generate. "last" or "mean": an embedding request, whose prompt\'s final '
        "hidden states are pooled that way and sent back; nothing is sampled.",
        "None",
        param=False,
    ),
    _f(
        "lora_int_id",
        "u32",
        "The adapter's id (LoRARequest.lora_int_id); 0: the base model.",
        "0",
        param=False,
    ),
    _f("lora_name", "opt_str", "The adapter's name, with lora_int_id.", "None", param=False),
    _f(
        "lora_path",
        "opt_str",
        "The adapter's PEFT directory, with lora_int_id.",
        "None",
        param=False,
    ),
)
