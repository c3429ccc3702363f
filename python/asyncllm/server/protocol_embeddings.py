"""OpenAI's embeddings request body, and how each vector is written back
(`encoding_format` float, or base64 of its little-endian float32 bytes as OpenAI
sends it)."""

from __future__ import annotations

import base64
import struct
from typing import Literal

from pydantic import BaseModel


class EmbeddingRequest(BaseModel):
    # one text, several, one prompt of token ids, or several
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list, each a text or a prompt of token ids."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and all(isinstance(t, int) for t in value):
            return [list(value)]  # type: ignore[arg-type]
        return list(value)  # type: ignore[arg-type]


def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    """A vector as the response carries it."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector
