"""``compat_v1``: the complete-domain paged attention route (plain torch, fp32).

Gathers each request's pages into a padded ``[B, N, Hkv, D]`` tensor, forms
every query's logits in fp32, masks, and applies a softmax whose denominator
also holds the sink.  It serves every valid call, is the fallback when the
Triton routes cannot, and is the oracle the Triton routes are tested against.

It never reads a device value on the host (no ``.item()``, no data-dependent
shapes), so it can be captured in a CUDA graph; it allocates its temporaries
from the caching allocator, which graph capture handles through its pool.
"""

from __future__ import annotations

import torch

from cake_sp.kernels.fmha.problem import PagedAttention


def _gather_pages(cache: torch.Tensor, tables: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Keys ``[0, num_keys)`` of each request as fp32 ``[B, N, Hkv, D]``."""
    page_size = cache.shape[2]
    pos = torch.arange(num_keys, device=cache.device)
    pages = tables[:, pos // page_size].long()
    return cache[pages, :, (pos % page_size)[None, :]].float()


def compat_attention(p: PagedAttention) -> None:
    """Compute ``p`` into ``p.out`` (and ``p.lse``) with the fp32 formula.

    For query token ``i`` of request ``b`` (``q_pos = kv_len_b - q_len_b + i``)
    and head ``h`` with KV head ``h // group``::

        s_n = bmm1_scale * q . k_n      for allowed keys n, else -inf
        m   = max(max_n s_n, sink_h)
        d   = sum_n exp(s_n - m) + exp(sink_h - m)
        out = bmm2_scale * sum_n exp(s_n - m) v_n / d,   lse = m + log(d)

    A row with no allowed key and no sink gets ``out = 0``, ``lse = -inf``.
    """
    dev = p.query.device
    batch, max_q, max_kv = p.batch, p.max_q_len, p.max_kv_len
    num_tokens, num_heads, head_dim = p.query.shape
    hkv, group = p.num_kv_heads, p.group
    if p.cu_q is None:
        cu_q = torch.arange(batch + 1, device=dev, dtype=torch.int64) * p.q_len_per_req
    else:
        cu_q = p.cu_q.long()
    q_lens = cu_q[1:] - cu_q[:-1]
    kv_lens = p.seq_lens.long()

    # Pad the queries to [B, max_q]: row (b, i) reads token cu_q[b] + i (clamped).
    i_idx = torch.arange(max_q, device=dev)
    tok = (cu_q[:-1, None] + i_idx[None, :]).clamp(max=max(num_tokens - 1, 0))
    q = p.query[tok].float().view(batch, max_q, hkv, group, head_dim)
    k = _gather_pages(p.k_cache, p.k_tables, max_kv)
    v = _gather_pages(p.v_cache, p.v_tables, max_kv)

    s = torch.einsum("bikgd,bnkd->bkgin", q, k) * p.bmm1_scale  # [B, Hkv, G, max_q, N]
    n_idx = torch.arange(max_kv, device=dev)
    q_pos = (kv_lens - q_lens)[:, None] + i_idx[None, :]  # [B, max_q]
    allowed = n_idx[None, None, :] < kv_lens[:, None, None]
    if p.causal:
        allowed = allowed & (n_idx[None, None, :] <= q_pos[:, :, None])
    if p.window_left >= 0:
        allowed = allowed & (n_idx[None, None, :] >= q_pos[:, :, None] - p.window_left)
    s = s.masked_fill(~allowed[:, None, None], float("-inf"))

    m = s.amax(dim=-1)
    if p.sinks is not None:
        sink = p.sinks.float().view(1, hkv, group, 1).expand_as(m)
        m = torch.maximum(m, sink)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m_safe[..., None])
    denom = e.sum(dim=-1)
    if p.sinks is not None:
        denom = denom + torch.exp(sink - m_safe)
    o = torch.einsum("bkgin,bnkd->bikgd", e, v)
    inv = torch.where(denom > 0, p.bmm2_scale / denom, torch.zeros_like(denom))
    o = o * inv.permute(0, 3, 1, 2)[..., None]
    lse = m_safe + torch.log(denom)  # [B, Hkv, G, max_q]

    # Scatter back: token t belongs to request b_t at row i_t.
    t_idx = torch.arange(num_tokens, device=dev)
    b_t = torch.searchsorted(cu_q[1:], t_idx, right=True).clamp(max=batch - 1)
    i_t = (t_idx - cu_q[b_t]).clamp(0, max(max_q - 1, 0))
    p.out.copy_(o[b_t, i_t].reshape(num_tokens, num_heads, head_dim))
    if p.lse is not None:
        p.lse.copy_(lse.permute(0, 3, 1, 2)[b_t, i_t].reshape(num_tokens, num_heads))
