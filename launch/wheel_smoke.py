"""Smoke test of an installed (not editable) cake_sp on the CPU: run from outside the tree.

    python launch/wheel_smoke.py     # after `pip install dist/cake_sp-*.whl` into a fresh venv

Imports the package, reads the FMHA manifest (package data), makes one session
call and one layer call on a one-rank gloo group and one paged-append call, and
checks each against ``cake_sp.reference`` or the call's own contract.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the CPU: Triton's interpreter

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import cake_sp  # noqa: E402
from cake_sp import reference  # noqa: E402
from cake_sp.testing import assert_close_counting_flips  # noqa: E402

assert "site-packages" in cake_sp.__file__, f"not an installed package: {cake_sp.__file__}"
manifest = cake_sp.fmha_manifest()
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
g = torch.Generator().manual_seed(0)
hq, hkv, d, hidden, rows = 2, 1, 64, 64, 8
w = (torch.randn((hq + 2 * hkv) * d, hidden, generator=g) / 8).bfloat16()
x = torch.randn(1, rows, hidden, generator=g).bfloat16()
table = reference.rope_cos_sin_table(rows, d)
with cake_sp.QkvNormRopeExchangeOverlap(num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                        hidden=hidden, max_tokens=rows) as session:
    q, k, v = session(x, w, None, None, table)
    want = reference.qkv_norm_rope_exchange([x], w, None, None, table, num_q_heads=hq,
                                            num_kv_heads=hkv)[0]
    for got, exp, style in zip((q, k, v), want, ("interleaved", "interleaved", None)):
        assert_close_counting_flips(got, exp, rope_style=style, head_dim=d)
with cake_sp.UlyssesAttention(hidden, hq, hkv, d, max_tokens=rows) as attn:
    y = attn(x, table)
    assert y.shape == x.shape and torch.isfinite(y.float()).all()
# One decode token appended to a one-page cache.
cache = torch.zeros(2, 4, hkv, d, dtype=torch.bfloat16)
qkv = torch.randn(1, (hq + 2 * hkv) * d, generator=g).bfloat16()
out_q = cake_sp.fused_qk_rmsnorm_rope_append_paged_kv_cache(
    qkv, table, torch.tensor([3], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
    torch.tensor([[1]], dtype=torch.int32), cache, cache.clone(), num_q_heads=hq,
    num_kv_heads=hkv)
assert out_q.shape == (1, hq, d) and cache[1, 2].abs().sum() > 0 and cache[0].abs().sum() == 0
dist.barrier()
dist.destroy_process_group()
print(f"installed cake_sp {cake_sp.__version__} works: manifest of {len(manifest)} entries, "
      "session, layer and append calls")
