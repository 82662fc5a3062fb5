"""Many AdamW steps of a small random Qwen3 under ``apply_ulysses`` beside the same model trained
on the full sequence in one process: the two loss curves, step by step.

    CAKE_SP_ALLOW_SHARED_GPU=1 torchrun --standalone --nproc-per-node=2 \\
        launch/train_steps.py --steps 200 --json train.json

Every rank trains the sequence-parallel model on its token shard (gradients summed over
the group, as a data-parallel reduction would); rank 0 also trains the reference, the
unmodified model on the whole sequence, from the same initial weights and data, both
with fp32 master weights under bf16 autocast, and the same model in fp32 without
autocast, whose distance from the bf16 reference is the noise scale.  The data are
periodic random sequences (a model that learns to copy from one period back drives
the loss down, and the copies cross shard boundaries; when that happens varies from
run to run, which the noise scale absorbs).  Before training, the untrained models'
logits on this rank's tokens are compared: the sequence-parallel model's distance from
the fp32 model must be within ``--noise-factor`` times the bf16 reference's (a token
that saw the future, or a wrong shard, is far outside).  Exits non-zero if that fails,
if a loss is not finite, if the sequence-parallel loss does not fall below three quarters of its
start, or if its curve lies farther from the reference's, at any step, than
``--noise-factor`` times the bf16-to-fp32 distance.  Several ranks may share one GPU
(a gloo group; the layer then takes the NVLink path through NVSHMEM with
``CAKE_SP_ALLOW_SHARED_GPU=1``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

for key, value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                   "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(key, value)

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seq", type=int, default=4096, help="global tokens per sequence")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing (non-reentrant) in the sequence-parallel model")
    p.add_argument("--period", type=int, default=256, help="tokens before a sequence repeats")
    p.add_argument("--noise-factor", type=float, default=3.0)
    p.add_argument("--json")
    return p.parse_args()


def make_model(args, device):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    heads = args.hidden // 128
    config = Qwen3Config(vocab_size=4096, hidden_size=args.hidden,
                         intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                         head_dim=128, max_position_embeddings=args.seq,
                         attn_implementation="sdpa")
    torch.manual_seed(0)  # the same initial weights in every model on every rank
    return Qwen3ForCausalLM(config).to(device)


def train(model, ids, targets, args, *, shard: slice, positions, group,
          autocast: bool = True) -> list[float]:
    """Per-step mean cross-entropy over every token of the global batch."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model.train()
    losses = []
    for _ in range(args.steps):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = model(ids[:, shard], position_ids=positions, use_cache=False).logits
        loss_sum = F.cross_entropy(logits.float().flatten(0, 1), targets[:, shard].flatten(),
                                   reduction="sum")
        (loss_sum / targets.numel()).backward()
        loss_sum = loss_sum.detach().clone()
        if group is not None:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)
            dist.all_reduce(loss_sum, group=group)
        losses.append(float(loss_sum) / targets.numel())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def main() -> int:
    args = parse_args()
    from cake_sp.integrations import close
    from cake_sp.integrations.transformers import apply_ulysses

    shared = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) > torch.cuda.device_count()
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", 0 if shared else local)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo" if shared else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    periods = -(-(args.seq + 1) // args.period)
    tokens = torch.randint(0, 4096, (args.batch, args.period), generator=g).repeat(1, periods)
    tokens = tokens[:, :args.seq + 1].to(device)
    ids, targets = tokens[:, :-1], tokens[:, 1:]
    s = args.seq // world
    shard = slice(rank * s, (rank + 1) * s)
    positions = torch.arange(rank * s, (rank + 1) * s, device=device)[None].expand(args.batch, -1)

    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        reference_logits = make_model(args, device)(ids, use_cache=False).logits[:, shard]
    with torch.no_grad():
        fp32_logits = make_model(args, device)(ids, use_cache=False).logits[:, shard]
    model = apply_ulysses(make_model(args, device), max_tokens=args.batch * s)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        our_logits = model(ids[:, shard], position_ids=positions, use_cache=False).logits
    logit_errors = torch.stack([(logits.float() - fp32_logits).norm() / fp32_logits.norm()
                                for logits in (our_logits, reference_logits)])
    dist.all_reduce(logit_errors, op=dist.ReduceOp.MAX)
    del reference_logits, fp32_logits, our_logits
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ours = train(model, ids, targets, args, shard=shard, positions=positions,
                 group=dist.group.WORLD)
    close(model)
    failures = []
    if rank == 0:
        reference = train(make_model(args, device), ids, targets, args, shard=slice(None),
                          positions=None, group=None)
        fp32 = train(make_model(args, device), ids, targets, args, shard=slice(None),
                     positions=None, group=None, autocast=False)
        gaps = [abs(a - b) for a, b in zip(ours, reference)]
        noise = max(abs(a - b) for a, b in zip(reference, fp32))
        for step in [*range(0, args.steps, max(1, args.steps // 10)), args.steps - 1]:
            print(f"step {step:4d}: ours {ours[step]:.4f}  reference {reference[step]:.4f}  "
                  f"fp32 {fp32[step]:.4f}  |ours - reference| {gaps[step]:.2e}")
        ours_err, reference_err = logit_errors.tolist()
        print(f"untrained logits against fp32: ours {ours_err:.3e}, bf16 reference "
              f"{reference_err:.3e}")
        if not ours_err <= args.noise_factor * reference_err:
            failures.append(f"untrained logits {ours_err:.3g} from fp32, more than "
                            f"{args.noise_factor} x the bf16 reference's {reference_err:.3g}")
        if not all(math.isfinite(v) for v in ours + reference + fp32):
            failures.append("a loss is not finite")
        if not ours[-1] < 0.75 * ours[0]:
            failures.append(f"the loss did not fall ({ours[0]:.4f} -> {ours[-1]:.4f})")
        if max(gaps) > args.noise_factor * noise:
            failures.append(f"the curves part by {max(gaps):.3g} at step "
                            f"{gaps.index(max(gaps))}, more than {args.noise_factor} x the "
                            f"bf16-to-fp32 distance {noise:.3g}")
        print(f"W={world} steps={args.steps} checkpointing={args.checkpointing}: max "
              f"|ours - reference| {max(gaps):.2e}, bf16-to-fp32 {noise:.2e}; "
              + ("; ".join(failures) if failures else "passed"))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(args=vars(args), world=world, ours=ours, reference=reference,
                               fp32=fp32, logit_errors=dict(ours=ours_err,
                                                            reference=reference_err),
                               failures=failures), f, indent=1)
    verdict = torch.tensor([len(failures)], device=device)
    dist.broadcast(verdict, src=0)
    dist.barrier()
    dist.destroy_process_group()
    return int(verdict.item() > 0)


if __name__ == "__main__":
    sys.exit(main())
