"""A diffusers Wan transformer with Ulysses sequence parallelism, called as its pipelines call
it: every rank passes the whole latents and gets the whole output.

    torchrun --standalone --nproc-per-node=2 examples/wan_sequence_parallel.py  # CPU, GPUs
"""

import copy

import torch
import torch.distributed as dist
from diffusers import WanTransformer3DModel

from cake_sp.integrations import close
from cake_sp.integrations.diffusers import apply_ulysses

gpu = torch.cuda.is_available()
dist.init_process_group("nccl" if gpu else "gloo")
rank = dist.get_rank()
if gpu:
    torch.cuda.set_device(rank % torch.cuda.device_count())
device = torch.device("cuda" if gpu else "cpu")

torch.manual_seed(0)  # the same weights on every rank
model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4,
                              attention_head_dim=64, in_channels=4, out_channels=4,
                              text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2,
                              rope_max_seq_len=32)
model = model.to(device, torch.bfloat16)
reference = copy.deepcopy(model)
# Every block's self-attention -> UlyssesAttentionCore; hooks shard the tokens inside.
model = apply_ulysses(model, max_tokens=64)

# 3 frames of 8 x 8 latents: 3 x 4 x 4 = 48 patch tokens, a multiple of 2 and 4.
g = torch.Generator().manual_seed(1)
inputs = dict(hidden_states=torch.randn(1, 4, 3, 8, 8, generator=g),
              encoder_hidden_states=torch.randn(1, 9, 32, generator=g))
inputs = {k: v.to(device, torch.bfloat16) for k, v in inputs.items()}
timestep = torch.tensor([500.0], device=device)
with torch.no_grad():
    out = model(**inputs, timestep=timestep, return_dict=False)[0]  # [1, 4, 3, 8, 8]
    want = reference(**inputs, timestep=timestep, return_dict=False)[0]
if rank == 0:
    error = ((out.float() - want.float()).norm() / want.float().norm()).item()
    print(f"output {tuple(out.shape)}, relative difference from one process: {error:.2e}")
close(model)
dist.barrier()
dist.destroy_process_group()
