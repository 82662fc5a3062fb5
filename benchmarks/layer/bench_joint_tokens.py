"""One rank's attention of a diffusion model's joint attention (image or video tokens and a
text every rank holds whole), on one GPU, as ``UlyssesAttentionCore`` attends it with joint
tokens, beside passing the text as every rank's own tokens.

    python benchmarks/layer/bench_joint_tokens.py [--rows all|smoke] [--json out.json]

A row is a model's shape at ``W`` ranks: ``I`` image tokens, ``T`` text tokens, ``H`` heads of
``D``; one rank attends ``H / W`` heads (bf16, bidirectional, ``B = 1``). Arms:

* ``joint``: ``q, k, v [1, I + T, H / W, D]``, no mask: each text token once, as a query and
  as a key (the core's joint tokens: the rank's band of the text's heads beside the bands it
  received);
* ``copies``: ``q, k, v [1, I + W * T, H / W, D]``, each rank's tokens then its copy of the
  text, with a key mask keeping the first copy's keys alone (the joint-attention drop-ins
  before joint tokens): ``W * T`` text queries, ``(W - 1) * T`` keys masked.

Both through ``cake_sp.attention.attention`` (``backend="auto"``), the image queries' outputs
checked against each other first. A sample is one call (forward, or forward + backward of
``sum(o * do)``) timed by CUDA events; a row's time is the median over ``A B B A`` rounds.
``queries`` is ``(I + W * T) / (I + T)``, the ratio of the arms' query rows; the exchanges
(the copies' text through the scatter by heads too: ``T`` rows a rank more) are not timed.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _one_gpu import run_rows, time_ms

from cake_sp.attention import attention

# (model, I, T, H, D, W): real shapes, W where the tokens and heads split evenly.
ROWS = {
    "all": [("SD3 Medium 1024x1024", 4096, 333, 24, 64, w) for w in (2, 4, 8)]
    + [("SD3.5 Large 1024x1024", 4096, 333, 38, 64, 2),
       ("CogVideoX-5B 49x480x720", 17550, 226, 48, 64, 2)]
    + [("HunyuanVideo 129x720x1280", 118800, 256, 24, 128, w) for w in (4, 8)],
    "smoke": [("SD3 Medium 512x512", 1024, 333, 24, 64, 4)],
}


def copies_key_mask(image: int, text: int, world: int) -> torch.Tensor:
    """bool ``[1, I + W * T]``: every rank's image tokens then its copy of the text, in rank
    order; every image key and rank 0's text keys kept."""
    keys = torch.ones(world, image // world + text, dtype=torch.bool)
    keys[1:, image // world:] = False
    return keys.flatten()[None]


def bench_row(model: str, image: int, text: int, heads: int, dim: int, world: int,
              rounds: int) -> dict:
    g = torch.Generator().manual_seed(image + world)
    band = heads // world
    image_local = image // world

    def rand(rows: int) -> torch.Tensor:
        return torch.randn(1, rows, band, dim, generator=g).cuda().bfloat16()

    img = [rand(image) for _ in range(3)]
    txt = [rand(text) for _ in range(3)]
    joint = [torch.cat((i, t), dim=1).requires_grad_() for i, t in zip(img, txt)]
    # Each rank's tokens then its copy of the text, in rank order.
    copies = [torch.cat([torch.cat((i[:, r * image_local:(r + 1) * image_local], t), dim=1)
                         for r in range(world)], dim=1).requires_grad_() for i, t in zip(img, txt)]
    mask = copies_key_mask(image, text, world).cuda()
    do = {"joint": rand(image + text), "copies": rand(image + world * text)}

    def run(arm: str) -> torch.Tensor:
        if arm == "joint":
            return attention(*joint, causal=False, softmax_scale=None, backend="auto")
        return attention(*copies, causal=False, softmax_scale=None, backend="auto",
                         key_mask=mask)

    with torch.no_grad():  # the image queries' outputs agree
        a = run("joint")[:, :image].float()
        b = run("copies").float().unflatten(1, (world, -1))[:, :, :image_local].flatten(1, 2)
        error = float((a - b).norm() / a.norm())
    if error > 2e-2:  # two bf16 kernels of the same math differ by ~1e-3
        raise AssertionError(f"{model}, W={world}: the arms differ by {error:.3g}")
    row = {"model": model, "image": image, "text": text, "heads": heads, "head_dim": dim,
           "world": world, "rel_error": error,
           "queries": (image + world * text) / (image + text)}
    arms = ("joint", "copies")
    for mode in ("fwd", "fwdbwd"):
        def call(arm, mode=mode):
            if mode == "fwd":
                with torch.no_grad():
                    run(arm)
            else:
                run(arm).backward(do[arm])
        for arm in arms:
            for _ in range(3):
                call(arm)
        samples = {arm: [] for arm in arms}
        for _ in range(rounds):
            for arm in (*arms, *reversed(arms)):
                samples[arm].append(time_ms(lambda arm=arm: call(arm)))
        for arm in arms:
            row[f"{mode}_{arm}_ms"] = statistics.median(samples[arm])
        row[f"{mode}_copies_over_joint"] = row[f"{mode}_copies_ms"] / row[f"{mode}_joint_ms"]
    return row


def markdown(rows: list[dict]) -> str:
    header = ["model", "W", "I", "T", "H / W x D", "queries", "fwd joint ms", "fwd copies ms",
              "fwd copies / joint", "fwd+bwd joint ms", "fwd+bwd copies ms",
              "fwd+bwd copies / joint"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [r["model"], str(r["world"]), str(r["image"]), str(r["text"]),
                 f"{r['heads'] // r['world']} x {r['head_dim']}", f"{r['queries']:.3f}"]
        for mode in ("fwd", "fwdbwd"):
            cells += [f"{r[f'{mode}_joint_ms']:.3f}", f"{r[f'{mode}_copies_ms']:.3f}",
                      f"{r[f'{mode}_copies_over_joint']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", choices=sorted(ROWS), default="all")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    run_rows("bench_joint_tokens", (shape + (args.rounds,) for shape in ROWS[args.rows]),
             bench_row, markdown, args.json)


if __name__ == "__main__":
    main()
