"""Public paged FMHA calls with FlashInfer's TensorRT-LLM calling convention.

``batch_decode_with_kv_cache`` and ``batch_context_with_kv_cache`` take the
arguments of ``flashinfer.decode.trtllm_batch_decode_with_kv_cache`` and
``flashinfer.prefill.trtllm_batch_context_with_kv_cache`` in the same order
and return the same values.  Each call validates everything before it
allocates, maps itself to a capability cell, lets ``selector.choose_route``
pick a route, and runs it on the caller's stream.

Semantics (both calls), for query token ``i`` of request ``b`` with ``q_len_b``
new tokens and ``kv_len_b = seq_lens[b]`` keys (new tokens included):

* ``q_pos = kv_len_b - q_len_b + i``: the last query aligns with the last key;
* key ``n`` is masked when ``n > q_pos`` (causal) or ``n < q_pos - window_left``
  (``window_left >= 0``);
* ``logit = bmm1_scale * q . k`` in natural-log units; ``sinks[h]`` is one more
  logit that joins the softmax denominator only;
* ``out = bmm2_scale * softmax(logits) @ V``; ``lse = log(sum exp(logit) +
  exp(sink))`` (natural log), fp32 ``[num_tokens, Hq]``.

FP8 (e4m3) KV: fold the K dequantisation scale into ``bmm1_scale`` and the V
scale into ``bmm2_scale``; the query stays bf16/fp16.
"""

from __future__ import annotations

import numbers
import warnings
from typing import Any

import torch

from cake_sp._validation import check_tensor, describe
from cake_sp.kernels._config import INTERPRET
from cake_sp.kernels.fmha.compat import compat_attention
from cake_sp.kernels.fmha.context import context_triton
from cake_sp.kernels.fmha.decode import block_rows, decode_triton, decode_workspace_bytes
from cake_sp.kernels.fmha.problem import PagedAttention
from cake_sp.kernels.fmha.selector import (
    COMPAT,
    CONTEXT_Q_LEN_CLASS,
    CONTEXT_TRITON,
    DECODE_TRITON,
    MAX_GROUP,
    SHORT_WORKSPACE,
    VALID_HEAD_DIMS,
    Cell,
    choose_route,
    decode_q_len_class,
    page_class,
)
from cake_sp.kernels.fmha.tuning import DECODE_MAX_ROWS

_RUNNERS = {COMPAT: compat_attention, DECODE_TRITON: decode_triton, CONTEXT_TRITON: context_triton}
_HALF = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_INDEX_DTYPES = (torch.int32, torch.int64)
_KV_LAYOUTS = ("HND", "NHD")

# FlashInfer keywords outside cake_sp's domain: accepted at their default value
# (so call sites that spell them out keep working), NotImplementedError otherwise.
_FLASHINFER_ONLY = {
    "o_sf_scale": (None, "NVFP4 output scale factors"),
    "o_sf_vec_size": (None, "NVFP4 output scale factors"),
    "kv_cache_sf": (None, "NVFP4 KV-cache scale factors"),
    "sparse_mla_top_k": (0, "block-sparse attention"),
    "skip_softmax_threshold_scale_factor": (None, "skip-softmax sparsity"),
    "enable_dcp": (False, "decode context parallelism (DCP)"),
    "cp_world": (1, "decode context parallelism (DCP)"),
    "cp_rank": (0, "decode context parallelism (DCP)"),
    "mask": (None, "custom attention masks"),
    "backend": ("auto", "choosing a FlashInfer backend"),
}
_DECODE_ONLY = {
    "max_q_len": (None, "variable-length decode queries"),
    "cum_seq_lens_q": (None, "variable-length decode queries"),
}


def _check_flashinfer_only(op: str, extra: dict[str, Any], table: dict) -> None:
    for name, value in extra.items():
        if name == "enable_pdl":  # a launch hint; the Triton launches here do not use PDL
            continue
        if name not in table:
            raise TypeError(f"{op}() got an unexpected keyword argument {name!r}")
        default, feature = table[name]
        if value is not default and value != default:
            raise NotImplementedError(
                f"{op}: {name}={value!r} ({feature}) is not supported by cake_sp")


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


def _check_scale(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        raise NotImplementedError(f"{name} as a device tensor is not supported; pass a float")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    return float(value)


def _unpack_kv(kv_cache: Any, kv_layout: str, query: torch.Tensor):
    """``(k, v)`` as ``[pages, Hkv, page_size, D]`` views, validated against ``query``."""
    if kv_layout not in _KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {list(_KV_LAYOUTS)}, got {kv_layout!r}")
    if isinstance(kv_cache, (tuple, list)):
        if len(kv_cache) != 2:
            raise ValueError(f"kv_cache as a sequence must be (K, V), got {len(kv_cache)} items")
        k, v = kv_cache
        check_tensor("kv_cache[0]", k, device=query.device, ndim=4)
        check_tensor("kv_cache[1]", v, device=query.device, ndim=4)
    else:
        check_tensor("kv_cache", kv_cache, device=query.device, ndim=5)
        if kv_cache.shape[1] != 2:
            raise ValueError(f"kv_cache must be [pages, 2, ...] (K then V), got "
                             f"{describe(kv_cache)}")
        k, v = kv_cache[:, 0], kv_cache[:, 1]
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"K and V caches must match, got K {describe(k)} and V {describe(v)}")
    if k.dtype not in (query.dtype, torch.float8_e4m3fn):
        raise TypeError(f"kv_cache dtype must be the query's ({query.dtype}) or "
                        f"torch.float8_e4m3fn, got {describe(k)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError(f"kv_cache head_dim must be contiguous, got strides {k.stride()}")
    if kv_layout == "NHD":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    num_heads, head_dim = query.shape[1], query.shape[2]
    if k.shape[3] != head_dim:
        raise ValueError(f"kv_cache head_dim ({k.shape[3]}) must equal query's ({head_dim})")
    hkv = k.shape[1]
    if hkv < 1 or num_heads % hkv != 0 or not 1 <= num_heads // hkv <= MAX_GROUP:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of kv heads ({hkv}) "
                         f"with a group of 1 to {MAX_GROUP} ({kv_layout} kv_cache {describe(k)})")
    return k, v


def _prepare(op: str, query, kv_cache, workspace_buffer, block_tables, seq_lens, *,
             max_q_len: int, max_kv_len: int, bmm1_scale, bmm2_scale, window_left, out,
             out_dtype, sinks, kv_layout, uses_shared_paged_kv_idx, lse, return_lse, causal,
             q_len_per_req: int, cu_q, batch_size: int | None):
    """Validate every argument, then allocate ``out``/``lse``; returns ``(problem, cell)``."""
    check_tensor("query", query, dtypes=tuple(_HALF), ndim=3)
    dev = query.device
    num_tokens, num_heads, head_dim = query.shape
    if head_dim not in VALID_HEAD_DIMS:
        raise ValueError(f"query head_dim must be one of {list(VALID_HEAD_DIMS)}, got "
                         f"{describe(query)}")
    if query.stride(-1) != 1:
        raise ValueError(f"query head_dim must be contiguous, got strides {query.stride()}")
    k, v = _unpack_kv(kv_cache, kv_layout, query)
    check_tensor("workspace_buffer", workspace_buffer, device=dev, contiguous=True)

    shared = uses_shared_paged_kv_idx
    if not isinstance(shared, bool):
        raise TypeError(f"uses_shared_paged_kv_idx must be a bool, got {shared!r}")
    check_tensor("block_tables", block_tables, dtypes=_INDEX_DTYPES, device=dev)
    if shared and block_tables.ndim != 2:
        raise ValueError("block_tables must be [B, max_pages] when uses_shared_paged_kv_idx="
                         f"True, got {describe(block_tables)}")
    if not shared and (block_tables.ndim != 3 or block_tables.shape[1] != 2):
        raise ValueError("block_tables must be [B, 2, max_pages] (K and V page tables) when "
                         f"uses_shared_paged_kv_idx=False, got {describe(block_tables)}")
    if block_tables.stride(-1) != 1:
        raise ValueError(f"block_tables rows must be contiguous, got {block_tables.stride()}")
    k_tables = block_tables if shared else block_tables[:, 0]
    v_tables = block_tables if shared else block_tables[:, 1]
    batch = block_tables.shape[0]
    check_tensor("seq_lens", seq_lens, dtypes=_INDEX_DTYPES, device=dev, ndim=1)
    if seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens must be [B={batch}] like block_tables, got "
                         f"{describe(seq_lens)}")
    if batch_size is not None and batch_size != batch:
        raise ValueError(f"batch_size ({batch_size}) must equal block_tables.shape[0] ({batch})")
    capacity = block_tables.shape[-1] * k.shape[2]
    if max_kv_len > capacity:
        raise ValueError(f"{'max_seq_len' if op == 'decode' else 'max_kv_len'} ({max_kv_len}) "
                         f"exceeds the page table's capacity ({capacity} keys)")

    if op == "decode":
        if num_tokens != batch * q_len_per_req:
            raise ValueError(f"query must hold B * q_len_per_req = {batch} * {q_len_per_req} "
                             f"tokens, got {describe(query)}")
    else:
        check_tensor("cum_seq_lens_q", cu_q, dtypes=_INDEX_DTYPES, device=dev, ndim=1)
        if cu_q.shape[0] != batch + 1:
            raise ValueError(f"cum_seq_lens_q must be [B + 1 = {batch + 1}], got {describe(cu_q)}")

    scale1, scale2 = _check_scale("bmm1_scale", bmm1_scale), _check_scale("bmm2_scale", bmm2_scale)
    window_left = _check_int("window_left", window_left, -1)
    if sinks is not None:
        check_tensor("sinks", sinks, dtypes=(torch.float32,), device=dev, ndim=1)
        if sinks.shape[0] != num_heads:
            raise ValueError(f"sinks must be [Hq={num_heads}], got {describe(sinks)}")
    if isinstance(out_dtype, str):
        if out_dtype == "nvfp4":
            raise NotImplementedError("out_dtype='nvfp4' (NVFP4 output) is not supported")
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype!r}")
    if out_dtype is not None and out_dtype not in _HALF:
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype}")
    if out is not None:
        check_tensor("out", out, dtypes=(out_dtype,) if out_dtype else tuple(_HALF), device=dev)
        if out.shape != query.shape or out.stride(-1) != 1:
            raise ValueError(f"out must be {tuple(query.shape)} with a contiguous head_dim, got "
                             f"{describe(out)}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
    if lse is not None:
        check_tensor("lse", lse, dtypes=(torch.float32,), device=dev, ndim=2)
        if lse.shape != (num_tokens, num_heads) or not lse.is_contiguous():
            raise ValueError(f"lse must be contiguous [{num_tokens}, {num_heads}], got "
                             f"{describe(lse)}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")

    if out is None:
        out = torch.empty_like(query, dtype=out_dtype or query.dtype)
    if lse is None and return_lse:
        lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=dev)
    problem = PagedAttention(
        query=query, k_cache=k, v_cache=v, k_tables=k_tables, v_tables=v_tables,
        seq_lens=seq_lens, cu_q=cu_q, q_len_per_req=q_len_per_req, max_q_len=max_q_len,
        max_kv_len=max_kv_len, bmm1_scale=scale1, bmm2_scale=scale2, window_left=window_left,
        causal=causal, sinks=sinks, out=out, lse=lse, workspace=workspace_buffer.view(-1).view(
            torch.uint8))
    cell = Cell(
        op=op, q_dtype=_HALF[query.dtype],
        kv_dtype="same" if k.dtype == query.dtype else "fp8_e4m3", kv_layout=kv_layout,
        head_dim=head_dim, group=problem.group, page_class=page_class(problem.page_size),
        q_len_class=decode_q_len_class(q_len_per_req) if op == "decode" else CONTEXT_Q_LEN_CLASS,
        causal=causal, window=window_left >= 0, sinks=sinks is not None, lse=lse is not None,
        split_tables=not shared)
    return problem, cell


def _run(problem: PagedAttention, cell: Cell, return_lse: bool):
    triton_runs = problem.query.is_cuda or (problem.query.device.type == "cpu" and INTERPRET)
    need = 0
    if cell.op == "decode" and block_rows(problem.group, problem.q_len_per_req) <= DECODE_MAX_ROWS:
        need = decode_workspace_bytes(problem)
    route, reason = choose_route(cell, workspace_ok=problem.workspace.numel() >= need,
                                 triton_runs=triton_runs)
    if reason == SHORT_WORKSPACE:
        # The workspace alone sent the call to the compat route: a cliff worth a word.
        warnings.warn(
            f"workspace_buffer holds {problem.workspace.numel()} bytes, the Triton decode route "
            f"needs {need} for its split-KV partials: this call takes "
            f"the compat route, which gathers the keys in torch (far slower, and memory in "
            f"proportion to the cache). Pass a larger workspace_buffer, or set "
            f"CAKE_SP_FMHA_ROUTE=triton to make this an error.", RuntimeWarning, stacklevel=3)
    _RUNNERS[route](problem)
    return (problem.out, problem.lse) if return_lse else problem.out


def batch_decode_with_kv_cache(
    query: torch.Tensor,
    kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    workspace_buffer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    bmm1_scale: float = 1.0,
    bmm2_scale: float = 1.0,
    window_left: int = -1,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    sinks: torch.Tensor | None = None,
    kv_layout: str = "HND",
    q_len_per_req: int = 1,
    uses_shared_paged_kv_idx: bool = True,
    lse: torch.Tensor | None = None,
    return_lse: bool = False,
    **flashinfer_only: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Paged attention of ``q_len_per_req`` new tokens per request (decode / speculative decode).

    Parameters
    ----------
    query : Tensor ``[B * q_len_per_req, Hq, D]`` bf16/fp16
        Request-major; D in 64, 128, 256.
    kv_cache : Tensor or (Tensor, Tensor)
        ``[pages, 2, Hkv, page_size, D]`` (HND) / ``[pages, 2, page_size, Hkv, D]`` (NHD),
        or K and V ``[pages, Hkv, page_size, D]`` / ``[pages, page_size, Hkv, D]``;
        query dtype or float8_e4m3fn; ``Hq / Hkv`` in 1..16; any page size.
    workspace_buffer : Tensor, contiguous, any dtype
        Scratch for the split-KV partials; too small a buffer falls back to ``compat_v1``
        with a ``RuntimeWarning``.
    block_tables : Tensor ``[B, max_pages]`` int32/int64, or ``[B, 2, max_pages]`` (K, V)
        when ``uses_shared_paged_kv_idx=False``.
    seq_lens : Tensor ``[B]`` int32/int64
        KV length per request, the new tokens included (``>= q_len_per_req``).
    max_seq_len : int
        Bound on ``seq_lens`` (sizes the split-KV plan).
    bmm1_scale, bmm2_scale : float
        Logit scale (softmax and any Q/K dequant scale) and output scale (V dequant, output).
    window_left : int
        ``-1`` or the number of keys left of the query's position it still sees.
    out : Tensor ``[B * q_len_per_req, Hq, D]`` bf16/fp16, optional
    out_dtype : torch.dtype, optional
        Default: ``out.dtype`` if given, else the query's.
    sinks : Tensor ``[Hq]`` fp32, optional
    kv_layout : ``"HND"`` or ``"NHD"``
    q_len_per_req : int
        New tokens per request, causal among themselves.
    uses_shared_paged_kv_idx : bool
    lse : Tensor ``[B * q_len_per_req, Hq]`` fp32, optional
        Filled with the natural-log LSE when given.
    return_lse : bool
    **flashinfer_only
        FlashInfer keywords outside the domain (NVFP4, block-sparse, DCP, ...):
        ``NotImplementedError`` unless left at their default.

    Returns
    -------
    out, or ``(out, lse)`` when ``return_lse``.
    """
    _check_flashinfer_only("batch_decode_with_kv_cache", flashinfer_only,
                           {**_FLASHINFER_ONLY, **_DECODE_ONLY})
    if torch.compiler.is_compiling():  # one custom operator in the graph (below)
        out, lse = _compiled_outputs(query, out, out_dtype, lse, return_lse)
        torch.ops.cake_sp.batch_decode_with_kv_cache(
            query, *_split_kv(kv_cache), workspace_buffer, block_tables, seq_lens, max_seq_len,
            float(bmm1_scale), float(bmm2_scale), window_left, out, sinks, kv_layout,
            q_len_per_req, uses_shared_paged_kv_idx, lse)
        return (out, lse) if return_lse else out
    q_len = _check_int("q_len_per_req", q_len_per_req, 1)
    problem, cell = _prepare(
        "decode", query, kv_cache, workspace_buffer, block_tables, seq_lens,
        max_q_len=q_len, max_kv_len=_check_int("max_seq_len", max_seq_len, 1),
        bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale, window_left=window_left, out=out,
        out_dtype=out_dtype, sinks=sinks, kv_layout=kv_layout,
        uses_shared_paged_kv_idx=uses_shared_paged_kv_idx, lse=lse, return_lse=return_lse,
        causal=True, q_len_per_req=q_len, cu_q=None, batch_size=None)
    return _run(problem, cell, return_lse)


def batch_context_with_kv_cache(
    query: torch.Tensor,
    kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    workspace_buffer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_q_len: int,
    max_kv_len: int,
    bmm1_scale: float,
    bmm2_scale: float,
    batch_size: int,
    cum_seq_lens_q: torch.Tensor,
    cum_seq_lens_kv: torch.Tensor,
    window_left: int = -1,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    kv_layout: str = "HND",
    sinks: torch.Tensor | None = None,
    causal: bool = True,
    uses_shared_paged_kv_idx: bool = True,
    lse: torch.Tensor | None = None,
    return_lse: bool = False,
    **flashinfer_only: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Paged attention of ragged query chunks (prefill / chunked prefill) against their KV.

    Parameters
    ----------
    query : Tensor ``[sum q_len_b, Hq, D]`` bf16/fp16
        Request ``b`` owns tokens ``[cum_seq_lens_q[b], cum_seq_lens_q[b + 1])``.
    kv_cache, workspace_buffer, block_tables, kv_layout, uses_shared_paged_kv_idx
        As in :func:`batch_decode_with_kv_cache`.  The workspace is scratch: over an FP8
        cache on sm_90 it holds bf16 copies of the KV heads, as many at a time as fit
        (``2 * B * ceil(max_kv_len / 128) * 128 * D * 2`` bytes a head; 32 MiB a head at
        64k keys and D = 128), for the fast kernel; a smaller one costs speed only.
    seq_lens : Tensor ``[B]`` int32/int64
        KV length per request, the request's query tokens included (``>= q_len_b``).
    max_q_len, max_kv_len : int
        Bounds on the query and KV lengths of any request.
    bmm1_scale, bmm2_scale : float
    batch_size : int
        ``B``; must equal ``block_tables.shape[0]``.
    cum_seq_lens_q, cum_seq_lens_kv : Tensor ``[B + 1]`` int32/int64
        Prefix sums of the query and KV lengths (the KV one is checked for shape
        only: the kernels read KV through ``seq_lens`` and the page tables).
    window_left, out, out_dtype, sinks, lse, return_lse
        As in :func:`batch_decode_with_kv_cache`.
    causal : bool
        Bottom-right aligned causal mask; ``False`` lets every query see every key.

    Returns
    -------
    out, or ``(out, lse)`` when ``return_lse``.
    """
    _check_flashinfer_only("batch_context_with_kv_cache", flashinfer_only, _FLASHINFER_ONLY)
    if torch.compiler.is_compiling():  # one custom operator in the graph (below)
        out, lse = _compiled_outputs(query, out, out_dtype, lse, return_lse)
        torch.ops.cake_sp.batch_context_with_kv_cache(
            query, *_split_kv(kv_cache), workspace_buffer, block_tables, seq_lens, max_q_len,
            max_kv_len, float(bmm1_scale), float(bmm2_scale), batch_size, cum_seq_lens_q,
            cum_seq_lens_kv, window_left, out, kv_layout, sinks, causal,
            uses_shared_paged_kv_idx, lse)
        return (out, lse) if return_lse else out
    batch = _check_int("batch_size", batch_size, 1)
    check_tensor("cum_seq_lens_kv", cum_seq_lens_kv, dtypes=_INDEX_DTYPES, ndim=1,
                 device=query.device if isinstance(query, torch.Tensor) else None)
    if cum_seq_lens_kv.shape[0] != batch + 1:
        raise ValueError(f"cum_seq_lens_kv must be [batch_size + 1 = {batch + 1}], got "
                         f"{describe(cum_seq_lens_kv)}")
    problem, cell = _prepare(
        "context", query, kv_cache, workspace_buffer, block_tables, seq_lens,
        max_q_len=_check_int("max_q_len", max_q_len, 1),
        max_kv_len=_check_int("max_kv_len", max_kv_len, 1),
        bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale, window_left=window_left, out=out,
        out_dtype=out_dtype, sinks=sinks, kv_layout=kv_layout,
        uses_shared_paged_kv_idx=uses_shared_paged_kv_idx, lse=lse, return_lse=return_lse,
        causal=causal, q_len_per_req=0, cu_q=cum_seq_lens_q, batch_size=batch)
    return _run(problem, cell, return_lse)


# -- torch.compile: each op is one custom operator that writes caller-visible outputs ----------
# Under compilation the public functions allocate their outputs (as their eager paths would)
# and call these; the checks run when the operator runs.

def _compiled_outputs(query: torch.Tensor, out: torch.Tensor | None,
                      out_dtype: torch.dtype | None, lse: torch.Tensor | None,
                      return_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    if out is None:
        out = query.new_empty(query.shape, dtype=out_dtype or query.dtype)
    if lse is None and return_lse:
        lse = query.new_empty(query.shape[:2], dtype=torch.float32)
    return out, lse


def _split_kv(kv_cache) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(k, v)`` of a K/V pair, ``(kv, None)`` of one combined cache tensor."""
    if isinstance(kv_cache, (tuple, list)):
        return kv_cache[0], kv_cache[1]
    return kv_cache, None


def _joined_kv(k_cache: torch.Tensor, v_cache: torch.Tensor | None):
    return k_cache if v_cache is None else (k_cache, v_cache)


@torch.library.custom_op("cake_sp::batch_decode_with_kv_cache",
                        mutates_args=("workspace_buffer", "out", "lse"))
def _decode_op(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
               workspace_buffer: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, max_seq_len: int, bmm1_scale: float, bmm2_scale: float,
               window_left: int, out: torch.Tensor, sinks: torch.Tensor | None,
               kv_layout: str, q_len_per_req: int, uses_shared_paged_kv_idx: bool,
               lse: torch.Tensor | None) -> None:
    batch_decode_with_kv_cache(
        query, _joined_kv(k_cache, v_cache), workspace_buffer, block_tables, seq_lens,
        max_seq_len, bmm1_scale, bmm2_scale, window_left, out=out, sinks=sinks,
        kv_layout=kv_layout, q_len_per_req=q_len_per_req,
        uses_shared_paged_kv_idx=uses_shared_paged_kv_idx, lse=lse)


@_decode_op.register_fake
def _(*args) -> None:
    return None


@torch.library.custom_op("cake_sp::batch_context_with_kv_cache",
                        mutates_args=("workspace_buffer", "out", "lse"))
def _context_op(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
                workspace_buffer: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor, max_q_len: int, max_kv_len: int, bmm1_scale: float,
                bmm2_scale: float, batch_size: int, cum_seq_lens_q: torch.Tensor,
                cum_seq_lens_kv: torch.Tensor, window_left: int, out: torch.Tensor,
                kv_layout: str, sinks: torch.Tensor | None, causal: bool,
                uses_shared_paged_kv_idx: bool, lse: torch.Tensor | None) -> None:
    batch_context_with_kv_cache(
        query, _joined_kv(k_cache, v_cache), workspace_buffer, block_tables, seq_lens,
        max_q_len, max_kv_len, bmm1_scale, bmm2_scale, batch_size, cum_seq_lens_q,
        cum_seq_lens_kv, window_left, out=out, kv_layout=kv_layout, sinks=sinks,
        causal=causal, uses_shared_paged_kv_idx=uses_shared_paged_kv_idx, lse=lse)


@_context_op.register_fake
def _(*args) -> None:
    return None
