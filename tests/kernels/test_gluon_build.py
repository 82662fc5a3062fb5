"""The Gluon kernels, and the append kernels, build for sm_90a, with no spills, on any machine.

The Gluon kernels never run in Triton's interpreter, and the interpreter runs the append
kernels without compiling them (a branch on a loaded scalar, say, must also type-check in
both arms), so without this a change to one meets a compiler only on a GPU.
``_sm90_compile.py`` compiles each through its real host launcher in a subprocess (a stub
driver naming an sm_90 target; nothing runs) and reports ptxas's registers and spills: a
spill means a register budget (``_config.WsTile`` for the producer) no longer fits the code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.experimental.gluon")
pytest.importorskip("triton.backends.nvidia.compiler")

HELPER = Path(__file__).with_name("_sm90_compile.py")
REPO = Path(__file__).resolve().parents[2]
SM90_SHARED_BYTES = 227 * 1024  # the most shared memory one sm_90 CTA may take
# The append kernels are short launches of small programs: registers set how many an SM
# holds.  A clear loop that divided a vector of pair indices with a loaded start took the FP8
# kernel to 118 (from 72) and its 128-request decode 17-23 % slower on an H100.
APPEND_MAX_REGISTERS = 80
# BF16 token programs with QK norm hold each row's norm weights as a tile beside the RoPE
# row's (120 at (64, 8), D = 128): up to 8 programs an SM, a wave of the decode grids measured.
APPEND_TOKEN_NORM_MAX_REGISTERS = 128
# A BF16 token program's rows stay in the layout they are loaded in: with its RoPE row loaded
# once a token ([1, D/2]), Triton computed in that row's layout and moved each input and
# output half through shared memory (2 KB, eight barriers), which also held the loads behind
# it until the first landed.  Its cross-warp reductions take a few bytes.
APPEND_TOKEN_MAX_SHARED_BYTES = 64

BUILDS = {
    # The warp-specialised producer.  Both norm weights: the 256-row tile, bf16 hand-off;
    # bias, signals, NeoX.
    "producer-norm-in-mma": ("producer", {}, {"TILE_M": 256, "NORM_IN_MMA": True}),
    # No norms: the 128-row fp32 hand-off, interleaved RoPE, positions.
    "producer-fp32-hand-off": ("producer", {"norms": False, "rope_style": "interleaved",
                                            "positions": True},
                               {"TILE_M": 128, "NORM_IN_MMA": False}),
    # Both norm weights where 128-row tiles fill the waves better (_config.producer_ws_tile):
    # the fp32 hand-off, normalised by the epilogue partition.
    "producer-norms-128-row-tile": ("producer", {"q_heads": 24, "hidden": 3072, "rows": 2048},
                                    {"TILE_M": 128, "NORM_IN_MMA": False, "HAS_Q_NORM": True}),
    # Two heads a tile (the default with both norms at D = 128 and even head counts), NeoX
    # with positions and the interleaved style.  Its epilogue spills a little: cos/sin stay
    # live over the first head's stores; measured faster than the 256-row tile all the same
    # (docs/results.md, "Head pairs"), so the spills are bounded, not forbidden.
    "producer-head-pairs": ("producer", {"head_pairs": True, "positions": True},
                            {"TILE_M": 128, "HEADS": 2, "NORM_IN_MMA": True}, 512),
    "producer-head-pairs-interleaved": ("producer", {"head_pairs": True, "world": 8,
                                                     "rope_style": "interleaved"},
                                        {"TILE_M": 128, "HEADS": 2, "ROPE_STYLE": 0}, 512),
    # GQA replication at W = 4, D = 64, a tail row block.
    "producer-d64-replicated": ("producer", {"world": 4, "q_heads": 16, "kv_heads": 2,
                                             "head_dim": 64, "hidden": 1024, "rows": 1000},
                                {"D": 64, "KV_REPLICAS": 2}),
    # No signals, no bias (the NCCL path's packing).
    "producer-no-signals": ("producer", {"signals": False, "bias": False},
                            {"SIGNAL": False, "HAS_BIAS": False}),
    # The warp-specialised paged context kernel: D 128 and 64, pages split into copies.
    "fmha-context-d128": ("fmha_context", {}, {"QBLOCK_MAJOR": False}),
    "fmha-context-d64-page16": ("fmha_context", {"head_dim": 64, "page_size": 16,
                                                 "causal": False}, {"D": 64}),
    # The grid query block first (the calls of long requests).
    "fmha-context-query-block-first": ("fmha_context", {"qblock_major_min_q_len": 0},
                                       {"QBLOCK_MAJOR": True}),
    # The warp-specialised decode kernel: GQA 32/8 at D 128 in splits (3 programs an SM by
    # registers and shared memory), and D 64 on pages of 16 (4 copies a tile) with two query
    # tokens, one split and the LSE.
    "fmha-decode-d128": ("fmha_decode", {}, {"D": 128, "STAGES": 2, "maxnreg": 128,
                                            "FINALIZE": False}),
    "fmha-decode-d64-page16": ("fmha_decode", {"head_dim": 64, "page_size": 16, "group": 8,
                                               "num_kv_heads": 2, "kv_lens": [333, 17],
                                               "q_lens": [2, 2], "lse": True, "splits": 1},
                               {"D": 64, "PAGE": 16, "Q_LEN": 2, "HAS_LSE": True,
                                "FINALIZE": True}),
    # The most query rows it serves at D 128 (decode_ws.MAX_ACC_VALUES).
    "fmha-decode-32-rows": ("fmha_decode", {"q_lens": [8, 8], "kv_lens": [8192, 8192]},
                            {"BLOCK_M": 32, "D": 128}),
    # The BF16 append: decode (token programs) with QK norm on pages of 256 (many clear
    # programs a request, most stopping early), decode without norm, a prefill with norm
    # (tiles of tokens), no clear.
    "append-bf16-page256": ("append", {"page_size": 256}, {"PAGE_SIZE": 256,
                                                           "CLEAR_PROGRAMS": 32,
                                                           "TOKEN_PROGRAMS": True}),
    "append-bf16-token-programs": ("append", {"norm": 0}, {"TOKEN_PROGRAMS": True}),
    "append-bf16-prefill": ("append", {"new": 128, "batch": 1}, {"TOKEN_PROGRAMS": False}),
    "append-bf16-no-clear": ("append", {"clear": False}, {"CLEAR": False,
                                                         "CLEAR_PROGRAMS": 1}),
    # The FP8 append: 128 decode requests (64, 8) on pages of 16 (one clear program a
    # request); a prefill with a dynamic Q scale a request, HND; decode on pages of 64.
    "append-fp8-decode": ("append", {"fp8": True}, {"CLEAR_PROGRAMS": 1, "BLOCK_M": 8}),
    "append-fp8-prefill-hnd": ("append", {"fp8": True, "new": 128, "batch": 1,
                                          "layout": "HND"}, {"SCALE_BY_REQUEST": True}),
    "append-fp8-decode-page64": ("append", {"fp8": True, "page_size": 64},
                                 {"SCALE_BY_REQUEST": False, "CLEAR_PROGRAMS": 32}),
}


@pytest.mark.parametrize("name", list(BUILDS))
def test_builds_for_sm90_without_spills(name):
    kernel, config, constants, *spill_budget = BUILDS[name]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, str(HELPER), kernel, json.dumps(config)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["spill_bytes"] <= (spill_budget[0] if spill_budget else 0), report
    if kernel == "append":
        c = report["constants"]
        assert report["registers"] <= (APPEND_TOKEN_NORM_MAX_REGISTERS
                                       if c.get("TOKEN_PROGRAMS") and c.get("POLICY")
                                       else APPEND_MAX_REGISTERS), report
        if c.get("TOKEN_PROGRAMS"):
            assert report["shared_bytes"] <= APPEND_TOKEN_MAX_SHARED_BYTES, report
    assert 0 < report["shared_bytes"] <= SM90_SHARED_BYTES, report
    # The launcher built the variant the configuration is meant to cover.
    assert {k: report["constants"].get(k) for k in constants} == constants, report
