"""Build the Gluon kernels (sm_90a only) and the append kernels on a machine without a GPU.

Run as a script, in a subprocess of its own: it replaces Triton's active driver with a stub
that names an sm_90 target, then calls a kernel's real host launcher on CPU tensors with the
kernel's launch turned into ``warmup``, which compiles through ptxas (the one Triton ships)
and runs nothing::

    TRITON_INTERPRET=0 python tests/kernels/_sm90_compile.py producer '{"world": 4, ...}'
    TRITON_INTERPRET=0 python tests/kernels/_sm90_compile.py fmha_context '{"head_dim": 64}'
    TRITON_INTERPRET=0 python tests/kernels/_sm90_compile.py fmha_decode '{"page_size": 16}'
    TRITON_INTERPRET=0 python tests/kernels/_sm90_compile.py append '{"fp8": true}'

It prints one JSON line: the kernel's shared memory in bytes, and ptxas's register count and
spill bytes for the PTX.  The configuration's keys are those of the builder's defaults
(``producer``: the warp-specialised producer; ``fmha_context``: the warp-specialised paged
context kernel, ``fmha_decode``: the warp-specialised decode kernel, an ``FmhaCase``'s
fields; ``append``: either append kernel on one batch, ``build_append``'s keys).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.runtime import driver

SM90 = GPUTarget("cuda", 90, 32)


class _StubDriver:
    """Just enough of a driver for Triton's JIT to compile for ``SM90`` (never to launch)."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return SM90

    def get_active_torch_device(self):
        return torch.device("cpu")


class _Warmup:
    """Stands in for the Gluon kernel: ``kernel[grid](...)`` compiles and keeps the result, and
    the launch's integer and boolean keyword arguments (the variant the launcher chose)."""

    def __init__(self, kernel):
        self.kernel, self.compiled, self.constants = kernel, None, {}

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.compiled = self.kernel.warmup(*args, grid=grid, **kwargs)
            self.constants = {k: v for k, v in kwargs.items() if isinstance(v, (bool, int))}
        return launch

    def report(self) -> dict:
        return {"shared_bytes": self.compiled.metadata.shared, "constants": self.constants,
                **_ptxas_report(self.compiled.asm["ptx"])}


def _ptxas_report(ptx: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp, "kernel.ptx")
        source.write_text(ptx)
        proc = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", str(source),
                               "-o", str(Path(tmp, "kernel.o"))],
                              capture_output=True, text=True, check=True)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", proc.stderr)]
    registers = re.findall(r"Used (\d+) registers", proc.stderr)
    return {"spill_bytes": sum(spills), "registers": int(registers[-1])}


def build_producer(config: dict) -> dict:
    from cake_sp.kernels import _config, producer
    from cake_sp.kernels.signals import ProducerSignals
    from cake_sp.layouts import DestLayout, HeadPlan, ReadinessLayout

    c = {**dict(world=2, q_heads=32, kv_heads=8, head_dim=128, hidden=4096, rows=4096,
                norms=True, bias=True, signals=True, positions=False, rope_style="neox",
                head_pairs=False),
         **config}
    # ``head_pairs``: the head-pair tile where the shape allows it; off by default here, so
    # that the other builds cover the one-head tiles (_config.PRODUCER_WS_HEAD_PAIRS).
    _config.PRODUCER_WS_HEAD_PAIRS = c["head_pairs"]
    plan = HeadPlan(c["world"], c["q_heads"], c["kv_heads"], c["head_dim"])
    rows, d, w = c["rows"], c["head_dim"], c["world"]
    bf16, i64 = torch.bfloat16, torch.int64
    seq_len = rows * w
    kernel = _Warmup(producer.qkv_produce_ws_kernel)
    producer.qkv_produce_ws_kernel = kernel
    # The launcher asks the (absent) GPU which mainloops it has.
    producer.choose_mainloop = lambda *args, **kwargs: "warp_specialized"
    signals = None
    if c["signals"]:
        readiness = ReadinessLayout.for_plan(plan, rows, _config.PRODUCER_BLOCK_M)
        signals = ProducerSignals(
            epoch=torch.zeros(1, dtype=i64), enter=torch.zeros(w, dtype=i64),
            word_table=torch.zeros(w, dtype=i64), source_rank=0, readiness=readiness,
            status=torch.zeros(1 + w, dtype=i64), timeout_ns=10**9)
    producer.qkv_norm_rope_produce(
        torch.empty(rows, c["hidden"], dtype=bf16),
        torch.empty(plan.total_heads * d, c["hidden"], dtype=bf16),
        torch.empty(plan.total_heads * d, dtype=bf16) if c["bias"] else None,
        torch.empty(d, dtype=bf16) if c["norms"] else None,
        torch.empty(d, dtype=bf16) if c["norms"] else None,
        torch.empty(rows, d), torch.zeros(rows, dtype=i64) if c["positions"] else None,
        plan=plan, dest=DestLayout.for_layout(plan, "bshd", seq_len, seq_len=seq_len),
        dest_table=torch.zeros(w, dtype=i64), seq_local=rows, dest_seq_offset=0, eps=1e-6,
        rope_style=c["rope_style"], signals=signals,
        bad_positions=torch.zeros(1, dtype=i64) if c["positions"] else None, num_sms=132)
    return kernel.report()


def build_fmha_context(config: dict) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    from _fmha_cases import FmhaCase, call, make_call

    from cake_sp.kernels.fmha import api, context_ws, tuning

    config = dict(config)
    # The grid order (context_ws.launch_grid) from this many query tokens, if given.
    if "qblock_major_min_q_len" in config:
        tuning.CONTEXT_QBLOCK_MAJOR_MIN_Q_LEN = config.pop("qblock_major_min_q_len")
    case = FmhaCase(**{**dict(op="context", head_dim=128, page_size=128, kv_lens=(300, 5),
                              q_lens=(300, 5)), **config})
    # The public call validates and builds the problem; the route is not taken.
    api._run = lambda problem, cell, return_lse: problem
    problem = call(case, make_call(case, torch.device("cpu")))
    assert context_ws.serves(problem), f"context_ws does not serve {case}"
    kernel = _Warmup(context_ws.context_ws_kernel)
    context_ws.context_ws_kernel = kernel
    context_ws.context_ws(problem)
    return kernel.report()


def build_fmha_decode(config: dict) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    from _fmha_cases import FmhaCase, call, make_call

    from cake_sp.kernels.fmha import api, decode, decode_ws

    config = dict(config)
    splits = config.pop("splits", 4)
    case = FmhaCase(**{**dict(op="decode", head_dim=128, num_kv_heads=8, group=4, page_size=64,
                              kv_lens=(8192,) * 16, q_lens=(1,) * 16), **config})
    api._run = lambda problem, cell, return_lse: problem
    problem = call(case, make_call(case, torch.device("cpu")))
    assert decode_ws.serves(problem), f"decode_ws does not serve {case}"
    kernel = _Warmup(decode_ws.decode_ws_kernel)
    decode_ws.decode_ws_kernel = kernel
    # ``splits`` (default 4) of whole tiles; one split is the variant that finalises.
    tiles = -(-problem.max_kv_len // decode_ws.BLOCK_N)
    chunk = -(-tiles // splits) * decode_ws.BLOCK_N
    scratch = torch.empty(1, dtype=torch.float32)
    decode_ws.decode_ws(problem, splits, chunk, decode.block_rows(case.group, max(case.q_lens)),
                        scratch, scratch)
    return kernel.report()


def build_append(config: dict) -> dict:
    """The BF16 append kernel (``fp8``: the FP8 one, dynamic Q scale) on one batch of
    ``batch`` requests of ``new`` tokens each after 1,000 cached ones."""
    from cake_sp.kernels import _config, qk_rope_append, qk_rope_fp8_append

    _config.require_triton_device = lambda what, device: None  # CPU tensors; nothing runs
    c = {**dict(batch=128, new=1, q_heads=64, kv_heads=8, head_dim=128, page_size=16,
                norm=2, layout="NHD", clear=True, fp8=False), **config}
    b, n, d, ps, hkv = c["batch"], c["new"], c["head_dim"], c["page_size"], c["kv_heads"]
    i32, seq = torch.int32, 1000 + n
    pages_per_req = -(-seq // ps)
    cache = ((b * pages_per_req, ps, hkv, d) if c["layout"] == "NHD"
             else (b * pages_per_req, hkv, ps, d))
    inputs = dict(
        qkv=torch.empty(b * n, (c["q_heads"] + 2 * hkv) * d, dtype=torch.bfloat16),
        cos_sin=torch.empty(seq, d), seq_lens=torch.full((b,), seq, dtype=i32),
        q_indptr=torch.arange(b + 1, dtype=i32) * n,
        page_indices=torch.arange(b * pages_per_req, dtype=i32).view(b, pages_per_req),
        q_norm_weight=torch.empty(d), k_norm_weight=torch.empty(d),
        qk_norm_policy=c["norm"], kv_layout=c["layout"],
        clear_unused_last_page_rows=c["clear"])
    if c["fp8"]:
        module, name = qk_rope_fp8_append, "_qk_rope_fp8_append_kernel"
        caches = [torch.empty(cache, dtype=torch.float8_e4m3fn) for _ in range(2)]
        one = torch.ones(1)
        call = lambda: module.fused_qk_rmsnorm_rope_quantize_fp8_append_paged_kv_cache(  # noqa: E731
            paged_kv_cache=tuple(caches), is_prefill=n > 1, k_scale=one, v_scale=one,
            quant_policy=1, max_seqlen=n, **inputs)
    else:
        module, name = qk_rope_append, "_qk_rope_append_kernel"
        caches = [torch.empty(cache, dtype=torch.bfloat16) for _ in range(2)]
        call = lambda: module.fused_qk_rmsnorm_rope_append_paged_kv_cache(  # noqa: E731
            key_cache=caches[0], value_cache=caches[1], num_q_heads=c["q_heads"],
            num_kv_heads=hkv, **inputs)
    kernel = _Warmup(getattr(module, name))
    setattr(module, name, kernel)
    call()
    return kernel.report()


BUILDERS = {"producer": build_producer, "fmha_context": build_fmha_context,
            "fmha_decode": build_fmha_decode, "append": build_append}

if __name__ == "__main__":
    driver.set_active(_StubDriver())
    print(json.dumps(BUILDERS[sys.argv[1]](json.loads(sys.argv[2]))))
