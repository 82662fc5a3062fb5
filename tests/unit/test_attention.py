"""The attention core's packed sequences (``cu_seqlens``) and key masks on the CPU: the
arguments' checks, the per-sequence SDPA path against one dense SDPA call with the
block-diagonal mask, the key mask against a dense one, and the GPU's flex-attention paths
run eagerly."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from cake_sp.attention import attention, check_cu_seqlens, check_key_mask


def _gqa_inputs(g: torch.Generator, batch: int, seq: int):
    """float64 ``q [B, S, 4, 8]``, ``k, v [B, S, 2, 8]``."""
    return (torch.randn(batch, seq, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))


def _dense_sdpa(q, k, v, allowed):
    """One SDPA call with the boolean mask ``allowed`` (scale 0.3), K/V repeated to Q's heads."""
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2),
        v.repeat_interleave(2, 2).transpose(1, 2), attn_mask=allowed, scale=0.3).transpose(1, 2)


@pytest.mark.parametrize("causal", [True, False])
def test_packed_attention_matches_a_block_diagonal_mask(causal):
    batch, seq = 2, 11
    q, k, v = _gqa_inputs(torch.Generator().manual_seed(0), batch, seq)
    cu_seqlens = (0, 4, 5, seq, seq + 7, 2 * seq)
    got = attention(q, k, v, causal=causal, softmax_scale=0.3, backend="sdpa",
                    cu_seqlens=cu_seqlens)
    sequence = torch.repeat_interleave(torch.arange(5), torch.tensor(cu_seqlens).diff())
    sequence = sequence.view(batch, 1, seq)
    allowed = sequence[..., :, None] == sequence[..., None, :]
    if causal:
        allowed &= torch.ones(seq, seq, dtype=torch.bool).tril()
    torch.testing.assert_close(got, _dense_sdpa(q, k, v, allowed), rtol=1e-12, atol=1e-12)
    plain = attention(q, k, v, causal=causal, softmax_scale=0.3, backend="sdpa")
    assert not torch.allclose(got[:, 4:], plain[:, 4:])


def test_cu_seqlens_accepts_tensors_and_int_sequences():
    want = (0, 3, 4, 8)
    assert check_cu_seqlens(torch.tensor(want, dtype=torch.int32), batch=2, seq=4) == want
    assert check_cu_seqlens([torch.tensor(0), 3, 4, 8], batch=2, seq=4) == want


@pytest.mark.parametrize("cu_seqlens,message", [
    (torch.tensor([0.0, 8.0]), "1-D int32/int64 tensor"),
    (torch.tensor([[0, 8]]), "1-D int32/int64 tensor"),
    ([0, 2.5, 8], "must hold ints"),
    ([0, 4, 9], "from 0 to B * S = 2 * 4 = 8"),
    ([1, 4, 8], "from 0 to B * S = 2 * 4 = 8"),
    ([0, 4, 4, 8], "strictly increasing"),
    ([8], "strictly increasing"),
    ([0, 3, 8], "b * S (S = 4): a packed sequence cannot span two rows; 4 is missing"),
])
def test_cu_seqlens_errors_name_the_argument(cu_seqlens, message):
    with pytest.raises(ValueError, match="cu_seqlens") as info:
        check_cu_seqlens(cu_seqlens, batch=2, seq=4)
    assert message in str(info.value)


@pytest.mark.parametrize("causal", [True, False])
def test_the_gpu_path_block_mask_keeps_each_sequence_apart(causal, monkeypatch):
    """The GPU's packed path (flex attention over the sequences' block mask), run eagerly on
    the CPU, against the per-sequence path: rows of 300 tokens (not whole 128-token blocks),
    a sequence of one token, sequences that share a block."""
    from torch.nn.attention import flex_attention

    import cake_sp.attention as core

    monkeypatch.setattr(core, "_compiled", lambda name: getattr(flex_attention, name))
    g = torch.Generator().manual_seed(2)
    batch, seq = 2, 300
    q = torch.randn(batch, seq, 4, 16, generator=g)
    k, v = (torch.randn(batch, seq, 2, 16, generator=g) for _ in range(2))
    cu_seqlens = (0, 100, 129, 130, seq, seq + 200, 2 * seq)
    with warnings.catch_warnings():  # flex attention's note (once) that eager is unfused
        warnings.simplefilter("ignore", UserWarning)
        got = core._flex_attention(q, k, v, 0.3,
                                   core._document_mask(cu_seqlens, batch, seq, causal, q.device))
    want = attention(q, k, v, causal=causal, softmax_scale=0.3, backend="sdpa",
                     cu_seqlens=cu_seqlens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_flash_varlen_bounds_are_copied_once_per_cu_seqlens():
    """flash-attn's path (not installed here): its int32 bounds and longest sequence, built once
    for every layer of a forward."""
    import cake_sp.attention as core

    first = core._varlen_bounds((0, 3, 4, 9), torch.device("cpu"))
    assert first[0].dtype == torch.int32 and first[0].tolist() == [0, 3, 4, 9]
    assert first[1] == 5
    assert core._varlen_bounds((0, 3, 4, 9), torch.device("cpu"))[0] is first[0]


def _random_key_mask(g: torch.Generator, batch: int, seq: int) -> torch.Tensor:
    mask = torch.rand(batch, seq, generator=g) > 0.4
    mask[:, 0] = True  # every causal query keeps a key
    return mask


@pytest.mark.parametrize("causal", [True, False])
def test_key_mask_matches_a_dense_mask(causal):
    g = torch.Generator().manual_seed(3)
    batch, seq = 2, 13
    q, k, v = _gqa_inputs(g, batch, seq)
    mask = _random_key_mask(g, batch, seq)
    got = attention(q, k, v, causal=causal, softmax_scale=0.3, backend="sdpa",
                    key_mask=check_key_mask(mask.long(), batch=batch, seq=seq,
                                            device=q.device))
    allowed = mask.view(batch, 1, 1, seq).expand(batch, 1, seq, seq)
    if causal:
        allowed = allowed & torch.ones(seq, seq, dtype=torch.bool).tril()
    torch.testing.assert_close(got, _dense_sdpa(q, k, v, allowed), rtol=1e-12, atol=1e-12)
    plain = attention(q, k, v, causal=causal, softmax_scale=0.3, backend="sdpa")
    assert not torch.allclose(got, plain)


@pytest.mark.parametrize("causal", [True, False])
def test_the_gpu_key_mask_path_keeps_the_masked_keys_out(causal, monkeypatch):
    """The GPU's path for causal or GQA key masks (flex attention over the keys' block mask),
    run eagerly on the CPU, against the SDPA path: rows of 300 tokens (not whole blocks)."""
    from torch.nn.attention import flex_attention

    import cake_sp.attention as core

    monkeypatch.setattr(core, "_compiled", lambda name: getattr(flex_attention, name))
    g = torch.Generator().manual_seed(4)
    batch, seq = 2, 300
    q = torch.randn(batch, seq, 4, 16, generator=g)
    k, v = (torch.randn(batch, seq, 2, 16, generator=g) for _ in range(2))
    mask = _random_key_mask(g, batch, seq)
    with warnings.catch_warnings():  # flex attention's note (once) that eager is unfused
        warnings.simplefilter("ignore", UserWarning)
        got = core._flex_attention(q, k, v, 0.3, core._key_block_mask(mask, causal))
    want = attention(q, k, v, causal=causal, softmax_scale=0.3, backend="sdpa", key_mask=mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled flex attention: a GPU")
@pytest.mark.parametrize("seq", [88, 200])
def test_the_compiled_gpu_key_mask_path_below_128_queries(seq):
    """The compiled flex attention on a GPU (forward and backward) where Inductor would take its
    decoding kernel: fewer than 128 queries, two query heads a K/V head (88 x 2 rows: no
    decoding configuration, PyTorch 2.11), and past it; against float64 SDPA with the dense
    mask on the CPU."""
    import cake_sp.attention as core

    g = torch.Generator().manual_seed(5)
    batch = 2
    q = torch.randn(batch, seq, 2, 64, generator=g)
    k, v = (torch.randn(batch, seq, 1, 64, generator=g) for _ in range(2))
    mask = _random_key_mask(g, batch, seq)
    dy = torch.randn(batch, seq, 2, 64, generator=g)
    results = []
    for device, dtype in (("cuda", torch.bfloat16), ("cpu", torch.float64)):
        inputs = [t.to(device, dtype).requires_grad_(True) for t in (q, k, v)]
        if device == "cuda":
            o = core._flex_attention(*inputs, 0.3, core._key_block_mask(mask.cuda(), False))
        else:
            o = _dense_sdpa(*inputs, mask.view(batch, 1, 1, seq))
        o.backward(dy.to(device, dtype))
        results.append([t.cpu().double() for t in (o, *(t.grad for t in inputs))])
    for got, want in zip(*results):
        assert (got - want).norm() / want.norm() < 1e-2


@pytest.mark.parametrize("key_mask,message", [
    (torch.ones(2, 4), "bool or integer tensor"),
    ([[True] * 4] * 2, "bool or integer tensor"),
    (torch.ones(2, 5, dtype=torch.bool), "[B, S] = [2, 4] (S the whole sequence), got [2, 5]"),
    (torch.ones(1, 2, 4, dtype=torch.bool), "got [1, 2, 4]"),
    (torch.ones(2, 4, dtype=torch.bool, device="meta"), "must be on cpu, got meta"),
])
def test_key_mask_errors_name_the_argument(key_mask, message):
    with pytest.raises(ValueError, match="key_mask") as info:
        check_key_mask(key_mask, batch=2, seq=4, device=torch.device("cpu"))
    assert message in str(info.value)


def test_integer_key_masks_become_bool_once_per_mask_tensor():
    """An integer mask's bool form is one tensor for every layer of a forward (so that they
    share its block mask), and a new one once the mask is modified."""
    cpu = torch.device("cpu")
    ints = torch.tensor([[0, 2, 1]])
    mask = check_key_mask(ints, batch=1, seq=3, device=cpu)
    assert mask.dtype == torch.bool and mask.tolist() == [[False, True, True]]
    assert check_key_mask(ints, batch=1, seq=3, device=cpu) is mask
    ints[0, 0] = 1
    assert check_key_mask(ints, batch=1, seq=3, device=cpu).tolist() == [[True, True, True]]


def test_the_key_block_mask_is_built_once_per_mask_tensor(monkeypatch):
    """Every layer of a forward gets the same mask tensor: one block mask for all of them, a
    new one for a new or modified mask."""
    import cake_sp.attention as core

    built = []
    monkeypatch.setattr(core, "_compiled", lambda name: lambda *args, **kw: built.append(1)
                        or len(built))
    mask = torch.ones(2, 8, dtype=torch.bool)
    first = core._key_block_mask(mask, True)
    assert core._key_block_mask(mask, True) == first and len(built) == 1
    assert core._key_block_mask(mask, False) != first  # the causal flag is part of the key
    mask[0, 3] = False  # modified in place
    core._key_block_mask(mask, False)
    core._key_block_mask(mask.clone(), False)
    assert len(built) == 4


def _key_mask_keeping(g: torch.Generator, seq: int, kept: int, layout: str) -> torch.Tensor:
    """One row ``[1, seq]`` keeping ``kept`` keys: its first ones (``"first"``, padding at the
    end), its last ones (``"last"``, left padding), a run starting at key 2 (``"run"``), or at
    random places, one of them the first (``"scattered"``)."""
    mask = torch.zeros(1, seq, dtype=torch.bool)
    if layout == "scattered":
        mask[0, 0] = True
        mask[0, 1 + torch.randperm(seq - 1, generator=g)[:kept - 1]] = True
    else:
        start = {"first": 0, "last": seq - kept, "run": 2}[layout]
        mask[0, start:start + kept] = True
    return mask


def _check_against_a_dense_mask(q, k, v, mask: torch.Tensor, causal: bool,
                                 g: torch.Generator) -> None:
    """``attention`` with ``key_mask`` against float64 SDPA with the dense mask: the output and
    every gradient (a query with no key: zeros, as SDPA gives), no gradient at a masked key."""
    batch, seq = mask.shape
    got = attention(q, k, v, causal=causal, softmax_scale=0.3, backend="sdpa", key_mask=mask)
    allowed = mask.view(batch, 1, 1, seq).expand(batch, 1, seq, seq)
    if causal:
        allowed = allowed & torch.ones(seq, seq, dtype=torch.bool).tril()
    dy = torch.randn(got.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(got, (q, k, v), dy)
    want = _dense_sdpa(q, k, v, allowed)
    want_grads = torch.autograd.grad(want, (q, k, v), dy)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for mine, theirs in zip(grads, want_grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)
    assert (grads[1][~mask] == 0).all(), "a masked key got a gradient"


def _record_paths(monkeypatch) -> list[str]:
    """The names of ``_compacted`` and ``_span_attention`` as calls reach them."""
    import cake_sp.attention as core

    taken = []
    for name in ("_compacted", "_span_attention"):
        real = getattr(core, name)
        monkeypatch.setattr(core, name, lambda *a, real=real, name=name:
                            taken.append(name) or real(*a))
    return taken


@pytest.mark.parametrize("host_reads,causal,layout,path", [
    (True, False, "scattered", ["_compacted"] * 2), (True, False, "first", ["_span_attention"]),
    (True, True, "first", ["_span_attention"]), (True, True, "last", ["_span_attention"]),
    (True, True, "run", ["_span_attention"]), (True, True, "scattered", []),
    (False, False, "scattered", []), (False, True, "first", [])])
def test_key_masks_keeping_as_many_keys_attend_them_alone(host_reads, causal, layout, path,
                                                          monkeypatch):
    """Rows that keep as many keys each: one run of keys attended alone (a causal call's
    padding queries after it over all of it, those before it zeros), or K and V compacted to
    them (bidirectional), with no mask; equal to the dense mask's output and gradients.
    Without host reads (compiling, capturing a graph), and causal calls keeping scattered
    keys, the masked path."""
    import cake_sp.attention as core

    monkeypatch.setattr(core, "_no_host_reads", lambda q: not host_reads)
    taken = _record_paths(monkeypatch)
    g = torch.Generator().manual_seed(5)
    batch, seq = 2, 13
    q, k, v = (t.requires_grad_(True) for t in _gqa_inputs(g, batch, seq))
    mask = torch.cat([_key_mask_keeping(g, seq, 8, layout) for _ in range(batch)])
    if layout == "scattered":
        assert not bool(mask[0].equal(mask[1]))
    _check_against_a_dense_mask(q, k, v, mask, causal, g)
    assert taken == path


def test_kept_keys_are_read_once_per_mask_tensor():
    """One host read per mask tensor: the rows grouped by the run of keys they keep, or by how
    many scattered keys they keep, each group's run or indices, and the order that puts the
    rows back; none where a row keeps no key."""
    import cake_sp.attention as core

    mask = torch.tensor([[True, False, True, True], [False, True, False, True]])
    kept = core._kept_keys(mask)
    assert kept.order is None and [g.rows for g in kept.groups] == [slice(0, 1), slice(1, 2)]
    assert kept.groups[0].index.tolist() == [[0, 2, 3]]
    assert kept.groups[1].index.tolist() == [[1, 3]] and not kept.spans_only
    assert core._kept_keys(mask) is kept
    kept = core._kept_keys(torch.tensor([[True, True, False], [True, True, False]]))
    assert kept.groups == (core._RowGroup(slice(0, 2), span=(0, 2)),) and kept.spans_only
    kept = core._kept_keys(torch.tensor([[False, True, True], [True, False, True],
                                         [True, True, False], [True, False, True]]))
    rows = [g.rows if isinstance(g.rows, slice) else g.rows.tolist() for g in kept.groups]
    assert rows == [slice(0, 1), [1, 3], slice(2, 3)]
    assert [g.span for g in kept.groups] == [(1, 3), None, (0, 2)]
    assert kept.groups[1].index.tolist() == [[0, 2], [0, 2]]
    assert kept.order.tolist() == [0, 1, 3, 2]
    assert core._kept_keys(torch.tensor([[True, True], [False, False]])) is None


@pytest.mark.parametrize("causal,layout,path", [
    (False, "scattered", ["_compacted"] * 6), (False, "first", ["_span_attention"] * 3),
    (True, "first", ["_span_attention"] * 3), (True, "last", ["_span_attention"] * 3),
    (True, "scattered", [])])
def test_key_masks_keeping_different_keys(causal, layout, path, monkeypatch):
    """Rows keeping different keys (rows 0 and 3, 1 and 4 alike): each group of rows on its
    kept keys alone, the rows back in their order; equal to the dense mask's output and
    gradients.  A causal call with scattered keys: the masked path."""
    taken = _record_paths(monkeypatch)
    g = torch.Generator().manual_seed(6)
    seq = 13
    q, k, v = (t.requires_grad_(True) for t in _gqa_inputs(g, 5, seq))
    if layout == "scattered":  # as many keys as the others of its group: compacted together
        mask = torch.cat([_key_mask_keeping(g, seq, n, layout) for n in (5, 11, 8, 5, 11)])
    else:
        mask = torch.cat([_key_mask_keeping(g, seq, n, layout) for n in (5, 11, 8)])
        mask = mask[[0, 1, 2, 0, 1]]
    _check_against_a_dense_mask(q, k, v, mask, causal, g)
    assert taken == path


@pytest.mark.parametrize("masking", ["none", "cu_seqlens", "key_mask"])
def test_a_sliding_window_matches_the_reference(masking):
    """Each query's last ``window`` keys alone (transformers' ``sliding_window``), within its
    packed sequence or its kept keys, against float64 attention written out; a window of the
    whole row is plain causal attention."""
    from cake_sp import reference

    g = torch.Generator().manual_seed(9)
    batch, seq, window = 2, 23, 5
    q, k, v = _gqa_inputs(g, batch, seq)
    extra = {"none": {}, "cu_seqlens": {"cu_seqlens": (0, 9, seq, seq + 4, 2 * seq)},
             "key_mask": {"key_mask": _random_key_mask(g, batch, seq)}}[masking]
    got = attention(q, k, v, causal=True, softmax_scale=0.3, backend="sdpa", window=window,
                    **extra)
    want = reference.attention(q, k, v, causal=True, softmax_scale=0.3, window=window, **extra)
    rows = slice(None) if masking != "key_mask" else (extra["key_mask"].cumsum(1) > 0)
    torch.testing.assert_close(got[rows], want[rows], rtol=1e-12, atol=1e-12)
    whole = attention(q, k, v, causal=True, softmax_scale=0.3, backend="sdpa", **extra)
    assert not torch.allclose(got[:, window:], whole[:, window:])
    torch.testing.assert_close(
        attention(q, k, v, causal=True, softmax_scale=0.3, backend="sdpa", window=seq, **extra),
        whole, rtol=0, atol=0)


@pytest.mark.parametrize("masking", ["none", "cu_seqlens", "key_mask"])
def test_the_gpu_sliding_window_path_keeps_each_window(masking, monkeypatch):
    """The GPU's sliding-window path (flex attention over one block mask of the window, the
    sequences and the kept keys), run eagerly on the CPU, against the dense CPU path: rows of
    300 tokens, windows across block edges."""
    from torch.nn.attention import flex_attention

    import cake_sp.attention as core

    monkeypatch.setattr(core, "_compiled", lambda name: getattr(flex_attention, name))
    g = torch.Generator().manual_seed(10)
    batch, seq, window = 2, 300, 150
    q = torch.randn(batch, seq, 4, 16, generator=g)
    k, v = (torch.randn(batch, seq, 2, 16, generator=g) for _ in range(2))
    cu_seqlens = (0, 100, 129, 130, seq, seq + 200, 2 * seq) if masking == "cu_seqlens" \
        else None
    key_mask = _random_key_mask(g, batch, seq) if masking == "key_mask" else None
    with warnings.catch_warnings():  # flex attention's note (once) that eager is unfused
        warnings.simplefilter("ignore", UserWarning)
        got = core._flex_attention(q, k, v, 0.3, core._block_mask(
            True, window, cu_seqlens, key_mask, batch, seq, q.device))
    want = attention(q, k, v, causal=True, softmax_scale=0.3, backend="sdpa", window=window,
                     cu_seqlens=cu_seqlens, key_mask=key_mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


SOFTCAP_MASKINGS = ["none", "causal", "window", "cu_seqlens", "key_mask"]


def _softcap_problem(masking: str, seq: int):
    """``q, k, v`` float64 (GQA 4/2, D = 8, logits large enough for a cap of 1 to matter), and
    ``attention``'s keyword arguments of ``masking``."""
    g = torch.Generator().manual_seed(11)
    batch = 2
    q, k, v = (4 * t for t in _gqa_inputs(g, batch, seq))
    extra = {"none": dict(causal=False), "causal": dict(causal=True),
             "window": dict(causal=True, window=5),
             "cu_seqlens": dict(causal=False, cu_seqlens=(0, 9, seq, seq + 4, 2 * seq)),
             "key_mask": dict(causal=True, key_mask=_random_key_mask(g, batch, seq))}[masking]
    return q, k, v, extra


@pytest.mark.parametrize("masking", SOFTCAP_MASKINGS)
def test_softcapped_logits_match_the_reference(masking):
    """Gemma 2's soft-capped logits (``softcap * tanh(s / softcap)``) under every mask, against
    float64 attention written out; without the cap the outputs differ."""
    from cake_sp import reference

    q, k, v, extra = _softcap_problem(masking, 23)
    got = attention(q, k, v, softmax_scale=0.3, backend="sdpa", softcap=1.0, **extra)
    want = reference.attention(q, k, v, softmax_scale=0.3, softcap=1.0, **extra)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    uncapped = attention(q, k, v, softmax_scale=0.3, backend="sdpa", **extra)
    assert (got - uncapped).norm() > 0.1 * want.norm()


@pytest.mark.parametrize("masking", SOFTCAP_MASKINGS)
def test_the_gpu_softcap_path_caps_every_logit(masking, monkeypatch):
    """The GPU's soft-cap path (flex attention, the cap as its ``score_mod``, one block mask of
    every mask or none), run eagerly on the CPU, against the CPU's written-out logits: rows of
    300 tokens, masks across block edges."""
    from torch.nn.attention import flex_attention

    import cake_sp.attention as core

    monkeypatch.setattr(core, "_compiled", lambda name: getattr(flex_attention, name))
    q, k, v, extra = _softcap_problem(masking, 300)
    if masking == "cu_seqlens":
        extra["cu_seqlens"] = (0, 100, 129, 130, 300, 500, 600)
    q, k, v = (t.float() for t in (q, k, v))
    want = attention(q, k, v, softmax_scale=0.3, backend="sdpa", softcap=1.0, **extra)
    block_mask = None if masking == "none" else core._block_mask(
        extra["causal"], extra.get("window"), extra.get("cu_seqlens"), extra.get("key_mask"),
        2, 300, q.device)
    with warnings.catch_warnings():  # flex attention's note (once) that eager is unfused
        warnings.simplefilter("ignore", UserWarning)
        got = core._flex_attention(q, k, v, 0.3, block_mask, core._capped_scores(1.0))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled flex attention: a GPU")
@pytest.mark.parametrize("masking", ["none", "window", "key_mask"])
def test_the_compiled_gpu_softcap_path(masking):
    """The soft-capped attention on a GPU through ``attention`` (compiled flex attention with
    the cap as its ``score_mod``; flash-attn's ``softcap`` where it is installed and there is no
    key mask), forward and backward, against float64 attention written out on the CPU."""
    from cake_sp import reference
    from cake_sp.attention import resolve_attention_backend

    q, k, v, extra = _softcap_problem(masking, 200)
    backend, _ = resolve_attention_backend("auto", torch.device("cuda"))
    dy = torch.randn_like(q)
    results = []
    for device, dtype in (("cuda", torch.bfloat16), ("cpu", torch.float64)):
        inputs = [t.to(device, dtype).requires_grad_(True) for t in (q, k, v)]
        options = {n: t.to(device) if isinstance(t, torch.Tensor) else t
                   for n, t in extra.items()}
        if device == "cuda":
            o = attention(*inputs, softmax_scale=0.3, backend=backend, softcap=1.0, **options)
        else:
            o = reference.attention(*inputs, softmax_scale=0.3, softcap=1.0, **options)
        o.backward(dy.to(device, dtype))
        results.append([t.cpu().double() for t in (o, *(t.grad for t in inputs))])
    for got, want in zip(*results):
        assert (got - want).norm() / want.norm() < 1e-2
