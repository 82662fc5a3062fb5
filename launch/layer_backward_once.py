"""One small UlyssesAttention forward + backward on one GPU (W = 1), for compute-sanitizer.

    compute-sanitizer --tool memcheck python launch/layer_backward_once.py

Exercises every kernel of the layer's call and backward on one rank, once with each
producer engine (the fused kernel; cuBLAS then the epilogue kernel, its projection kept for
the backward): the band exchanges' packing, the front end's backward kernel, the GEMMs
and SDPA.
"""

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from cake_sp import UlyssesAttention, reference  # noqa: E402

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29519", rank=0, world_size=1)
torch.manual_seed(0)
# PyTorch's flash kernel for the attention: racecheck flags hazards inside cuDNN's SDPA
# kernels (not ours), which would hide any in the layer's own kernels.
for options in (dict(engine="fused"), dict(engine="cublas", save_projection=True)):
    with UlyssesAttention(256, 4, 2, 128, max_tokens=64, qkv_bias=True, o_bias=True,
                          **options) as attn, sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        x = torch.randn(1, 48, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y = attn(x, reference.rope_cos_sin_table(48, 128, device="cuda"))
        y.float().square().sum().backward()
        torch.cuda.synchronize()
        assert torch.isfinite(x.grad.float()).all() and x.grad.abs().sum() > 0
dist.destroy_process_group()
print("forward + backward done")
