"""The validated, layout-normalised form of one paged-attention call (host only).

``api.py`` turns either public call into a :class:`PagedAttention`; every route
(``compat.py``, ``decode.py``, ``context.py``) takes only this, so argument
handling lives in one place and the routes differ only in how they compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedAttention:
    """One call, after validation.

    Attributes
    ----------
    query : Tensor ``[T, Hq, D]`` bf16/fp16
        ``T`` query tokens, request-major.
    k_cache, v_cache : Tensor ``[pages, Hkv, page_size, D]``
        Views in HND order whatever the caller's layout (NHD becomes a
        transposed view); dtype is the query's or ``float8_e4m3fn``.
    k_tables, v_tables : Tensor ``[B, max_pages]`` int32/int64
        Page tables; the same tensor when K and V share page indices.
    seq_lens : Tensor ``[B]`` int32/int64
        KV length of each request, its new tokens included.
    cu_q : Tensor ``[B + 1]`` int32, or None
        Query token offsets of the requests (context); None for decode, whose
        requests all have ``q_len_per_req`` tokens.
    q_len_per_req : int
        Decode: tokens per request; context: 0.
    max_q_len, max_kv_len : int
        Host bounds on the query and KV lengths of any request.
    bmm1_scale, bmm2_scale : float
        ``logit = bmm1_scale * q.k`` (natural-log units); ``out = bmm2_scale * P V``.
    window_left : int
        ``-1``, or keys with position ``< q_pos - window_left`` are masked.
    causal : bool
        Mask keys after the query's position (bottom-right aligned).
    sinks : Tensor ``[Hq]`` fp32, or None
        Per-head logit whose ``exp`` joins the softmax denominator.
    out : Tensor ``[T, Hq, D]`` bf16/fp16
        Written in full.
    lse : Tensor ``[T, Hq]`` fp32, or None
        Natural-log sum of exponentials of the logits, sink included.
    workspace : Tensor, 1-D uint8 view of the caller's workspace.
    """

    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_tables: torch.Tensor
    v_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_q: torch.Tensor | None
    q_len_per_req: int
    max_q_len: int
    max_kv_len: int
    bmm1_scale: float
    bmm2_scale: float
    window_left: int
    causal: bool
    sinks: torch.Tensor | None
    out: torch.Tensor
    lse: torch.Tensor | None
    workspace: torch.Tensor

    @property
    def batch(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k_cache.shape[1]

    @property
    def page_size(self) -> int:
        return self.k_cache.shape[2]

    @property
    def group(self) -> int:
        return self.query.shape[1] // self.k_cache.shape[1]


def cache_rows(cache: torch.Tensor) -> tuple[int, int, int]:
    """``(rows, head_rows, page_rows)`` of ``cache`` ``[pages, Hkv, page_size, D]`` read as
    rows of ``D`` values, one slot stride apart (how a 2-D TMA descriptor addresses it): the
    rows from the cache's first to its last, and the rows between two KV heads and between
    two pages.  Exact where the page and head strides are whole numbers of slot strides,
    which the callers check before they build a descriptor."""
    stride_page, stride_head, stride_slot, _ = cache.stride()
    pages, heads, page_size, _ = cache.shape
    rows = ((pages - 1) * stride_page + (heads - 1) * stride_head) // stride_slot + page_size
    return rows, stride_head // stride_slot, stride_page // stride_slot
