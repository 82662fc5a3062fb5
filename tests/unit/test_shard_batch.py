"""``cake_sp.integrations.transformers.shard_rows`` on the CPU: every rank's part against a
token-by-token reference of the padded rows, their sequences and each token's target."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from cake_sp.integrations.transformers import shard_rows  # noqa: E402

IGNORE = -100


def _reference(batch: dict, world: int) -> dict:
    """The padded rows, the sequence of every token (a new one where a position is not its
    predecessor's plus one, the mask changes, or the padding tail begins; or at each given
    offset) and each token's target, one token at a time."""
    ids = batch["input_ids"].tolist()
    rows, seq = len(ids), len(ids[0])
    padded = -(-seq // world) * world
    positions = batch.get("position_ids", torch.arange(seq).expand(rows, seq)).tolist()
    mask = batch.get("attention_mask")
    mask = None if mask is None else mask.tolist()
    given = batch.get("cu_seq_lens_q")
    starts = set() if given is None else set(given.tolist())
    out = {"input_ids": [], "position_ids": [], "attention_mask": [], "targets": [],
           "offsets": []}
    for b in range(rows):
        first = [True] + [False] * (padded - 1)
        for i in range(1, padded):
            if i >= seq:
                first[i] = i == seq
            elif given is not None:
                first[i] = b * seq + i in starts
            else:
                first[i] = (positions[b][i] != positions[b][i - 1] + 1
                            or (mask is not None and mask[b][i] != mask[b][i - 1]))
        real = [i < seq and (mask is None or mask[b][i] == 1) for i in range(padded)]
        out["input_ids"].append(ids[b] + [0] * (padded - seq))
        out["position_ids"].append(positions[b] + [positions[b][-1] + 1 + j
                                                    for j in range(padded - seq)])
        if mask is not None:
            out["attention_mask"].append(mask[b] + [0] * (padded - seq))
        labels = batch["labels"][b].tolist() + [IGNORE] * (padded - seq)
        out["targets"].append([labels[i + 1] if i + 1 < padded and not first[i + 1]
                               and real[i] and real[i + 1] else IGNORE
                               for i in range(padded)])
        out["offsets"] += [b * padded + i for i in range(padded) if first[i]]
    out["offsets"].append(rows * padded)
    return out


def _check(batch: dict, world: int) -> None:
    want = _reference(batch, world)
    parts = [shard_rows(batch, r, world) for r in range(world)]
    for name in ("input_ids", "position_ids", "attention_mask"):
        if want[name]:
            got = torch.cat([p[name] for p in parts], dim=1)
            assert got.tolist() == want[name], name
    assert torch.cat([p["shift_labels"] for p in parts], dim=1).tolist() == want["targets"]
    for p in parts:
        assert p["labels"] is p["shift_labels"]
        assert p["cu_seq_lens_q"].tolist() == want["offsets"]
        assert p["cu_seq_lens_q"].dtype == torch.int32
        assert p["max_length_q"] == max(b - a for a, b in zip(want["offsets"],
                                                                 want["offsets"][1:]))
        assert int(p["num_items_in_batch"]) == sum(t != IGNORE for row in want["targets"]
                                                    for t in row)


def _batch(rows: int, seq: int, **extra) -> dict:
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(1, 50, (rows, seq), generator=g)
    labels = ids.clone()
    labels[:, 2] = IGNORE  # a prompt token: no loss
    return {"input_ids": ids, "labels": labels, **extra}


def test_packed_rows_padded_to_the_world():
    seq = 13  # padded to 16 over 4 ranks
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths])
                             for lengths in ((5, 1, 7), (13,))])
    _check(_batch(2, seq, position_ids=positions), world=4)


def test_padding_mask_left_and_right():
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, 9:] = 0
    mask[1, :4] = 0
    _check(_batch(2, 12, attention_mask=mask), world=3)


def test_given_bounds_are_moved_to_the_padded_rows():
    seq = 10  # padded to 12 over 3 ranks; offsets into the unpadded 2 x 10 tokens
    bounds = torch.tensor([0, 4, 10, 11, 17, 20], dtype=torch.int32)
    positions = torch.stack([torch.cat([torch.arange(4), torch.arange(6)]),
                             torch.cat([torch.arange(1), torch.arange(6), torch.arange(3)])])
    _check(_batch(2, seq, position_ids=positions, cu_seq_lens_q=bounds), world=3)


def test_one_rank_and_no_labels():
    part = shard_rows({"input_ids": torch.ones(1, 5, dtype=torch.long)}, 0, 1)
    assert part["cu_seq_lens_q"].tolist() == [0, 5]
    assert "shift_labels" not in part and "labels" not in part


def test_position_ids_shared_by_the_rows():
    batch = {"input_ids": torch.ones(2, 5, dtype=torch.long),
             "position_ids": torch.tensor([[0, 1, 0, 1, 2]])}
    part = shard_rows(batch, 1, 2)
    assert part["position_ids"].tolist() == [[1, 2, 3]]
    assert part["cu_seq_lens_q"].tolist() == [0, 2, 5, 6, 8, 11, 12]


def test_bad_arguments_raise():
    ids = torch.ones(2, 6, dtype=torch.long)
    with pytest.raises(ValueError, match=r"input_ids must be \[B, S\], got shape \(6,\)"):
        shard_rows({"input_ids": ids[0]}, 0, 2)
    with pytest.raises(ValueError, match=r"labels must be \[B, S\] = \[2, 6\] like "
                                         r"input_ids, got shape \(2, 5\)"):
        shard_rows({"input_ids": ids, "labels": ids[:, :5]}, 0, 2)
    with pytest.raises(ValueError, match=r"attention_mask must be \[B, S\] = \[2, 6\] like "
                                         r"input_ids, got shape \(1, 6\)"):
        shard_rows({"input_ids": ids, "attention_mask": ids[:1]}, 0, 2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world\) = \[0, 2\), got 2"):
        shard_rows({"input_ids": ids}, 2, 2)


def test_given_bounds_of_whole_rows_are_none():
    """Bounds that hold one sequence a row (as ``shard_rows`` gives for unpacked rows) reach
    the layer as None, so that a compiled model keeps the layer call in its graph; a tail
    after the last offset is a sequence of its own."""
    from cake_sp.integrations.transformers import _given_bounds

    whole = shard_rows({"input_ids": torch.ones(2, 6, dtype=torch.long)}, 0, 2)
    assert _given_bounds(whole["cu_seq_lens_q"], whole["cu_seq_lens_k"], 2, 6) is None
    assert _given_bounds(torch.tensor([0, 6]), None, 2, 6) is None  # the tail is row 1
    assert _given_bounds(torch.tensor([0, 6, 9]), None, 2, 6).tolist() == [0, 6, 9, 12]
    assert _given_bounds(torch.tensor([0, 2, 6]), None, 1, 9).tolist() == [0, 2, 6, 9]
