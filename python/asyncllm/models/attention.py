"""Paged attention over a block-table KV cache, in plain torch.

One code path serves decode, chunked prefill and prefix-cache hits: every step
writes its new K/V into the cache through `slot_mapping`, then each query reads all
keys up to its own position back from the cache through its block table.

KV cache layout, per layer (allocated by the model runner):
    [2, num_blocks, block_size, num_kv_heads, head_dim]   (index 0 = K, 1 = V)

Decodes on CPU (float32 or bfloat16, the cache in either) read K/V in place through
the block tables with the Rust kernel `_core._paged_decode_attention`
(rust/kernels/paged_attention.rs, float32 accumulation); CUDA and float16 gather K/V
out of the cache and run SDPA. A sliding-window layer reads only its window on
either path (the torch path gathers each decode's window blocks, the kernel skips
the rest), so its cost is flat in the context length. The cache's dtype may differ from the model's
(`EngineArgs.kv_cache_dtype`): K/V are converted as they are written and read.

Everything that does not depend on the layer (block tables trimmed to what the step
reads, key-padding and causal masks, prefill spans) is built once per step by
`build_attention_metadata` and shared by every layer, so a layer does tensor work only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from asyncllm import _core


@dataclass
class PrefillSpan:
    """One sequence with more than one query token in this step (a prompt chunk)."""

    start: int  # its first token in the flattened batch
    end: int  # one past its last token
    context_len: int  # tokens already cached before this step
    seq_len: int  # context_len + query_len: keys it attends to
    # [ceil(seq_len / block_size)] int64; None when context_len == 0: the fresh k/v of
    # the step are all its keys, so attention runs on them directly with `is_causal`.
    block_table: torch.Tensor | None
    # [query_len, seq_len] bool (True = attend): causal with an offset of context_len.
    mask: torch.Tensor | None
    # window -> (first key read, [query_len, seq_len - first] bool mask): the keys a
    # sliding-window layer reads; built by the first layer that needs it.
    _windows: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict, repr=False)

    def window(self, window: int, device: torch.device) -> tuple[int, torch.Tensor | None]:
        """The first key a `window`-wide sliding-window layer reads for this span,
        and its mask (None: plain causal attention from that key on suffices)."""
        if self.seq_len <= window:
            return 0, self.mask
        cached = self._windows.get(window)
        if cached is None:
            first = max(0, self.context_len + 1 - window)
            q_pos = np.arange(self.context_len, self.seq_len)[:, None]
            k_pos = np.arange(first, self.seq_len)[None, :]
            keep = (k_pos <= q_pos) & (k_pos > q_pos - window)
            cached = (first, torch.from_numpy(keep).to(device))
            self._windows[window] = cached
        return cached


@dataclass
class DecodeGroup:
    """Decodes whose keys the torch path gathers and attends to together, padded
    to the longest of the group (not of the step: one long sequence must not make
    every short one gather its length)."""

    # [g] int64: the group's positions among the step's decodes; None = all of them,
    # in order (the usual case: one group).
    rows: torch.Tensor | None
    # [g, nb] int64 trimmed to the blocks the group's longest decode reads (padded
    # with whatever the rows hold past a sequence's blocks, hidden by the mask)
    block_tables: torch.Tensor
    max_len: int  # keys gathered per decode: the group's longest seq_len
    # [g, 1, 1, max_len] bool (True = attend); None when the group's decodes all
    # have the same length and nothing needs hiding.
    mask: torch.Tensor | None
    # Float versions of mask per dtype, made by the first layer that needs one.
    _float_masks: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)

    def mask_as(self, dtype: torch.dtype) -> torch.Tensor | None:
        """mask as an additive mask of `dtype` (0 / -inf), which the fused CPU and
        CUDA kernels take without a per-call conversion; cached across layers."""
        if self.mask is None:
            return None
        mask = self._float_masks.get(dtype)
        if mask is None:
            mask = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            mask.masked_fill_(~self.mask, float("-inf"))
            self._float_masks[dtype] = mask
        return mask


@dataclass
class AttentionMetadata:
    """What every layer's attention needs for one step; built once per step."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) per token
    num_decodes: int  # the first num_decodes tokens are 1-token queries, one per sequence
    num_tokens: int  # T
    # Decodes, for the Rust kernel: block tables [num_decodes, nb] int64 trimmed to the
    # blocks the longest decode reads, and each decode's seq_len (its bound); None
    # without decodes.
    decode_block_tables: torch.Tensor | None
    decode_seq_lens: torch.Tensor | None  # [num_decodes] int64
    # Decodes, for the torch path: groups of similar length (`group_decodes`).
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)
    block_size: int = 0
    # Host, per sequence in batch order: query lengths, and prompt lengths where the
    # runner passes them (models whose rotation depends on them: Phi-3's longrope).
    query_lens: np.ndarray | None = None
    prompt_lens: np.ndarray | None = None
    # Tokens that attend as decodes of their own, per token its block table and seq_len:
    # every prompt token in batch-invariant mode (`token_wise_spans` None: all prefill
    # spans), or speculative decoding's verifications (the first `token_wise_spans`).
    token_wise: tuple[torch.Tensor, torch.Tensor] | None = None
    token_wise_spans: int | None = None
    # Host copies of the decodes' block tables and seq_lens, for `window_decodes`.
    _decode_tables_host: np.ndarray | None = field(default=None, repr=False)
    _decode_lens_host: np.ndarray | None = field(default=None, repr=False)
    _window_groups: dict[int, DecodeGroup] = field(default_factory=dict, repr=False)

    def window_decodes(self, window: int) -> DecodeGroup:
        """All decodes as one group that gathers only the blocks inside each one's
        last `window` positions (a sliding-window layer on the torch path): row i
        reads its table from the block of position seq_len - window on, so a
        gather costs the window, not the context. Built by the first layer that
        needs it, shared by the rest."""
        group = self._window_groups.get(window)
        if group is None:
            tables, lens = self._decode_tables_host, self._decode_lens_host
            assert tables is not None and lens is not None
            bs = self.block_size
            first_block = np.maximum(lens - window, 0) // bs
            num_blocks = int(((lens - 1) // bs - first_block).max()) + 1
            cols = first_block[:, None] + np.arange(num_blocks)[None, :]
            # Past a row's last block: any entry of its row (hidden by the mask).
            cols = np.minimum(cols, tables.shape[1] - 1)
            rows = np.arange(len(lens))[:, None]
            pos = first_block[:, None] * bs + np.arange(num_blocks * bs)[None, :]
            keep = (pos < lens[:, None]) & (pos >= lens[:, None] - window)
            device = self.slot_mapping.device
            mask = None if keep.all() else _to_device(keep[:, None, None, :], device)
            group = DecodeGroup(None, _to_device(tables[rows, cols], device), num_blocks * bs, mask)
            self._window_groups[window] = group
        return group


def build_attention_metadata(
    query_lens: np.ndarray,
    context_lens: np.ndarray,
    block_tables: np.ndarray,
    slot_mapping: np.ndarray,
    block_size: int,
    device: torch.device,
    prompt_lens: np.ndarray | None = None,
) -> AttentionMetadata:
    """Build a step's metadata from the runner's per-sequence arrays (batch order, all
    1-token queries first). `block_tables` rows may be padded past what a sequence owns;
    only the first ceil(seq_len / block_size) entries of a row are read. `prompt_lens`
    (each sequence's prompt length) only for models that ask (`uses_prompt_lens`)."""
    query_lens = np.asarray(query_lens, dtype=np.int64)
    context_lens = np.asarray(context_lens, dtype=np.int64)
    seq_lens = context_lens + query_lens
    num_seqs = len(query_lens)
    num_decodes = int(np.argmax(query_lens != 1)) if (query_lens != 1).any() else num_seqs
    if (query_lens[num_decodes:] == 1).any():
        raise ValueError("sequences with query_len == 1 must come first in the batch")

    decode_block_tables = None
    decode_seq_lens = None
    decode_groups = []
    if num_decodes:
        dec_lens = seq_lens[:num_decodes]
        dec_blocks = -(-dec_lens // block_size)
        dec_tables = np.ascontiguousarray(
            block_tables[:num_decodes, : int(dec_blocks.max())], dtype=np.int64
        )
        decode_block_tables = _to_device(dec_tables, device)
        decode_seq_lens = _to_device(dec_lens, device)
        for rows in group_decodes(dec_blocks):
            if rows is None:
                group_table, lens, index = decode_block_tables, dec_lens, None
            else:
                lens = dec_lens[rows]
                group_table = _to_device(block_tables[rows, : int(dec_blocks[rows].max())], device)
                index = _to_device(rows, device)
            max_len = int(lens.max())
            group_mask = None
            if int(lens.min()) != max_len:
                keep = np.arange(max_len)[None, :] < lens[:, None]
                group_mask = _to_device(keep[:, None, None, :], device)
            decode_groups.append(DecodeGroup(index, group_table, max_len, group_mask))

    prefills = []
    starts = np.concatenate([[0], np.cumsum(query_lens)])
    for i in range(num_decodes, num_seqs):
        ctx, seq_len = int(context_lens[i]), int(seq_lens[i])
        table = mask = None
        if ctx > 0:
            table = _to_device(block_tables[i, : -(-seq_len // block_size)], device)
            q_pos = np.arange(ctx, seq_len)[:, None]
            mask = _to_device(np.arange(seq_len)[None, :] <= q_pos, device)
        prefills.append(PrefillSpan(int(starts[i]), int(starts[i + 1]), ctx, seq_len, table, mask))

    meta = AttentionMetadata(
        slot_mapping=_to_device(slot_mapping, device, dtype=np.int64),
        num_decodes=num_decodes,
        num_tokens=int(starts[-1]),
        decode_block_tables=decode_block_tables,
        decode_seq_lens=decode_seq_lens,
        decode_groups=decode_groups,
        prefills=prefills,
        block_size=block_size,
        query_lens=query_lens,
        prompt_lens=prompt_lens,
    )
    if num_decodes:
        meta._decode_tables_host, meta._decode_lens_host = dec_tables, dec_lens
    return meta


def group_decodes(num_blocks: np.ndarray) -> list[np.ndarray | None]:
    """Split decodes (each reading `num_blocks[i]` blocks) into groups whose padded
    gathers together hold at most twice the blocks the decodes read: one group
    (None: all, in order) when padding to the longest already does, else groups by
    power-of-two block count, each padded within a factor of two."""
    if len(num_blocks) * int(num_blocks.max()) <= 2 * int(num_blocks.sum()):
        return [None]
    bucket = np.ceil(np.log2(np.maximum(num_blocks, 1))).astype(np.int64)
    order = np.argsort(bucket, kind="stable")
    edges = np.flatnonzero(np.diff(bucket[order])) + 1
    return list(np.split(order, edges))


def _to_device(array: np.ndarray, device: torch.device, dtype: type | None = None) -> torch.Tensor:
    """A host array as a tensor on `device`; int arrays become int64 for indexing."""
    array = np.ascontiguousarray(array, dtype=dtype or (np.int64 if array.dtype != bool else bool))
    return torch.from_numpy(array).to(device, non_blocking=True)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Store the step's k/v [T, Hkv, D] at their cache slots (in the cache's dtype)."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    flat[0].index_copy_(0, slots, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, v.to(kv_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of q [T, Hq, D] over each sequence's cached keys, after writing this
    step's k/v [T, Hkv, D]; returns [T, Hq * D] in q's dtype. `window`: each query
    attends to its last `window` positions only (itself included), as transformers'
    sliding-window layers do; `softcap`: scores pass through cap * tanh(s / cap)
    before the softmax (Gemma 2). `meta.token_wise`: tokens attending one by one as decodes."""
    num_tokens, num_heads, head_dim = q.shape
    write_kv(k, v, kv_cache, meta.slot_mapping)

    outputs = []
    num_decodes = meta.num_decodes
    if num_decodes:
        if window is None and softcap is None:
            outputs.append(_decode_attention(q[:num_decodes], kv_cache, meta, scale))
        else:
            dec = q[:num_decodes]
            outputs.append(_decode_attention_ext(dec, kv_cache, meta, scale, window, softcap))
    spans, tw = meta.prefills, meta.token_wise if softcap is None else None
    if tw is not None and can_use_native_decode(q, kv_cache):  # else prefill spans
        end = num_decodes + len(tw[1])
        outputs.append(_native_decode(q[num_decodes:end], kv_cache, *tw, scale, window or 0))
        spans = spans[len(spans) if meta.token_wise_spans is None else meta.token_wise_spans :]
    for span in spans:
        first, mask = (0, span.mask) if window is None else span.window(window, q.device)
        if span.block_table is None:
            keys, values = k[span.start + first : span.end], v[span.start + first : span.end]
        else:
            table = span.block_table[first // kv_cache.shape[2] :]
            skip = first - first % kv_cache.shape[2]
            kv = kv_cache[:, table].flatten(1, 2)[:, first - skip : span.seq_len - skip].to(q.dtype)
            keys, values = kv[0], kv[1]
        out = _attend(
            q[span.start : span.end].transpose(0, 1),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            mask,
            scale,
            softcap,
        )
        outputs.append(out.transpose(0, 1).reshape(span.end - span.start, num_heads * head_dim))
    if len(outputs) == 1:
        return outputs[0]
    return torch.cat(outputs, dim=0)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """One prefill span: q [Hq, Tq, D] over k/v [Hkv, Tk, D] with a bool mask
    [Tq, Tk] (None: causal, the last query aligned with the last key)."""
    num_heads, num_kv_heads = q.shape[0], k.shape[0]
    if softcap is None:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
    if mask is None:
        tq, tk = q.shape[1], k.shape[1]
        mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
    group = num_heads // num_kv_heads
    qg = q.reshape(num_kv_heads, group * q.shape[1], q.shape[2])
    out = _softcapped(qg, k, v, mask.repeat(group, 1), scale, softcap)
    return out.reshape(q.shape)


def _softcapped(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """Eager attention with logit soft-capping, which SDPA cannot do: scores, then
    cap * tanh(scores / cap), the mask (bool: True = attend, or additive), and a
    float32 softmax as in transformers. q [..., Tq, D], k/v [..., Tk, D]."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def can_use_native_decode(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether decodes run on the Rust kernel: CPU float32 or bfloat16 with a
    contiguous cache. CUDA and float16 take the torch path (gather, then SDPA)."""
    return (
        q.device.type == "cpu"
        and q.dtype in _NATIVE_DTYPES
        and kv_cache.dtype in _NATIVE_DTYPES
        and kv_cache.is_contiguous()
    )


def _decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """All decodes of the step: q [B, Hq, D] over each sequence's cached keys;
    returns [B, Hq * D]."""
    assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
    if can_use_native_decode(q, kv_cache):
        return _native_decode(q, kv_cache, meta.decode_block_tables, meta.decode_seq_lens, scale)
    return _torch_decode(q, kv_cache, meta, scale)


def _decode_attention_ext(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Decodes of a sliding-window or soft-capped layer. The Rust kernel reads only
    the window; soft-capping runs on the torch path."""
    assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
    if softcap is None and can_use_native_decode(q, kv_cache):
        tables, lens = meta.decode_block_tables, meta.decode_seq_lens
        return _native_decode(q, kv_cache, tables, lens, scale, window or 0)
    if window is not None:
        return _torch_decode_group(q, kv_cache, meta.window_decodes(window), scale, softcap)
    out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
    for group in meta.decode_groups:
        part = q if group.rows is None else q.index_select(0, group.rows)
        part = _torch_decode_group(part, kv_cache, group, scale, softcap)
        if group.rows is None:
            return part
        out.index_copy_(0, group.rows, part)
    return out


def _native_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """The Rust kernel, on zero-copy numpy views of the tensors; it releases the GIL
    and splits the (sequence, KV head) pairs over torch's threads (its OpenMP team,
    so no second pool competes with them: rust/kernels/team.rs)."""
    batch, num_heads, head_dim = q.shape
    # The kernel takes q and writes out in float32 (a bfloat16 q widens exactly), and
    # a bfloat16 cache as its bits: numpy has no bfloat16.
    out = torch.empty(batch, num_heads * head_dim, dtype=torch.float32)
    cache = kv_cache if kv_cache.dtype == torch.float32 else kv_cache.view(torch.int16)
    # The kernel runs with the GIL released and reads kv_cache in place. Sound
    # because this is the runner's thread, the only one that writes the cache
    # (write_kv, just before), and `out` is a fresh tensor no one else holds.
    _core._paged_decode_attention(
        out.numpy(),
        q.to(torch.float32).contiguous().numpy(),
        cache.numpy(),
        tables.numpy(),
        seq_lens.numpy(),
        scale,
        torch.get_num_threads(),
        window,
    )
    return out.to(q.dtype)


def _torch_decode(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """All decodes, one batched SDPA per group of similar length; returns [B, Hq * D]."""
    groups = meta.decode_groups
    if len(groups) == 1 and groups[0].rows is None:
        return _torch_decode_group(q, kv_cache, groups[0], scale)
    out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
    for group in groups:
        assert group.rows is not None
        part = _torch_decode_group(q.index_select(0, group.rows), kv_cache, group, scale)
        out.index_copy_(0, group.rows, part)
    return out


def _torch_decode_group(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    group: DecodeGroup,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """One group's decodes in one batched SDPA. The query heads that share a KV head
    are laid out as that head's query rows ([B, Hkv, group, D]), so grouped-query
    attention needs neither repeated K/V nor `enable_gqa`; returns [B, Hq * D]."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[-2]
    tables = group.block_tables
    # One gather for K and V together, into a reused workspace: a fresh multi-MiB
    # tensor per layer costs more in page faults than the copy itself.
    flat = kv_cache.view(2, kv_cache.shape[1], -1)
    out_shape = (2, tables.numel(), flat.shape[2])
    gathered = torch.index_select(flat, 1, tables.view(-1), out=_workspace(out_shape, flat))
    kv = gathered.view(2, batch, -1, num_kv_heads, head_dim)[:, :, : group.max_len]
    kv = kv.transpose(2, 3).to(q.dtype)  # [2, B, Hkv, L, D]
    q = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    mask = group.mask_as(q.dtype)
    if softcap is None:
        out = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, scale=scale)
    else:
        out = _softcapped(q, kv[0], kv[1], mask, scale, softcap)
    return out.reshape(batch, num_heads * head_dim)


_WORKSPACES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _workspace(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A scratch tensor of `shape`, reused across layers and steps (grown on demand);
    its contents are garbage until written."""
    key = (like.dtype, like.device)
    numel = int(np.prod(shape))
    buf = _WORKSPACES.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=like.dtype, device=like.device)
        _WORKSPACES[key] = buf
    return buf[:numel].view(shape)
