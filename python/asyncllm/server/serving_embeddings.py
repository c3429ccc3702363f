"""`POST /v1/embeddings`: one or several inputs (texts or token ids), each an
embedding request of the engine (`AsyncLLM.embed`), pooled as the server is set
(`--embedding-pooling`, `--no-embedding-normalize`); `dimensions` truncates
(then renormalises when normalizing). Every size a client controls is bounded
before any work: the number of inputs, each input's characters and tokens, and
all inputs' tokens together.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response

from asyncllm.errors import EngineDeadError, InvalidRequestError
from asyncllm.outputs import EmbeddingRequestOutput
from asyncllm.pooling_params import PoolingParams
from asyncllm.server.limits import over_limit
from asyncllm.server.protocol import APIError, bad_request
from asyncllm.server.protocol_embeddings import EmbeddingRequest, encode_embedding
from asyncllm.server.serving_base import ServingBase, gather_first_error, off_loop, random_id
from asyncllm.server.sse import run_until_disconnect


class EmbeddingServing(ServingBase):
    async def create(self, req: EmbeddingRequest, receive: Any) -> Response:
        if self.check_model(req.model) is not None:
            raise bad_request(
                f"model: {req.model!r} is a LoRA adapter; embeddings are served by the "
                "base model only",
                "model",
            )
        params = self._pooling_params(req.dimensions)
        prompts = await self._prompts(req.inputs())
        self.check_engine()
        ticket = self.admission.admit(len(prompts), "input")
        base_id = random_id("embd")
        try:
            work = gather_first_error(
                [self._embed(ids, params, f"{base_id}-{i}") for i, ids in enumerate(prompts)]
            )
            outputs = await run_until_disconnect(receive, work)
        finally:
            ticket.release()
        if outputs is None:
            return Response(status_code=499)
        body = await off_loop(self._body, outputs, req.encoding_format)
        return Response(body, media_type="application/json")

    def _pooling_params(self, dimensions: int | None) -> PoolingParams:
        hidden = self.engine.hidden_size
        if dimensions is not None and not 1 <= dimensions <= hidden:
            raise bad_request(
                f"dimensions={dimensions} is invalid: this model's embeddings have {hidden} "
                f"dimensions, so it must be between 1 and {hidden}",
                "dimensions",
            )
        c = self.config
        return PoolingParams(c.embedding_pooling, c.embedding_normalize, dimensions)

    async def _prompts(self, inputs: list[str | list[int]]) -> list[list[int]]:
        """Each input's token ids, checked: how many inputs, each one's length, and
        all of them together."""
        c = self.config
        if not inputs:
            raise bad_request("input must not be empty", "input")
        if len(inputs) > c.max_embedding_inputs:
            raise over_limit(
                "input", "inputs", len(inputs), "max_embedding_inputs", c.max_embedding_inputs
            )
        texts = []
        for item in inputs:
            if isinstance(item, str):
                if not item:
                    raise bad_request("input must not contain an empty string", "input")
                self.limits.check_chars(len(item), "input")
                texts.append(item)
            elif not item:
                raise bad_request("input must not contain an empty token list", "input")
        encoded = iter(await off_loop(self.tokenizer.encode_batch, texts) if texts else ())
        prompts = []
        total = 0
        for item in inputs:
            ids = next(encoded) if isinstance(item, str) else item
            if not isinstance(item, str):
                self.check_prompt_ids(ids, "input")
            self.max_tokens_for(len(ids), 1, "input", "input")  # fits the context
            total += len(ids)
            prompts.append(ids)
        if total > c.max_embedding_tokens:
            raise over_limit(
                "input", "tokens", total, "max_embedding_tokens", c.max_embedding_tokens
            )
        return prompts

    async def _embed(
        self, ids: list[int], params: PoolingParams, request_id: str
    ) -> EmbeddingRequestOutput:
        """`AsyncLLM.embed` with in-flight tracking; engine errors become APIErrors."""
        self.in_flight.add(request_id)
        try:
            return await self.engine.embed({"prompt_token_ids": ids}, params, request_id)
        except EngineDeadError:
            raise APIError(503, "the engine is not running", code="engine_dead") from None
        except InvalidRequestError as exc:
            raise bad_request(str(exc)) from None
        finally:
            self.in_flight.discard(request_id)

    def _body(self, outputs: list[EmbeddingRequestOutput], encoding_format: str) -> bytes:
        num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": encode_embedding(o.outputs.embedding, encoding_format),
            }
            for i, o in enumerate(outputs)
        ]
        return json.dumps(
            {
                "object": "list",
                "data": data,
                "model": self.model_name,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
            },
            separators=(",", ":"),
        ).encode()
