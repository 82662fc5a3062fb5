"""UlyssesAttention on every rank of a torchrun job: forward, backward, an optimiser step.

    torchrun --standalone --nproc-per-node=2 examples/layer.py      # CPU (gloo) or 2 GPUs
"""

import torch
import torch.distributed as dist

from cake_sp import UlyssesAttention, reference

gpu = torch.cuda.is_available()
dist.init_process_group("nccl" if gpu else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if gpu:
    torch.cuda.set_device(rank % torch.cuda.device_count())
device = torch.device("cuda" if gpu else "cpu")
hidden, heads, kv_heads, head_dim = (4096, 32, 8, 128) if gpu else (128, 4, 2, 64)
seq_local = 4096 if gpu else 16  # this rank's tokens: [rank * seq_local, (rank + 1) * seq_local)

with UlyssesAttention(hidden, heads, kv_heads, head_dim, max_tokens=seq_local,
                      device=device) as attn:
    torch.manual_seed(0)  # every rank starts from the same weights
    attn.reset_parameters()
    table = reference.rope_cos_sin_table(world * seq_local, head_dim, device=device)
    rope = table[rank * seq_local:(rank + 1) * seq_local]  # one row per local token
    optimizer = torch.optim.AdamW(attn.parameters(), lr=1e-4)
    x = torch.randn(1, seq_local, hidden, device=device, dtype=torch.bfloat16,
                    requires_grad=True)
    y = attn(x, rope)  # [1, seq_local, hidden] bf16: this rank's tokens
    y.float().square().mean().backward()
    for p in attn.parameters():  # each rank's gradient covers its own tokens: sum them
        dist.all_reduce(p.grad)
    optimizer.step()
    if rank == 0:
        print(f"{attn}\ny {tuple(y.shape)} {y.dtype}, dx {tuple(x.grad.shape)}")
dist.barrier()
dist.destroy_process_group()
