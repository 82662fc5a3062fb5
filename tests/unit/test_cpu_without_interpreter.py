"""On the CPU without Triton's interpreter: the session and the layer run in plain PyTorch
(checked against the float64 reference, gradients included, at W = 2 over gloo), and the
calls that only Triton can serve say what to set, and that it must be set before the import.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

SCRIPT = r"""
import json, sys
import torch, torch.distributed as dist
import cake_sp
from cake_sp import QkvNormRopeExchangeOverlap, UlyssesAttention, reference
from cake_sp.kernels import _config

rank, world = int(sys.argv[1]), 2
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world)
assert not _config.INTERPRET
out = {{}}
g = torch.Generator().manual_seed(7)
hidden, hq, hkv, d, s, b = 64, 4, 2, 64, 6, 2
xs = [torch.randn(b, s, hidden, generator=g).bfloat16() for _ in range(world)]
dys = [torch.randn(b, s, hidden, generator=g).bfloat16() for _ in range(world)]
table = reference.rope_cos_sin_table(world * s, d)
tables = [table[r * s:(r + 1) * s].repeat(b, 1) for r in range(world)]

# The session alone against the step-by-step reference of the contract.
torch.manual_seed(3)  # the same weights on every rank
layer = UlyssesAttention(hidden, hq, hkv, d, max_tokens=b * s, qkv_bias=True, o_bias=True,
                         device="cpu", rope_style="neox")
session = layer.session
with torch.no_grad():
    want = reference.qkv_norm_rope_exchange(
        xs, layer.qkv_weight, layer.q_norm_weight, layer.k_norm_weight, tables, None,
        layer.qkv_bias, num_q_heads=hq, num_kv_heads=hkv, rope_style="neox",
        layout="bshd")[rank]
    got = session(xs[rank], layer.qkv_weight, layer.q_norm_weight, layer.k_norm_weight,
                  tables[rank], None, layer.qkv_bias)
out["session_max_err"] = max(float((a.float() - w.float()).abs().max())
                             for a, w in zip(got, want))

# The fused layout, with positions into a [max_pos, D] table.
with QkvNormRopeExchangeOverlap(num_q_heads=2, num_kv_heads=2, head_dim=d, hidden=hidden,
                                max_tokens=b * s, layout="fused", device="cpu") as fused:
    w = torch.randn(6 * d, hidden, generator=g).bfloat16() * 0.1
    pos_table = reference.rope_cos_sin_table(64, d)
    pos = [torch.randint(0, 64, (b, s), generator=g) for _ in range(world)]
    want = reference.qkv_norm_rope_exchange(
        xs, w, None, None, [pos_table] * world, pos, None, num_q_heads=2, num_kv_heads=2,
        rope_style="interleaved", layout="fused")[rank]
    got = fused(xs[rank], w, None, None, pos_table, pos[rank])
    out["fused_max_err"] = float((got.float() - want.float()).abs().max())

# The layer, forward and every gradient, against the float64 layer: the projection
# recomputed in the backward, and kept.
params = {{n: p.detach() for n, p in layer.named_parameters()}}
ref_x = [x.double().requires_grad_(True) for x in xs]
ref_p = {{n: p.double().requires_grad_(True) for n, p in params.items()}}
ys = reference.ulysses_attention_layer(
    ref_x, ref_p["qkv_weight"], ref_p["o_weight"], tables, num_q_heads=hq,
    num_kv_heads=hkv, qkv_bias=ref_p["qkv_bias"], o_bias=ref_p["o_bias"],
    q_norm_weight=ref_p["q_norm_weight"], k_norm_weight=ref_p["k_norm_weight"],
    rope_style="neox")
torch.autograd.backward(ys, [dy.double() for dy in dys])
def rel(a, w):
    return float((a.double() - w).norm() / w.norm())
for save in (False, True):
    if save:
        layer.close()
        layer = UlyssesAttention(hidden, hq, hkv, d, max_tokens=b * s, qkv_bias=True,
                                 o_bias=True, device="cpu", rope_style="neox",
                                 save_projection=True)
        layer.load_state_dict(params)
    x = xs[rank].clone().requires_grad_(True)
    y = layer(x, tables[rank])
    y.backward(dys[rank])
    errors = {{"y": rel(y.detach(), ys[rank].detach()), "dx": rel(x.grad, ref_x[rank].grad)}}
    for n, p in layer.named_parameters():
        total = p.grad.float().clone()
        dist.all_reduce(total)
        errors["d_" + n] = rel(total, ref_p[n].grad)
    out["save" if save else "recompute"] = errors
layer.close()
try:
    cake_sp.fused_qk_rmsnorm_rope_append_paged_kv_cache(
        torch.randn(1, 192).bfloat16(), torch.randn(4, 64), torch.ones(1, dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
        torch.randn(1, 4, 1, 64).bfloat16(), torch.randn(1, 4, 1, 64).bfloat16(),
        num_q_heads=1, num_kv_heads=1)
    out["append"] = "no error"
except RuntimeError as exc:
    out["append"] = str(exc)
print(json.dumps(out))
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path only")
def test_plain_pytorch_session_and_layer_and_the_interpreter_message(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = tmp_path / "cpu_plain.py"
    script.write_text(SCRIPT.format(port=29000 + os.getpid() % 1000))
    procs = [subprocess.Popen([sys.executable, str(script), str(r)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    reports = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stderr[-3000:]
        reports.append(__import__("json").loads(stdout.strip().splitlines()[-1]))
    for rank, report in enumerate(reports):
        # The session follows the contract's roundings: bf16 outputs within one rounding of
        # the step-by-step reference (the GEMM's summation order differs).
        assert report["session_max_err"] < 0.05, (rank, report)
        assert report["fused_max_err"] < 0.05, (rank, report)
        # Forward and gradients within bf16 noise of the float64 layer (_layer_inputs.py).
        for mode in ("recompute", "save"):
            for what, err in report[mode].items():
                bound = 1e-2 if what == "y" else 2e-2
                assert err <= bound, (rank, mode, what, err)
        assert "TRITON_INTERPRET=1" in report["append"] and "before cake_sp" in \
            report["append"], report["append"]
