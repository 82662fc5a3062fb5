"""The whole Ulysses attention layer: cake_sp against the same layer in plain PyTorch and the
peers' Ulysses modules, forward and forward + backward, with the floor beside each row.

    torchrun --standalone --nproc-per-node=W benchmarks/layer/bench_ulysses_attention.py \\
        --mode fwd,fwdbwd [--rows all|smoke] [--json out.json]

Arms (every one computes the same math: QKV projection, per-head Q/K RMSNorm, NeoX
RoPE, causal attention by ``scaled_dot_product_attention``, o_proj):

* ``cake_sp``: ``UlyssesAttention`` (``backend="auto"``, ``engine="auto"``); with
  ``--variants``, beside it ``cake_sp_fused`` (``engine="fused"``: the fused Triton
  producer), ``cake_sp_save`` (``save_projection=True``: the forward's projection
  kept for the backward instead of recomputed) and ``cake_sp_slots1`` (``num_slots=1``:
  half the forward rings, enough without activation checkpointing), the same weights;
* ``plain``: the layer written in plain PyTorch: cuBLAS projections, the per-op
  RMSNorm and RoPE of transformers, ``all_to_all_single`` per tensor both ways
  (with W = 1 no exchange runs);
* ``cake_sp_core``: ``UlyssesAttentionCore`` around the same projections, norm, RoPE
  and attention core as ``plain`` (cake_sp's exchanges without its fused front end: what
  a model whose front end the layer cannot compute, Wan's, gets);
* ``deepspeed``: DeepSpeed's ``DistributedAttention`` around the same projections,
  norm, RoPE and attention core; ``yunchang``: yunchang's ``UlyssesAttention``
  (``attn_type=TORCH_FLASH``, PyTorch's flash kernel) likewise.  Imported from the
  installed packages; skipped with the reason otherwise.

Every arm's output is first checked against ``plain`` (relative error, bf16 noise).
A sample is one call (forward, or forward + backward of ``sum(y * dy)``) timed by
CUDA events after a host barrier; its time is the maximum over ranks, a row's the
median of ``A B C C B A`` rounds.  The floor is the GEMMs and the attention core
timed alone on this GPU (forward, or forward + backward), with no exchange.
Peak memory is the most allocated above the inputs during one sample; cake_sp's
exchange buffers (receive slots, staging), allocated once per layer, are printed
beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

for key, value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                   "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(key, value)

from cake_sp import UlyssesAttention, UlyssesAttentionCore, reference  # noqa: E402
from cake_sp.kernels import _config  # noqa: E402

HEAD_DIM = 128
ROWS = {
    "all": [(h, kv, s) for h in (3072, 4096) for kv in ("gqa", "mha")
            for s in (8192, 32768, 131072)],
    "short": [(h, kv, s) for h in (3072, 4096) for kv in ("gqa", "mha") for s in (8192, 32768)],
    "smoke": [(1024, "gqa", 2048)],
}


@dataclass
class Shape:
    hidden: int
    hq: int
    hkv: int
    seq_global: int
    world: int

    @property
    def seq_local(self) -> int:
        return self.seq_global // self.world


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' RMSNorm: fp32 statistics, cast back, times the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``rotate_half`` RoPE on ``[B, S, H, D]`` with ``cos, sin [B, S, 1, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class PlainLayer(torch.nn.Module):
    """The layer in plain PyTorch; ``exchange`` moves q/k/v to head bands and back."""

    def __init__(self, ours: UlyssesAttention, group, exchange: str) -> None:
        super().__init__()
        self.ours, self.group, self.exchange = ours, group, exchange
        self.world = dist.get_world_size(group)
        if exchange == "deepspeed":
            from deepspeed.sequence.layer import DistributedAttention
            self.dist_attn = DistributedAttention(self._core, group, scatter_idx=2, gather_idx=1)
        elif exchange == "yunchang":
            from yunchang import UlyssesAttention as YunchangUlysses
            from yunchang.kernels import AttnType
            self.dist_attn = YunchangUlysses(group, attn_type=AttnType.TORCH_FLASH)
        elif exchange == "cake_sp_core":
            self.dist_attn = UlyssesAttentionCore(
                ours.num_q_heads, ours.num_kv_heads, ours.head_dim, causal=True, group=group,
                max_tokens=ours.max_tokens, attention_backend="sdpa",
                device=ours.qkv_weight.device)

    @staticmethod
    def _core(q, k, v, *args, **kwargs):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True,
                                           enable_gqa=q.shape[2] != k.shape[2])
        return o.transpose(1, 2)

    def _a2a(self, t: torch.Tensor, scatter: int, gather: int) -> torch.Tensor:
        """DeepSpeed-Ulysses' all-to-all: split dim ``scatter`` over ranks, join ``gather``."""
        if self.world == 1:
            return t
        chunks = [c.contiguous() for c in t.chunk(self.world, dim=scatter)]
        out = [torch.empty_like(c) for c in chunks]
        dist.all_to_all(out, chunks, group=self.group)
        return torch.cat(out, dim=gather)

    def forward(self, x, cos, sin):
        m = self.ours
        b, s, _ = x.shape
        d = m.head_dim
        p = F.linear(x, m.qkv_weight, m.qkv_bias).view(b, s, -1, d)
        q, k, v = p.split((m.num_q_heads, m.num_kv_heads, m.num_kv_heads), dim=2)
        q = _rope(_rms(q, m.q_norm_weight), cos, sin)
        k = _rope(_rms(k, m.k_norm_weight), cos, sin)
        if self.exchange == "plain":
            q, k, v = (self._a2a(t, 2, 1) for t in (q, k, v))
            o = self._a2a(self._core(q, k, v), 1, 2)
        elif self.exchange == "yunchang":
            o = self.dist_attn(q, k, v, causal=True)
        elif self.exchange == "cake_sp_core":
            o = self.dist_attn(q, k, v)
        else:
            o = self.dist_attn(q, k, v, 0)  # batch_dim_idx: [B, S, H, D]
        return F.linear(o.reshape(b, s, -1), m.o_weight, m.o_bias)


def _peer_problem(name: str) -> str | None:
    """Why a peer arm cannot run here, or None."""
    module = {"deepspeed": "deepspeed.sequence.layer", "yunchang": "yunchang"}[name]
    try:
        __import__(module)
    except Exception as exc:  # ImportError, or a package that fails while importing
        return f"{module} does not import: {type(exc).__name__}: {str(exc)[:120]}"
    return None


def _inputs(shape: Shape, rank: int, device):
    g = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(1, shape.seq_local, shape.hidden, generator=g, device=device).bfloat16()
    dy = torch.randn_like(x)
    table = reference.rope_cos_sin_table(shape.seq_global, HEAD_DIM, device=device)
    rows = table[rank * shape.seq_local:(rank + 1) * shape.seq_local]
    half = HEAD_DIM // 2
    cos = rows[:, :half].repeat(1, 2).bfloat16()[None, :, None]
    sin = rows[:, half:].repeat(1, 2).bfloat16()[None, :, None]
    return x, dy, rows.contiguous(), cos, sin


def _sample(fn, group) -> float:
    dist.barrier(group=group)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    t = torch.tensor([start.elapsed_time(end)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def _peak_mb(fn, device) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


VARIANTS = {"fused": dict(engine="fused"), "save": dict(save_projection=True),
            "slots1": dict(num_slots=1)}


def run_row(shape: Shape, modes, group, control, device, peers, rounds,
            variants: list[str]) -> list[dict]:
    rank = dist.get_rank()
    hq, hkv = shape.hq, shape.hkv

    def layer(**options) -> UlyssesAttention:
        return UlyssesAttention(shape.hidden, hq, hkv, HEAD_DIM, max_tokens=shape.seq_local,
                                device=device, attention_backend="sdpa", **options)

    ours = layer()
    x, dy, table, cos, sin = _inputs(shape, rank, device)
    arms = {"cake_sp": lambda xx: ours(xx, table)}
    extra = {}
    for name in variants:
        extra[name] = layer(**VARIANTS[name])
        extra[name].load_state_dict(ours.state_dict())
        arms[f"cake_sp_{name}"] = lambda xx, v=extra[name]: v(xx, table)
    exchanges = ["plain", "cake_sp_core"] + [p for p, why in peers.items() if why is None]
    if shape.world > 1 and dist.get_backend(group) != "nccl":
        # all_to_all of CUDA tensors needs NCCL: a shared-GPU smoke run (the core's
        # exchanges are cake_sp's own)
        exchanges = ["cake_sp_core"]
    plain_layers = [PlainLayer(ours, group, name) for name in exchanges]
    for name, layer in zip(exchanges, plain_layers):
        arms[name] = lambda xx, layer=layer: layer(xx, cos, sin)
    # The floor: the GEMMs and the attention core alone, no exchange, no norm or RoPE.
    w_qkv, w_o = ours.qkv_weight, ours.o_weight
    q = torch.randn(1, shape.seq_global, hq // shape.world, HEAD_DIM, device=device).bfloat16()
    k = torch.randn(1, shape.seq_global, max(1, hkv // shape.world), HEAD_DIM,
                    device=device).bfloat16()
    o_in = torch.randn(1, shape.seq_local, hq * HEAD_DIM, device=device).bfloat16()

    def floor_fwd(xx, grad):
        for t in (q, k, o_in):
            t.requires_grad_(grad)
        p = F.linear(xx, w_qkv)
        o = PlainLayer._core(q, k, k)
        y = F.linear(o_in, w_o)
        return (p.sum() + o.float().sum() + y.float().sum()) if grad else y

    results = []
    for mode in modes:
        grad = mode == "fwdbwd"

        def call(fn, grad=grad):
            xx = x.detach().requires_grad_(grad)
            with torch.set_grad_enabled(grad):
                y = fn(xx)
                if grad:
                    (y.backward(dy) if y.dim() == 3 else y.backward())
            return y

        fns = {name: (lambda fn=fn: call(fn)) for name, fn in arms.items()}
        fns["floor"] = lambda grad=grad: call(lambda xx: floor_fwd(xx, grad))
        with torch.no_grad():
            want = arms["plain"](x) if "plain" in arms else None
            checks = {}
            for name, fn in list(arms.items()):
                try:
                    checks[name] = reference_error(fn(x), want) if want is not None else None
                except Exception as exc:  # a peer that cannot take this shape: say so, go on
                    checks[name] = f"{type(exc).__name__}: {str(exc)[:160]}"
                    del arms[name], fns[name]
        for name, fn in list(fns.items()):  # warm-up: compile, autotune, allocate
            try:
                fn()
            except Exception as exc:  # yunchang's PyTorch attention has no backward
                checks[name] = f"{type(exc).__name__}: {str(exc)[:160]}"
                del fns[name]
        samples = {name: [] for name in fns}
        order = list(fns)
        for _ in range(rounds):
            for name in order + order[::-1]:
                samples[name].append(_sample(fns[name], control))
        peak = {name: _peak_mb(fn, device) for name, fn in fns.items() if name != "floor"}
        results.append({
            "hidden": shape.hidden, "hq": hq, "hkv": hkv, "seq_global": shape.seq_global,
            "world": shape.world, "mode": mode, "backend": ours.backend,
            "engine": _config.producer_engine(
                shape.seq_local, hq + 2 * hkv, HEAD_DIM,
                torch.cuda.get_device_properties(device).multi_processor_count, True),
            "cake_sp_buffer_mb": ours.buffer_bytes / 2**20,
            "variant_buffer_mb": {f"cake_sp_{n}": m.buffer_bytes / 2**20
                                  for n, m in extra.items()},
            "median_ms": {n: statistics.median(s) for n, s in samples.items()},
            "not_run": {n: c for n, c in checks.items() if isinstance(c, str)},
            "samples_ms": samples, "peak_mb": peak, "rel_error_vs_plain": checks,
        })
        if rank == 0:
            print(_line(results[-1]), flush=True)
    for module in (ours, *extra.values()):
        module.close()
    for layer in plain_layers:
        if isinstance(getattr(layer, "dist_attn", None), UlyssesAttentionCore):
            layer.dist_attn.close()
    return results


def reference_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def _line(r: dict) -> str:
    t = r["median_ms"]
    parts = [f"{r['hidden']:>5} {r['hq']:>2}/{r['hkv']:<2} S={r['seq_global']:>6} W={r['world']} "
             f"{r['mode']:<6} cake_sp {t['cake_sp']:8.3f} ms"]
    for name in ("cake_sp_fused", "cake_sp_save", "cake_sp_slots1", "plain", "cake_sp_core",
                 "deepspeed", "yunchang"):
        if name in t:
            parts.append(f"{name} {t[name]:8.3f} ({t[name] / t['cake_sp']:.2f}x)")
    parts.append(f"floor {t['floor']:8.3f} (cake_sp/floor {t['cake_sp'] / t['floor']:.2f})")
    parts.append("peak MB " + " ".join(f"{n} {v:.0f}" for n, v in r["peak_mb"].items())
                 + f" (+ cake_sp buffers {r['cake_sp_buffer_mb']:.0f}"
                 + "".join(f", {n} {v:.0f}" for n, v in r["variant_buffer_mb"].items()) + ")")
    parts += [f"{n} not run: {why[:60]}" for n, why in r["not_run"].items()]
    return " | ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", default="fwd,fwdbwd")
    parser.add_argument("--rows", choices=sorted(ROWS), default="all")
    parser.add_argument("--rounds", type=int, default=0, help="0: by row size")
    parser.add_argument("--variants", default="fused,save",
                        help=f"comma list of extra cake_sp arms, of {sorted(VARIANTS)}")
    parser.add_argument("--json")
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    local = int(os.environ.get("LOCAL_RANK", 0))
    shared = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) > torch.cuda.device_count()
    device = torch.device("cuda", 0 if shared else local)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo" if shared else "nccl",
                            device_id=None if shared else device)
    group, control = dist.group.WORLD, dist.new_group(backend="gloo")
    world = dist.get_world_size()
    peers = {name: _peer_problem(name) for name in ("deepspeed", "yunchang")}
    if peers["deepspeed"] is None:  # DeepSpeed's collectives need its own wrapper of the group
        import deepspeed
        deepspeed.init_distributed(dist_backend=dist.get_backend())
    if dist.get_rank() == 0:
        print(f"# {torch.cuda.get_device_name(device)}, W={world}, torch {torch.__version__}; "
              + "; ".join(f"{n}: {why or 'imported'}" for n, why in peers.items()), flush=True)
    results = []
    for hidden, kind, seq in ROWS[args.rows]:
        hq = hidden // HEAD_DIM
        shape = Shape(hidden, hq, 8 if kind == "gqa" else hq, seq, world)
        rounds = args.rounds or (6 if seq <= 8192 else 3 if seq <= 32768 else 1)
        results += run_row(shape, args.mode.split(","), group, control, device, peers, rounds,
                           variants)
    if dist.get_rank() == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"peers": peers, "argv": sys.argv, "rows": results}, f, indent=1)
    dist.barrier(group=control)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
