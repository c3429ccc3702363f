"""The text of single tokens, for logprobs.

A token is a string of bytes, and with byte-level vocabularies many tokens are
fragments of a UTF-8 character: decoding one alone gives "\\ufffd". So:

- `bytes_of(id)` is the token's own bytes (what chat `logprobs[].bytes` carries);
- `display(id)` is its own string when those bytes are whole characters, else the
  bytes escaped as `bytes:\\xe2\\x80` (how OpenAI shows fragments);
- `pieces(ids)` splits the text of a token sequence among its tokens: each token
  gets the characters its bytes complete, so a fragment gets "" and the token
  that completes the character gets all of it. The pieces join to the sequence's
  text, which is what legacy `tokens` and `text_offset` describe.
"""

from __future__ import annotations

import codecs
import json
import re
from functools import lru_cache

from asyncllm.frontend.tokenizer import Tokenizer

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPM_SPACE = "\u2581"


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's map from the printable characters of byte-level tokens to bytes."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenText:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        try:
            spec = json.loads(tokenizer.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            spec = {}
        decoder = spec.get("decoder") or {}
        kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", ())}
        self._byte_level = "ByteLevel" in kinds
        self._added = {
            t["id"]: (t["content"], bool(t.get("special")))
            for t in spec.get("added_tokens", ())
            if isinstance(t, dict) and isinstance(t.get("id"), int)
        }
        self._bytes = lru_cache(maxsize=65536)(self._compute_bytes)
        self._to_byte = _byte_level_decoder() if self._byte_level else {}

    def is_special(self, token_id: int) -> bool:
        added = self._added.get(token_id)
        return added is not None and added[1]

    def bytes_of(self, token_id: int) -> bytes:
        return self._bytes(token_id)

    def _compute_bytes(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added[0].encode()
        raw = self.tokenizer.id_to_token(token_id)
        if raw is None:
            return b""
        if self._byte_level:
            try:
                return bytes(self._to_byte[c] for c in raw)
            except KeyError:
                return raw.encode()
        match = _BYTE_TOKEN.fullmatch(raw)
        if match:
            return bytes([int(match.group(1), 16)])
        return raw.replace(_SPM_SPACE, " ").encode()

    def display(self, token_id: int) -> str:
        data = self.bytes_of(token_id)
        try:
            return data.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)

    def pieces(self, token_ids: list[int], skip_special_tokens: bool = False) -> list[str]:
        """Each token's share of the sequence's text (see the module docstring);
        special tokens give "" when `skip_special_tokens`."""
        decoder = self.piece_decoder(skip_special_tokens)
        out = decoder.feed(token_ids)
        if out:
            out[-1] += decoder.flush()
        return out

    def pieces_of_text(self, token_ids: list[int], text: str) -> list[str] | None:
        """`pieces` fitted to the text they were encoded from: tokens the tokenizer
        added (BOS) give "", and a leading space the text lacks (sentencepiece's
        "▁") is dropped. None when the pieces cannot be fitted."""
        out = []
        pos = 0
        for t, piece in zip(token_ids, self.pieces(token_ids), strict=True):
            if text.startswith(piece, pos):
                pass
            elif self.is_special(t):
                piece = ""
            elif piece.startswith(" ") and text.startswith(piece[1:], pos):
                piece = piece[1:]
            else:
                return None
            out.append(piece)
            pos += len(piece)
        return out if pos == len(text) else None

    def piece_decoder(self, skip_special_tokens: bool = False) -> PieceDecoder:
        """`pieces` for a sequence that arrives in parts (a stream)."""
        return PieceDecoder(self, skip_special_tokens)


class PieceDecoder:
    def __init__(self, token_text: TokenText, skip_special_tokens: bool) -> None:
        self._text = token_text
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, token_ids: list[int]) -> list[str]:
        out = []
        for t in token_ids:
            if self._skip and self._text.is_special(t):
                out.append("")
            else:
                out.append(self._utf8.decode(self._text.bytes_of(t)))
        return out

    def flush(self) -> str:
        """What is left of an unfinished character at the end ("\ufffd" or "")."""
        return self._utf8.decode(b"", final=True)
