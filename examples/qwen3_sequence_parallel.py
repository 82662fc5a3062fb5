"""A transformers Qwen3 model with Ulysses sequence parallelism: each rank trains on its shard.

    torchrun --standalone --nproc-per-node=2 examples/qwen3_sequence_parallel.py   # CPU or GPUs
"""

import torch
import torch.distributed as dist
from transformers import Qwen3Config, Qwen3ForCausalLM

from cake_sp.integrations import close
from cake_sp.integrations.transformers import apply_ulysses, shard_batch

gpu = torch.cuda.is_available()
dist.init_process_group("nccl" if gpu else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if gpu:
    torch.cuda.set_device(rank % torch.cuda.device_count())
device = torch.device("cuda" if gpu else "cpu")

config = Qwen3Config(vocab_size=1024, hidden_size=256, intermediate_size=512,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=64, max_position_embeddings=1024)
torch.manual_seed(0)  # the same weights on every rank
model = apply_ulysses(Qwen3ForCausalLM(config).to(device))  # every attention -> UlyssesAttention
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

# Three documents packed in one row of 64 * world - 3 tokens, each position restarting at 0:
# each attends only within itself, across the ranks it spans.  Every rank builds the same
# batch of whole rows; shard_batch pads it to a multiple of the world size, shifts the labels
# over the whole row and gives this rank its tokens.
lengths = (40, 64 * world - 47, 4)
tokens = torch.randint(0, config.vocab_size, (1, sum(lengths)),
                       generator=torch.Generator().manual_seed(1)).to(device)
positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
part = shard_batch({"input_ids": tokens, "position_ids": positions, "labels": tokens})

for step in range(3):
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = model(**part).loss  # this rank's tokens' share of the batch's mean loss
    loss.backward()
    for p in model.parameters():  # the data-parallel reduction over the sequence group
        dist.all_reduce(p.grad)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    total = loss.detach().clone()
    dist.all_reduce(total)
    if rank == 0:
        print(f"step {step}: loss {total.item():.4f}")
close(model)
dist.barrier()
dist.destroy_process_group()
