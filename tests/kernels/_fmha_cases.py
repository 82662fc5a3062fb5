"""Inputs and an independent float64 oracle for the paged FMHA tests.

``make_call`` draws fresh random inputs for one :class:`FmhaCase` (pages placed
at random in a pool larger than needed, ragged lengths) and returns the public
call's keyword arguments; ``oracle_fp64`` recomputes the contract one request,
token and head at a time in float64 straight from the caller's tensors (it
never touches ``cake_sp``), so it can judge the compat route itself.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

import cake_sp

# Tolerances on bf16/fp16 outputs against an fp32/fp64 result: one final
# rounding (bf16 2**-9, fp16 2**-12 relative) plus, on a GPU, the rounding of
# the softmax probabilities to 16 bits before the P @ V tensor-core dot (the
# same relative size, averaged over the keys), so a few ulps of either format.
TOLERANCES = {torch.bfloat16: (1e-2, 1e-2), torch.float16: (3e-3, 3e-3)}
# LSE is fp32 on every route; its error is the fp32 dot-product error of a
# logit (|logit| <~ 10, D <= 256 terms), far below this.
LSE_ATOL = 1e-4
POISON = float("nan")


@dataclass(frozen=True)
class FmhaCase:
    """One call shape.  ``q_lens`` is per request (decode: all ``q_len_per_req``)."""

    op: str = "decode"
    q_dtype: torch.dtype = torch.bfloat16
    fp8_kv: bool = False
    kv_layout: str = "HND"
    head_dim: int = 64
    num_kv_heads: int = 2
    group: int = 2
    page_size: int = 16
    kv_lens: tuple[int, ...] = (1, 16, 37)
    q_lens: tuple[int, ...] = (1, 1, 1)
    window_left: int = -1
    sinks: bool = False
    lse: bool = False
    split_tables: bool = False
    causal: bool = True
    tuple_kv: bool = False

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.group

    def label(self) -> str:
        kv = "fp8" if self.fp8_kv else str(self.q_dtype).removeprefix("torch.")
        return (f"{self.op}-{kv}-{self.kv_layout}-D{self.head_dim}-G{self.group}"
                f"-P{self.page_size}-q{max(self.q_lens)}-w{self.window_left}"
                f"-s{int(self.sinks)}-l{int(self.lse)}-t{int(self.split_tables)}"
                f"-c{int(self.causal)}")


def _page_table(gen, batch, max_pages, num_pages, pages_needed):
    table = torch.full((batch, max_pages), -1, dtype=torch.int32)
    perm = torch.randperm(num_pages, generator=gen)
    at = 0
    for b, n in enumerate(pages_needed):
        table[b, :n] = perm[at:at + n]
        at += n
    # Unused entries point at a random (possibly foreign) page: never read.
    unused = table < 0
    table[unused] = torch.randint(0, num_pages, (int(unused.sum()),), generator=gen,
                                  dtype=torch.int32)
    return table


def make_call(case: FmhaCase, device: torch.device, seed: int = 0) -> dict:
    """Fresh random inputs for ``case``: the public call's keyword arguments."""
    gen = torch.Generator().manual_seed(seed)
    batch, ps, d = len(case.kv_lens), case.page_size, case.head_dim
    pages_needed = [math.ceil(n / ps) for n in case.kv_lens]
    max_pages = max(pages_needed) + 1
    num_pages = sum(pages_needed) + 3
    hkv, hq = case.num_kv_heads, case.num_heads
    kv_dtype = torch.float8_e4m3fn if case.fp8_kv else case.q_dtype
    shape = (num_pages, 2, hkv, ps, d) if case.kv_layout == "HND" else (num_pages, 2, ps, hkv, d)
    kv = torch.randn(shape, generator=gen).to(kv_dtype).to(device)
    kv_cache = (kv[:, 0].contiguous(), kv[:, 1].contiguous()) if case.tuple_kv else kv
    k_table = _page_table(gen, batch, max_pages, num_pages, pages_needed)
    if case.split_tables:
        v_table = _page_table(gen, batch, max_pages, num_pages, pages_needed)
        block_tables = torch.stack([k_table, v_table], dim=1)
    else:
        block_tables = k_table
    num_tokens = sum(case.q_lens)
    query = torch.randn(num_tokens, hq, d, generator=gen).to(case.q_dtype).to(device)
    # fp8 KV: pretend per-tensor dequant scales 0.5 (K) and 0.75 (V), folded in.
    k_scale, v_scale = (0.5, 0.75) if case.fp8_kv else (1.0, 1.0)
    kwargs = dict(
        query=query, kv_cache=kv_cache,
        # 32 MiB holds the split-KV partials of every case here (callers pass 128 MiB);
        # left uninitialised, as a caller's may be: no kernel may read what it did not write.
        workspace_buffer=torch.empty(1 << 25, dtype=torch.uint8, device=device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(case.kv_lens, dtype=torch.int32, device=device),
        bmm1_scale=k_scale / math.sqrt(d), bmm2_scale=v_scale, window_left=case.window_left,
        out=torch.full_like(query, POISON), kv_layout=case.kv_layout,
        uses_shared_paged_kv_idx=not case.split_tables,
        sinks=(torch.randn(hq, generator=gen) * 2).to(device) if case.sinks else None,
        lse=torch.full((num_tokens, hq), POISON, device=device) if case.lse else None,
    )
    if case.op == "decode":
        kwargs.update(max_seq_len=max(case.kv_lens), q_len_per_req=case.q_lens[0])
    else:
        cu_q = torch.tensor([0, *torch.tensor(case.q_lens).cumsum(0).tolist()], dtype=torch.int32)
        cu_kv = torch.tensor([0, *torch.tensor(case.kv_lens).cumsum(0).tolist()],
                             dtype=torch.int32)
        kwargs.update(max_q_len=max(case.q_lens), max_kv_len=max(case.kv_lens),
                      batch_size=batch, cum_seq_lens_q=cu_q.to(device),
                      cum_seq_lens_kv=cu_kv.to(device), causal=case.causal)
    return kwargs


def poison_unowned_slots(case: FmhaCase, kw: dict) -> None:
    """NaN into every K and V cache slot that no request's keys occupy (through its own page
    table): the slots past each request's length in its last page, and whole unused pages."""
    kv = kw["kv_cache"]
    caches = kv if isinstance(kv, tuple) else (kv[:, 0], kv[:, 1])
    tables = kw["block_tables"].cpu()
    for cache, table in zip(caches, (tables, tables) if tables.ndim == 2 else tables.unbind(1)):
        host = cache.cpu()
        by_slot = host.transpose(1, 2) if case.kv_layout == "HND" else host  # [pages, ps, ...]
        owned = torch.zeros(by_slot.shape[:2], dtype=torch.bool)
        for b, kv_len in enumerate(case.kv_lens):
            for n in range(kv_len):
                owned[int(table[b, n // case.page_size]), n % case.page_size] = True
        if host.dtype == torch.float8_e4m3fn:  # no masked fill on FP8: its NaN by bits
            by_slot.view(torch.uint8)[~owned] = 0x7F
        else:
            by_slot[~owned] = float("nan")
        cache.copy_(host)


def call(case: FmhaCase, kwargs: dict):
    """Run the public function of ``case.op`` on ``kwargs``."""
    fn = cake_sp.batch_decode_with_kv_cache if case.op == "decode" else \
        cake_sp.batch_context_with_kv_cache
    return fn(**kwargs)


def oracle_fp64(case: FmhaCase, kw: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` fp64 on the CPU, one request and query token at a time, from the contract."""
    kv = kw["kv_cache"]
    k_all, v_all = (kv if isinstance(kv, tuple) else (kv[:, 0], kv[:, 1]))
    if case.kv_layout == "NHD":  # -> [pages, Hkv, page_size, D]
        k_all, v_all = k_all.transpose(1, 2), v_all.transpose(1, 2)
    k_all, v_all = k_all.cpu().double(), v_all.cpu().double()
    tables = kw["block_tables"].cpu()
    k_tab, v_tab = (tables, tables) if tables.ndim == 2 else (tables[:, 0], tables[:, 1])
    q = kw["query"].cpu().double()
    ps, group = case.page_size, case.group
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.zeros(q.shape[:2], dtype=torch.float64)
    sinks = kw["sinks"].cpu().double() if kw["sinks"] is not None else None

    t = 0
    for b, (q_len, kv_len) in enumerate(zip(case.q_lens, case.kv_lens, strict=True)):
        if q_len == 0:  # a request with no query tokens has no output rows (nor, maybe, keys)
            continue
        # Key n of request b: slot n % ps of page table[b, n // ps]; heads repeated per group.
        k = torch.stack([k_all[int(k_tab[b, n // ps]), :, n % ps] for n in range(kv_len)])
        v = torch.stack([v_all[int(v_tab[b, n // ps]), :, n % ps] for n in range(kv_len)])
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        for i in range(q_len):
            q_pos = kv_len - q_len + i
            keys = [n for n in range(kv_len)
                    if (not case.causal or n <= q_pos)
                    and (case.window_left < 0 or n >= q_pos - case.window_left)]
            logits = kw["bmm1_scale"] * torch.einsum("nhd,hd->hn", k[keys], q[t])
            if sinks is not None:
                logits = torch.cat([logits, sinks[:, None]], dim=1)
            lse[t] = torch.logsumexp(logits, 1)
            p = torch.exp(logits - lse[t][:, None])[:, : len(keys)]
            out[t] = kw["bmm2_scale"] * torch.einsum("hn,nhd->hd", p, v[keys])
            t += 1
    return out, lse


def assert_matches(case: FmhaCase, kw: dict, result, ref_out: torch.Tensor,
                   ref_lse: torch.Tensor | None) -> None:
    """``result`` (the call's return) against a reference, every element written."""
    out = result[0] if isinstance(result, tuple) else result
    assert out is kw["out"]
    assert not out.isnan().any(), "output left unwritten (poison survived)"
    atol, rtol = TOLERANCES[case.q_dtype]
    torch.testing.assert_close(out.cpu().double(), ref_out.cpu().double(), atol=atol, rtol=rtol)
    if case.lse:
        assert not kw["lse"].isnan().any(), "lse left unwritten (poison survived)"
        torch.testing.assert_close(kw["lse"].cpu().double(), ref_lse.cpu().double(),
                                   atol=LSE_ATOL, rtol=0)


# Feature mixes cycled over the shape grid so that every shape meets several
# features and every feature meets every dtype and layout.
_FEATURES = (
    dict(),
    dict(window_left=5, sinks=True, lse=True),
    dict(split_tables=True, lse=True, tuple_kv=True),
    dict(sinks=True, window_left=0),
    dict(lse=True, window_left=20, split_tables=True),
)


def shape_grid(op: str) -> list[FmhaCase]:
    """Every q dtype / fp8 x layout x D x group x page-size class, features cycled.

    Lengths are ragged and include 1 (decode) and exact page multiples.  Decode
    alternates q_len_per_req 1 and 4; context alternates causal and not.
    """
    cases = []
    kinds = ((torch.bfloat16, False), (torch.float16, False), (torch.bfloat16, True))
    i = 0
    for q_dtype, fp8 in kinds:
        for layout in ("HND", "NHD"):
            for d in (64, 128, 256):
                for group, hkv in ((1, 3), (3, 2), (16, 1)):
                    for ps in (1, 16, 5):
                        feat = dict(_FEATURES[i % len(_FEATURES)])
                        if op == "decode":
                            q_len = 4 if i % 2 else 1
                            lens = dict(kv_lens=(q_len, max(2 * ps, q_len), 37),
                                        q_lens=(q_len,) * 3)
                        else:
                            lens = dict(kv_lens=(9, ps * 3, 40), q_lens=(5, 1, 17),
                                        causal=i % 2 == 0)
                        cases.append(FmhaCase(op=op, q_dtype=q_dtype, fp8_kv=fp8,
                                              kv_layout=layout, head_dim=d, num_kv_heads=hkv,
                                              group=group, page_size=ps, **lens, **feat))
                        i += 1
    return cases


@contextlib.contextmanager
def one_thread():
    """Run torch on one intra-op thread: these tensors are tiny, and on a small
    shared CI host extra threads only contend."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
