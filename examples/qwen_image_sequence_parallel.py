"""A diffusers Qwen-Image transformer with Ulysses sequence parallelism, called as a pipeline
calls it: every rank passes the whole inputs and gets the whole output.

    torchrun --standalone --nproc-per-node=2 examples/qwen_image_sequence_parallel.py  # CPU, GPUs
"""

import copy

import torch
import torch.distributed as dist
from diffusers import QwenImageTransformer2DModel

from cake_sp.integrations import close
from cake_sp.integrations.diffusers import apply_ulysses, shard_calls

gpu = torch.cuda.is_available()
dist.init_process_group("nccl" if gpu else "gloo")
rank = dist.get_rank()
if gpu:
    torch.cuda.set_device(rank % torch.cuda.device_count())
device = torch.device("cuda" if gpu else "cpu")

torch.manual_seed(0)  # the same weights on every rank
model = QwenImageTransformer2DModel(in_channels=16, out_channels=4, num_layers=2,
                                    attention_head_dim=64, num_attention_heads=4,
                                    joint_attention_dim=32, axes_dims_rope=(16, 24, 24))
model = model.to(device, torch.bfloat16)
reference = copy.deepcopy(model)
# Every block's attention -> UlyssesAttention; the hooks shard the inputs, gather the output.
model = shard_calls(apply_ulysses(model, max_tokens=64))

# A 4 x 6 latent grid and a prompt of 13 tokens (the hooks pad it to a multiple of the world
# size with masked tokens), the same on every rank.
g = torch.Generator().manual_seed(1)
inputs = dict(hidden_states=torch.randn(1, 24, 16, generator=g),
              encoder_hidden_states=torch.randn(1, 13, 32, generator=g),
              timestep=torch.tensor([0.5]))
inputs = {k: v.to(device, torch.bfloat16) for k, v in inputs.items()}
with torch.no_grad():
    out = model(**inputs, img_shapes=[(1, 4, 6)], return_dict=False)[0]  # [1, 24, 16]
    want = reference(**inputs, img_shapes=[(1, 4, 6)], return_dict=False)[0]
if rank == 0:
    error = ((out.float() - want.float()).norm() / want.float().norm()).item()
    print(f"output {tuple(out.shape)}, relative difference from one process: {error:.2e}")
close(model)
dist.barrier()
dist.destroy_process_group()
