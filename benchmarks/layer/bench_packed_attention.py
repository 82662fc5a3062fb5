"""The layer's attention core on packed sequences (``cu_seqlens``) or with a key mask
(``key_mask``), on one GPU, beside what transformers' SDPA path does with the same mask and
the attention of the real tokens alone.

    python benchmarks/layer/bench_packed_attention.py [--rows all|keys|smoke] [--json out.json]

One rank's head band after the exchange: ``q [1, S, 8, 128]``, ``k, v [1, S, 2, 128]`` bf16
(GQA 32/8 at W = 4), causal, the ``S`` tokens split into ``N`` documents; or ``padded N``
rows, whose last ``N`` keys are masked (a row padded to a multiple of the world size, a text
encoder's padding), causal GQA as above or bidirectional MHA (``k, v [1, S, 8, 128]``, the
diffusion drop-ins' joint attention); or ``ragged N``, two such rows (``B = 2``) padded by
``N`` and ``N / 2`` keys (a batch of texts of different lengths).  Arms:

* ``cake_sp``: ``cake_sp.attention.attention(..., backend="sdpa", cu_seqlens= or
  key_mask=...)``, what ``UlyssesAttention`` runs without flash-attn: compiled
  ``flex_attention`` with the documents' (or the keys') block mask (built by the first call,
  then cached, as in a model's layers); SDPA with a ``[B, 1, 1, S]`` mask for a key mask
  without causality or GQA; each row's kept keys alone, with no mask, where rows are padded
  at their end;
* ``dense_mask``: K/V repeated to every Q head, then SDPA with the ``[B, 1, S, S]`` boolean
  mask: what transformers' SDPA attention runs on packed sequences or padded keys;
* ``per_sequence``: one SDPA call per document (cake_sp's CPU path), or over each padded
  row's real tokens alone: what the mask would cost at best;
* ``unpacked``: one SDPA call over the whole row, no mask (not the same math: the cost the
  call would have without a mask, for scale).

The masked arms are first checked against ``dense_mask`` (relative error).  A sample is one
call (forward, or forward + backward of ``sum(o * do)``) timed by CUDA events; a row's time
is the median over ``A B C C B A`` rounds.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from _one_gpu import run_rows, time_ms

from cake_sp.attention import attention

HQ, HKV, HEAD_DIM = 8, 2, 128
ROWS = {
    # (S, kind, N, causal): documents "equal N" or "random N" (causal GQA); "padded N" keys
    # (causal GQA, or bidirectional MHA).
    "all": [(s, kind, n, True) for s in (8192, 32768) for kind, n in
            (("equal", 1), ("equal", 8), ("random", 64), ("equal", 512))],
    "keys": [(s, kind, s // 16, causal) for s in (8192, 32768) for kind in ("padded", "ragged")
             for causal in (True, False)],
    "smoke": [(2048, "equal", 4, True), (2048, "padded", 100, True),
              (2048, "ragged", 100, False)],
}


def _lengths(seq: int, kind: str, n: int, g: torch.Generator) -> list[int]:
    if kind == "equal":
        return [seq // n] * n
    cuts = torch.randperm(seq - 1, generator=g)[:n - 1].add(1).sort().values.tolist()
    return [b - a for a, b in zip([0, *cuts], [*cuts, seq])]


def _masks(seq: int, kind: str, n: int, causal: bool, g: torch.Generator):
    """``(cu_seqlens, key_mask, allowed, spans)`` of ``B`` rows: the layer's argument (the
    other None; ``key_mask [B, S]``), the dense ``[B, S, S]`` bool mask it means (both on the
    CPU), and the ``(row, start, end)`` token spans the ``per_sequence`` arm attends alone."""
    causal_mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    if kind in ("padded", "ragged"):
        real = [seq - n] if kind == "padded" else [seq - n, seq - n // 2]
        key_mask = torch.stack([torch.arange(seq) < r for r in real])
        allowed = key_mask[:, None, :] & causal_mask if causal \
            else key_mask[:, None, :].expand(-1, seq, -1)
        return None, key_mask, allowed, [(b, 0, r) for b, r in enumerate(real)]
    lengths = _lengths(seq, kind, n, g)
    cu_seqlens = tuple(torch.tensor([0, *lengths]).cumsum(0).tolist())
    document = torch.repeat_interleave(torch.arange(n), torch.tensor(lengths))
    allowed = (document[:, None] == document[None, :]) & causal_mask
    return cu_seqlens, None, allowed[None], [(0, a, b) for a, b in zip(cu_seqlens, cu_seqlens[1:])]


def bench_row(seq: int, kind: str, n: int, causal: bool, rounds: int) -> dict:
    g = torch.Generator().manual_seed(seq + n)
    kv_heads = HKV if causal else HQ
    cu_seqlens, key_mask, allowed, spans = _masks(seq, kind, n, causal, g)
    key_mask, allowed = (None if key_mask is None else key_mask.cuda()), allowed.cuda()
    batch = allowed.shape[0]
    q, k, v = (torch.randn(batch, seq, h, HEAD_DIM, generator=g).cuda().bfloat16()
               .requires_grad_() for h in (HQ, kv_heads, kv_heads))
    do = torch.randn(batch, seq, HQ, HEAD_DIM, generator=g).cuda().bfloat16()

    whole = [(b, 0, seq) for b in range(batch)]

    def run(arm: str) -> list[torch.Tensor]:
        """The arm's output, one ``[1, e - a, Hq, D]`` piece per span ``(b, a, e)`` of
        ``pieces(arm)``."""
        if arm == "per_sequence":
            return [attention(*(t[b:b + 1, a:e] for t in (q, k, v)), causal=causal,
                              softmax_scale=None, backend="sdpa") for b, a, e in spans]
        return list(run_whole(arm).split(1))

    def pieces(arm: str) -> list[tuple[int, int, int]]:
        return spans if arm == "per_sequence" else whole

    def run_whole(arm: str) -> torch.Tensor:
        if arm == "cake_sp":
            return attention(q, k, v, causal=causal, softmax_scale=None, backend="sdpa",
                             cu_seqlens=cu_seqlens, key_mask=key_mask)
        if arm == "dense_mask":  # as transformers: K/V repeated, then SDPA with the mask
            k_rep, v_rep = (t.repeat_interleave(HQ // kv_heads, dim=2).transpose(1, 2)
                            for t in (k, v))
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k_rep, v_rep,
                                               attn_mask=allowed[:, None])
            return o.transpose(1, 2)
        return attention(q, k, v, causal=causal, softmax_scale=None, backend="sdpa")

    label = f"{kind} {n}" + ("" if causal else ", bidirectional MHA")
    row = {"seq": seq, "documents": label}
    with torch.no_grad():
        want = run_whole("dense_mask").float()
        for arm in ("cake_sp", "per_sequence"):  # per_sequence: a padded row's real tokens
            got = torch.cat([o.float().flatten() for o in run(arm)])
            ref = torch.cat([want[b, a:e].flatten() for b, a, e in pieces(arm)])
            error = float((got - ref).norm() / ref.norm())
            if error > 2e-2:  # two bf16 kernels of the same math differ by ~1e-3
                raise AssertionError(f"S={seq} {label}: {arm} and dense_mask differ by "
                                     f"{error:.3g}")
            row[f"{arm}_rel_error"] = error
    arms = ("cake_sp", "dense_mask", "per_sequence", "unpacked")
    for mode in ("fwd", "fwdbwd"):
        def call(arm, mode=mode):
            if mode == "fwd":
                with torch.no_grad():
                    run(arm)
            else:
                torch.autograd.backward(run(arm), [do[b:b + 1, a:e] for b, a, e in pieces(arm)])
        for arm in arms:  # warm-up (compiles flex's forward and backward)
            for _ in range(3):
                call(arm)
        samples = {arm: [] for arm in arms}
        for _ in range(rounds):
            for arm in (*arms, *reversed(arms)):
                samples[arm].append(time_ms(lambda arm=arm: call(arm)))
        for arm in arms:
            row[f"{mode}_{arm}_ms"] = statistics.median(samples[arm])
        for arm in ("dense_mask", "per_sequence"):
            row[f"{mode}_cake_sp_over_{arm}"] = row[f"{mode}_cake_sp_ms"] / row[f"{mode}_{arm}_ms"]
    return row


def markdown(rows: list[dict]) -> str:
    arms = ("cake_sp", "dense_mask", "per_sequence", "unpacked")
    header = ["S", "documents or keys"]
    for mode in ("fwd", "fwd+bwd"):
        header += [f"{mode} {arm} ms" for arm in arms]
        header += [f"{mode} cake_sp / dense_mask", f"{mode} cake_sp / per_sequence"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [str(r["seq"]), r["documents"]]
        for mode in ("fwd", "fwdbwd"):
            cells += [f"{r[f'{mode}_{arm}_ms']:.3f}" for arm in arms]
            cells += [f"{r[f'{mode}_cake_sp_over_{arm}']:.2f}"
                      for arm in ("dense_mask", "per_sequence")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    torch._dynamo.config.cache_size_limit = 64  # flex compiles again for each row's shape
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", choices=sorted(ROWS), default="all")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    run_rows("bench_packed_attention", (row + (args.rounds,) for row in ROWS[args.rows]),
             bench_row, markdown, args.json)


if __name__ == "__main__":
    main()
