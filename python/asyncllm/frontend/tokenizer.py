"""Loading a model's tokenizer: `tokenizer.json` for the vocabulary, special tokens
from `tokenizer_config.json` (the EOS ids the engine stops on are resolved by the
core, from the same files: `asyncllm.tokenizer_files`)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from asyncllm.errors import ModelLoadError
from asyncllm.tokenizer_files import read_json, token_content


class Tokenizer:
    """A thin wrapper over the `tokenizers` library with the model's special tokens."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.path = self.directory / "tokenizer.json"
        if not self.path.is_file():
            raise ModelLoadError(
                f"no tokenizer.json in {self.directory}: asyncllm needs a fast-tokenizer file "
                "(set EngineArgs.tokenizer to a directory that has one)"
            )
        try:
            self._tok = HFTokenizer.from_file(str(self.path))
        except Exception as exc:  # the library raises a bare Exception on bad files
            raise ModelLoadError(f"cannot load {self.path}: {exc}") from exc
        self.config = read_json(self.directory / "tokenizer_config.json")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token = token_content(self.config.get("eos_token"))
        self.bos_token = token_content(self.config.get("bos_token"))
        self.eos_token_id = self.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_token_id = self.token_to_id(self.bos_token) if self.bos_token else None

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` of several texts. The library releases the GIL here (not in
        `encode`), so a long text tokenized on a worker thread leaves the event
        loop running."""
        encodings = self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)
