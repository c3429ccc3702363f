"""Logprobs in OpenAI's two shapes, built from the engine's per-position dicts
(the sampled or actual token first, then the top-N).

Legacy (/v1/completions): `tokens`, `token_logprobs`, `top_logprobs` and
`text_offset`. `tokens` are the tokens' shares of the text (`TokenText.pieces`),
so they join to the text and the offsets never decrease; `top_logprobs` holds
the k most likely tokens plus the chosen one when it is not among them (up to
k + 1 entries, as OpenAI), the chosen one keyed by its `tokens` string.

Chat: per token its own string (`TokenText.display`), its bytes, and the k most
likely alternatives.
"""

from __future__ import annotations

from typing import Any

from asyncllm.outputs import CompletionOutput, Logprob
from asyncllm.server.token_text import PieceDecoder, TokenText

_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def top_entries(entry: dict[int, Logprob], num: int) -> list[tuple[int, Logprob]]:
    """The `num` most likely tokens of one position, most likely first."""
    if num <= 0:
        return []
    return sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:num]


class LegacyLogprobs:
    def __init__(self, token_text: TokenText, num_top: int, skip_special_tokens: bool) -> None:
        self.text = token_text
        self.num_top = num_top
        self.skip_special_tokens = skip_special_tokens

    @staticmethod
    def empty() -> dict[str, Any]:
        return {key: [] for key in _KEYS}

    @staticmethod
    def copy(lp: dict[str, Any]) -> dict[str, Any]:
        return {key: list(lp[key]) for key in _KEYS}

    @staticmethod
    def extend(into: dict[str, Any], more: dict[str, Any]) -> None:
        for key in _KEYS:
            into[key].extend(more[key])

    @staticmethod
    def end_offset(lp: dict[str, Any], start: int) -> int:
        """The offset after the tokens of `lp` (the next token's text_offset)."""
        return lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp["tokens"] else start

    def prompt(self, ids: list[int], pieces: list[str], prompt_lps: Any) -> dict[str, Any]:
        """The prompt's tokens (the first has no logprob), as `pieces` of the echo."""
        rows = prompt_lps if prompt_lps is not None else ()
        entries = [rows[k] if k < len(rows) else None for k in range(len(ids))]
        return self._rows(ids, pieces, entries, 0)

    def sampled(self, c: CompletionOutput, offset: int, decoder: PieceDecoder) -> dict[str, Any]:
        """The tokens of `c` (a delta of one choice), from text offset `offset`;
        `decoder` carries a character split across deltas."""
        ids = c.token_ids[: len(c.logprobs or ())]
        return self._rows(ids, decoder.feed(ids), list(c.logprobs or ()), offset)

    def _rows(
        self,
        ids: list[int],
        pieces: list[str],
        entries: list[dict[int, Logprob] | None],
        offset: int,
    ) -> dict[str, Any]:
        lp = self.empty()
        display = self.text.display
        for token_id, piece, entry in zip(ids, pieces, entries, strict=True):
            chosen = entry.get(token_id) if entry else None
            lp["tokens"].append(piece)
            lp["token_logprobs"].append(chosen.logprob if chosen else None)
            if entry is None:
                lp["top_logprobs"].append(None)
            else:
                best = top_entries(entry, self.num_top)
                own = piece or display(token_id)
                top = {(own if t == token_id else display(t)): v.logprob for t, v in best}
                if chosen is not None and all(t != token_id for t, _ in best):
                    top[own] = chosen.logprob
                lp["top_logprobs"].append(top)
            lp["text_offset"].append(offset)
            offset += len(piece)
        return lp


def chat_logprobs(token_text: TokenText, c: CompletionOutput, num_top: int) -> list[dict[str, Any]]:
    """OpenAI's chat shape: per token its string, logprob, bytes and the `num_top`
    most likely alternatives."""
    display, bytes_of = token_text.display, token_text.bytes_of
    content = []
    for token_id, entry in zip(c.token_ids, c.logprobs or (), strict=False):
        chosen = entry.get(token_id)
        content.append(
            {
                "token": display(token_id),
                "logprob": chosen.logprob if chosen else None,
                "bytes": list(bytes_of(token_id)),
                "top_logprobs": [
                    {"token": display(t), "logprob": v.logprob, "bytes": list(bytes_of(t))}
                    for t, v in top_entries(entry, num_top)
                ],
            }
        )
    return content
