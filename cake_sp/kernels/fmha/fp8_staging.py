"""FP8 K/V pages staged as bf16 in the workspace, for the warp-specialised context kernel.

``context_ws`` reads bf16 K/V tiles by TMA straight into ``wgmma``; it has no FP8 path.
A context call over an FP8 cache under a bf16 query instead copies the keys its requests
own into a bf16 cache in the caller's ``workspace_buffer`` (e4m3 converts to bf16 exactly)
and runs ``context_ws`` on that copy.  The copy moves 5 bytes a key element, small beside
the kernel's ``O(q_len * kv_len)`` arithmetic: on an H200 the whole call took 0.56-0.68x
the time of the ``tl.dot`` kernel over the FP8 cache (docs/results.md).

When the workspace cannot hold every KV head at once, the heads go in chunks of as many as
it holds, one after the other on the caller's stream (each chunk's copy overwrites the
last one's after its attention has read it); a workspace too small for one KV head leaves
the call to the ``tl.dot`` kernel.

Staged layout of a chunk of ``h`` KV heads (``staged_problems``), from the workspace's
start: the page table ``[B, pages]`` int32 (``b * pages + n`` for page ``n`` of request
``b``, written by the copy), then K and V, each ``[B * pages, h, STAGE_PAGE, D]`` bf16 with
``pages = ceil(max_kv_len / STAGE_PAGE)``.  Slots past a request's length are left as they
are: the kernel never lets them reach the output, as with the caller's own unused slots.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from cake_sp.kernels._config import INTERPRET
from cake_sp.kernels.fmha.problem import PagedAttention

# Keys of a staged page: one context_ws key tile, so a tile is one TMA copy.
STAGE_PAGE = 128
# Keys one staging program copies (of one KV head).
STAGE_BLOCK_KEYS = 64
# Where the staged caches start in the workspace: past the page table, TMA-aligned.
_ALIGN = 128


@triton.jit
def _stage_kernel(src_ptr, table_ptr, seq_lens_ptr, dst_ptr, staged_table_ptr,
                  stride_sp, stride_sh, stride_ss, stride_tb, pages_per_request, head0,
                  NUM_KV_HEADS: tl.constexpr, PAGE_SIZE: tl.constexpr, D: tl.constexpr,
                  STAGED_PAGE: tl.constexpr, BLOCK_KEYS: tl.constexpr,
                  WRITE_TABLE: tl.constexpr, INTERPRET: tl.constexpr):
    """Program ``(b * blocks + i, h)``: keys ``[i * BLOCK_KEYS, (i + 1) * BLOCK_KEYS)`` of
    request ``b``, those below ``seq_lens[b]``, of the caller's KV head ``head0 + h``, from
    its cache ``src`` (element strides ``stride_s*``, page table rows ``stride_tb`` apart)
    into head ``h`` of the staged bf16 cache ``dst`` (module docstring).  With
    ``WRITE_TABLE``, the programs of head 0 that start a staged page also write its entry of
    the staged page table."""
    blocks = pages_per_request * (STAGED_PAGE // BLOCK_KEYS)
    b = tl.program_id(0) // blocks
    first = tl.program_id(0) % blocks * BLOCK_KEYS
    keys = first + tl.arange(0, BLOCK_KEYS)
    h = tl.program_id(1)
    staged_page = b * pages_per_request + first // STAGED_PAGE
    if WRITE_TABLE:
        if (h == 0) & (first % STAGED_PAGE == 0):
            tl.store(staged_table_ptr + staged_page, staged_page)
    owned = keys < tl.load(seq_lens_ptr + b)
    page = tl.load(table_ptr + b.to(tl.int64) * stride_tb + keys // PAGE_SIZE, mask=owned,
                   other=0).to(tl.int64)
    cols = tl.arange(0, D)[None, :]
    x = tl.load(src_ptr + (page * stride_sp + (head0 + h) * stride_sh
                           + (keys % PAGE_SIZE) * stride_ss)[:, None] + cols,
                mask=owned[:, None], other=0.0)
    if INTERPRET:
        x = x.to(tl.float32)
    slot = (staged_page.to(tl.int64) * NUM_KV_HEADS + h) * STAGED_PAGE + keys % STAGED_PAGE
    tl.store(dst_ptr + slot[:, None] * D + cols, x.to(tl.bfloat16), mask=owned[:, None])


def _table_bytes(p: PagedAttention) -> int:
    return triton.cdiv(p.batch * triton.cdiv(p.max_kv_len, STAGE_PAGE) * 4, _ALIGN) * _ALIGN


def _head_bytes(p: PagedAttention) -> int:
    """Workspace bytes of one KV head's staged K and V."""
    return 2 * p.batch * triton.cdiv(p.max_kv_len, STAGE_PAGE) * STAGE_PAGE * p.query.shape[2] * 2


def heads_per_chunk(p: PagedAttention) -> int:
    """KV heads of ``p`` the workspace holds staged at once (at most all; 0 for none)."""
    room = p.workspace.numel() - _table_bytes(p)
    return max(0, min(p.num_kv_heads, room // _head_bytes(p)))


def staged_problems(p: PagedAttention) -> list[tuple[int, PagedAttention]]:
    """``(first KV head, chunk)`` for each chunk of ``p`` (a context call over an FP8 cache):
    the call restricted to those KV heads and their query heads, over bf16 caches and a page
    table in the workspace (nothing copied yet: ``stage``).  Every chunk's caches are the
    same bytes.  Empty when the cache is not FP8 or the workspace holds no KV head."""
    chunk = heads_per_chunk(p)
    if p.k_cache.dtype != torch.float8_e4m3fn or chunk == 0:
        return []
    pages = triton.cdiv(p.max_kv_len, STAGE_PAGE)
    table_bytes = _table_bytes(p)
    table = p.workspace[:table_bytes].view(torch.int32)[:p.batch * pages].view(p.batch, pages)
    problems = []
    for head0 in range(0, p.num_kv_heads, chunk):
        heads = min(chunk, p.num_kv_heads - head0)
        shape = (2, p.batch * pages, heads, STAGE_PAGE, p.query.shape[2])
        need = _head_bytes(p) * heads
        k, v = p.workspace[table_bytes:table_bytes + need].view(torch.bfloat16).view(shape)
        q_heads = slice(head0 * p.group, (head0 + heads) * p.group)
        problems.append((head0, dataclasses.replace(
            p, query=p.query[:, q_heads], out=p.out[:, q_heads], k_cache=k, v_cache=v,
            k_tables=table, v_tables=table)))
    return problems


def stage(p: PagedAttention, head0: int, staged: PagedAttention) -> None:
    """Copy the keys ``p``'s requests own, of KV heads ``head0`` onwards, into ``staged``'s
    caches, and write its page table (``staged_problems(p)``)."""
    pages = staged.k_tables.shape[1]
    grid = (p.batch * pages * (STAGE_PAGE // STAGE_BLOCK_KEYS), staged.num_kv_heads)
    for src, table, dst, write_table in ((p.k_cache, p.k_tables, staged.k_cache, True),
                                         (p.v_cache, p.v_tables, staged.v_cache, False)):
        _stage_kernel[grid](
            src, table, p.seq_lens, dst, staged.k_tables, src.stride(0), src.stride(1),
            src.stride(2), table.stride(0), pages, head0, NUM_KV_HEADS=staged.num_kv_heads,
            PAGE_SIZE=p.page_size, D=p.query.shape[2], STAGED_PAGE=STAGE_PAGE,
            BLOCK_KEYS=STAGE_BLOCK_KEYS, WRITE_TABLE=write_table, INTERPRET=INTERPRET)
