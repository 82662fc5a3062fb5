"""Independent oracle and checks for the paged KV-cache append kernels.

Pure torch on the CPU, float64, written from the contract (never calls a
kernel): where each token goes, what each Q/K value is before rounding, which
cache rows a call may write.  The checks then hold a kernel's output to the
rounding of that oracle and every other byte to its poisoned value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from cake_sp.kernels import _config

# Slack for fp32 arithmetic in the kernel (RMSNorm, RoPE, scale division):
# each step is a few fp32 ulps (2**-24) of the row's largest magnitude, so
# 2**-18 of that bounds all of them with room to spare, and stays far below
# half an ulp of bf16 (2**-9 relative) or FP8 e4m3 (2**-4 relative).
FP32_SLACK = 2.0**-18
# (mantissa bits, smallest normal exponent, largest finite) per output format.
FORMATS = {"bf16": (7, -126, math.inf), "fp8": (3, -6, 448.0)}
TORCH_FORMATS = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


# ----------------------------------------------------------------------------- launches


def force_programs(monkeypatch, programs: str) -> None:
    """Make every BF16 append launch of the test take ``programs``: ``"token"`` (one token, a
    run of head slots a program) or ``"tile"`` (tokens of one slot a program), whatever the
    table would pick for the batch."""
    monkeypatch.setattr(_config, "append_token_programs",
                        lambda num_tokens, num_requests: programs == "token")


# ----------------------------------------------------------------------------- inputs


@dataclass
class Case:
    """One call's metadata: ``new[b]`` tokens appended to a prefix of ``prefix[b]``."""

    new: list[int]
    prefix: list[int]
    page_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int = 128
    spare_pages: int = 3
    max_pos: int = 0
    seq_lens: torch.Tensor = field(init=False)
    q_indptr: torch.Tensor = field(init=False)
    page_indices: torch.Tensor = field(init=False)
    num_pages: int = field(init=False)

    def __post_init__(self) -> None:
        self.seq_lens = torch.tensor([p + n for p, n in zip(self.prefix, self.new, strict=True)],
                                     dtype=torch.int32)
        self.q_indptr = torch.tensor([0] + list(torch.tensor(self.new).cumsum(0).tolist()),
                                     dtype=torch.int32)
        pages_per_req = [max(1, -(-int(s) // self.page_size)) for s in self.seq_lens]
        max_pages = max(pages_per_req) + 1
        self.num_pages = sum(pages_per_req) + self.spare_pages
        # Distinct pages in a shuffled order; unused table slots hold junk that
        # must never be read (out of range on purpose).
        perm = torch.randperm(self.num_pages).to(torch.int32)
        table = torch.full((len(self.new), max_pages), 10**6, dtype=torch.int32)
        used = 0
        for b, n in enumerate(pages_per_req):
            table[b, :n] = perm[used:used + n]
            used += n
        self.page_indices = table
        self.max_pos = self.max_pos or int(self.seq_lens.max()) + 5

    @property
    def num_tokens(self) -> int:
        """``T``: rows of ``qkv``, fixed at construction (a test may then break ``q_indptr``)."""
        return sum(self.new)

    @property
    def num_slots(self) -> int:
        return self.num_q_heads + 2 * self.num_kv_heads


def rope_table(max_pos: int, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """fp32 ``[max_pos, D]``: cos of the ``D/2`` frequencies, then their sin."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=1).float()


def poisoned(shape, dtype: torch.dtype) -> torch.Tensor:
    """Random bytes (NaN patterns included): any byte a kernel should not write stays this."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, itemsize), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


# ----------------------------------------------------------------------------- oracle


@dataclass
class Targets:
    """Where the tokens go: per token ``req``, ``r``, ``pos``, ``page``, ``row`` and whether
    it may be written; per request the status bits and the cleared tail ``(page, start)``."""

    req: list[int]
    r: list[int]
    pos: list[int]
    page: list[int]
    row: list[int]
    writable: list[bool]
    page_ok: list[bool]
    status: list[int]
    tails: list[tuple[int, int]]


def plan_targets(case: Case, *, max_req_len: int | None = None, clear: bool = True) -> Targets:
    """The contract's addressing, token by token (``ERR_*`` bits as in ``paged_append``)."""
    indptr = case.q_indptr.tolist()
    seq_lens = case.seq_lens.tolist()
    table = case.page_indices.tolist()
    num_req, ps = len(seq_lens), case.page_size
    valid = indptr[0] == 0 and indptr[-1] == case.num_tokens and all(
        0 <= indptr[b + 1] - indptr[b] <= (max_req_len or 2**31) for b in range(num_req))
    t = Targets([], [], [], [], [], [], [], [], [])
    for b in range(num_req):
        n, s = indptr[b + 1] - indptr[b], seq_lens[b]
        pos_ok = s >= n and s <= case.max_pos and (s - 1) // ps < len(table[b])
        status = 0 if valid else 1
        if valid and n > 0 and not pos_ok:
            status |= 2
        if valid and n > 0 and pos_ok:
            slots = range((s - n) // ps, (s - 1) // ps + 1)
            if any(not 0 <= table[b][j] < case.num_pages for j in slots):
                status |= 4
        # FlashInfer's rule: every request of length >= 1 clears its last page's tail, also
        # one that appends nothing now (if its last row is inside the page table).
        if clear and valid and s >= 1 and (s - 1) // ps < len(table[b]) and (n == 0 or pos_ok):
            last = table[b][(s - 1) // ps]
            if 0 <= last < case.num_pages and s % ps:
                t.tails.append((last, s % ps))
        t.status.append(status)
        for r in range(n if valid else 0):
            pos = r + s - n
            t.req.append(b)
            t.r.append(r)
            t.pos.append(pos)
            t.writable.append(pos_ok)
            page = table[b][pos // ps] if pos_ok else -1
            t.page.append(page)
            t.row.append(pos % ps)
            t.page_ok.append(pos_ok and 0 <= page < case.num_pages)
    if not valid:  # no token has a place: every row stays untouched
        t.writable = [False] * case.num_tokens
    return t


def _rope64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    half = x.shape[-1] // 2
    if style == "neox":
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)


def _rmsnorm64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_qk(qkv: torch.Tensor, cos_sin: torch.Tensor, case: Case, targets: Targets, *,
                 policy: int, q_norm_weight, k_norm_weight, eps: float, rope_style: str):
    """Unrounded float64 Q ``[T, Hq, D]`` and K ``[T, Hkv, D]`` of the valid tokens
    (rows of tokens that are not written are NaN), and V ``[T, Hkv, D]`` as given."""
    hq, hkv, d = case.num_q_heads, case.num_kv_heads, case.head_dim
    x = qkv.cpu().double().view(-1, hq + 2 * hkv, d)
    pos = torch.tensor(targets.pos, dtype=torch.long)
    table = cos_sin.cpu().double()[pos.clamp(0, case.max_pos - 1)]
    cos, sin = table[:, None, : d // 2], table[:, None, d // 2:]

    def transform(h: torch.Tensor, w) -> torch.Tensor:
        w = None if w is None else w.cpu().double()
        if policy == 2:
            h = _rmsnorm64(h, w, eps)
        h = _rope64(h, cos, sin, rope_style)
        if policy == 1:
            h = _rmsnorm64(h, w, eps)
        return h

    q = transform(x[:, :hq], q_norm_weight)
    k = transform(x[:, hq:hq + hkv], k_norm_weight)
    dead = ~torch.tensor(targets.writable, dtype=torch.bool)
    q[dead] = math.nan
    k[dead] = math.nan
    return q, k, qkv.cpu().view(-1, hq + 2 * hkv, d)[:, hq + hkv:]


# ----------------------------------------------------------------------------- checks


def rounding_violations(out: torch.Tensor, ref: torch.Tensor, fmt: str) -> tuple[int, int, str]:
    """Hold ``out`` (bf16 or FP8 values) to the correct rounding of float64 ``ref``.

    An element passes when ``|out - ref| <= ulp(ref) / 2 + FP32_SLACK * rowmax``:
    the nearest-even result, or its neighbour when ``ref`` sits within fp32
    error of a rounding midpoint.  FP8 saturates: ``ref`` beyond 448 is clamped.
    Returns ``(violations, one_ulp_flips, worst)``: flips are passing elements
    that differ from ``ref`` rounded in float64, reported, never hidden.
    """
    mant, emin, top = FORMATS[fmt]
    ref = ref.double().clamp(-top, top)
    got = out.cpu().double()
    exp = torch.floor(torch.log2(ref.abs().clamp_min(2.0**emin)))
    half_ulp = torch.exp2(exp - mant) / 2
    slack = FP32_SLACK * ref.abs().amax(-1, keepdim=True)
    err = (got - ref).abs()
    bad = ~(err <= half_ulp + slack)
    worst = ""
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        worst = (f"first at flat index {i}: got {got.flatten()[i].item()!r}, "
                 f"ref {ref.flatten()[i].item()!r}, half ulp {half_ulp.flatten()[i].item()!r}")
    flips = int((out.cpu() != ref.to(TORCH_FORMATS[fmt])).sum()) - int(bad.sum())
    return int(bad.sum()), flips, worst


def assert_rounded(out: torch.Tensor, ref: torch.Tensor, fmt: str, what: str,
                   record=None) -> None:
    """``rounding_violations`` as an assertion; ``record`` (pytest's ``record_property``)
    receives the one-ulp flip count."""
    bad, flips, worst = rounding_violations(out, ref, fmt)
    assert bad == 0, f"{what}: {bad} of {out.numel()} elements off the {fmt} rounding; {worst}"
    if record is not None:
        record(f"{what}_one_ulp_flips", flips)


def cache_index(case: Case, kv_layout: str, page: int, row: int, head: int):
    """Index of one ``[D]`` vector of a cache in either layout."""
    return (page, row, head) if kv_layout == "NHD" else (page, head, row)


def expected_cache(before: torch.Tensor, after: torch.Tensor, case: Case, targets: Targets,
                   kv_layout: str, written: bool) -> tuple[torch.Tensor, list[tuple]]:
    """What a cache must hold after the call, byte for byte, except the values of the
    rows the call writes, taken from ``after`` (their values are checked apart).

    Returns the expected cache and the written ``(t, head, index)`` triples.
    """
    expect = before.clone()
    for page, start in targets.tails:
        for row in range(start, case.page_size):
            for h in range(case.num_kv_heads):
                expect[cache_index(case, kv_layout, page, row, h)] = 0
    rows = []
    if written:
        for t, (ok, page, row) in enumerate(zip(targets.page_ok, targets.page, targets.row,
                                                strict=True)):
            if ok:
                for h in range(case.num_kv_heads):
                    idx = cache_index(case, kv_layout, page, row, h)
                    expect[idx] = after[idx]
                    rows.append((t, h, idx))
    return expect, rows


def assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bytes equal (NaN payloads included)."""
    g = got.cpu().contiguous().view(torch.uint8)
    w = want.cpu().contiguous().view(torch.uint8)
    diff = (g != w)
    assert not diff.any(), (f"{what}: {int(diff.sum())} bytes differ, first at byte "
                            f"{int(diff.flatten().nonzero()[0])}")


def check_call(case: Case, targets: Targets, kv_layout: str, fmt: str, *, q_out, q_before,
               q_ref, k_ref, v_want, caches, caches_before, outs, outs_before,
               record=None) -> None:
    """Everything one call may and may not have written.

    ``q_ref`` / ``k_ref``: float64 values before rounding to ``fmt`` (in the
    output's scale); ``v_want``: V exactly as it must be stored ``[T, Hkv, D]``.
    ``outs`` / ``outs_before``: ``(out_k, out_v)`` after and before (None when the
    cache took the rows).  Untouched bytes are compared bitwise to the poison.
    """
    ok = torch.tensor(targets.writable, dtype=torch.bool)
    q_out, q_before = q_out.cpu(), q_before.cpu()
    if ok.any():
        assert_rounded(q_out[ok], q_ref[ok], fmt, "q", record)
    assert_bitwise(q_out[~ok], q_before[~ok], "out_q rows the call may not write")
    for name, i, ref in (("k", 0, k_ref), ("v", 1, None)):
        cache, before, out, out_before = caches[i].cpu(), caches_before[i], outs[i], outs_before[i]
        expect, rows = expected_cache(before, cache, case, targets, kv_layout, out is None)
        assert_bitwise(cache, expect, f"{name} cache outside the rows it writes")
        if out is not None:
            out = out.cpu()
            assert_bitwise(out[~ok], out_before[~ok], f"out_{name} rows the call may not write")
            got, t_rows = out[ok], ok
        else:
            if not rows:
                continue
            got = torch.stack([cache[idx] for (_, _, idx) in rows])
            t_rows = ([t for (t, _, _) in rows], [h for (_, h, _) in rows])
        if got.numel() == 0:
            continue
        if ref is not None:
            assert_rounded(got, ref[t_rows], fmt, name, record)
        else:
            assert_bitwise(got, v_want[t_rows], "v (must be exact)")
