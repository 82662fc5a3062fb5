"""Release/acquire signalling for the NVLink path: entry barrier, readiness words, bounded waits.

One call on rank ``r`` of a group of ``W`` ranks runs, on its stream::

    barrier_arrive   epoch[0] += 1 -> e;  for every rank p: enter_p[r] := e   (release, sys)
    producer         per destination d: spin until enter_r[d] >= e         (acquire, sys)
                     store tile into d's slot; CTA barrier;
                     words_d[index(r, row_block, head)] := e                  (release, sys)
    wait_ready       for every source s, row block, head: spin until words_r[...] >= e
                                                                            (acquire, sys)

Memory-ordering argument
------------------------
* ``enter``: rank ``d`` writes ``enter_r[d] = e`` in the first kernel of its
  call ``e``.  Everything rank ``d`` enqueued earlier (the readers of the slot
  ``r`` is about to overwrite) has finished when that kernel runs (stream
  order), and the release store at system scope orders those reads before the
  word becomes visible.  Rank ``r``'s acquire load that observes ``e`` then
  orders its own stores into ``d``'s slot after them: no write-after-read race.
* readiness: the tile is stored by every thread of the CTA, but the word is
  written by one thread.  ``tl.debug_barrier()`` (``bar.sync``) makes the
  other threads' stores happen-before that thread's release; a release at
  system scope is cumulative, so a reader on another GPU that acquires the
  word sees the whole tile.  The wait kernel's acquire then orders every later
  kernel on ``r``'s stream (the consumers of the slot) after the tile stores.
* reuse without memset: the epoch only grows (``barrier_arrive`` is the only
  writer, once per call, and it stays on the device so that CUDA-graph
  replays bump it too), and every word holds the epoch of the last call that
  wrote it, so a word left over from call ``e - 1`` is ``< e`` and can never
  satisfy the wait of call ``e``.  Words a call does not use (row blocks past
  its rows) keep older epochs and are never read by that call.
* bounded waits: every spin gives up after ``timeout_ns`` (``%globaltimer`` on
  the GPU; a few polls in the CPU interpreter, where every writer has already
  run because programs execute one after another) and records the missing
  peers in ``status`` instead of hanging the job.

``status`` (int64 ``[1 + W]``) accumulates bit flags with atomic OR and is
never cleared by a kernel: ``status[0]`` is the OR of all flags, and
``status[1 + p]`` says what went wrong with peer ``p``: ``STATUS_READY_TIMEOUT``
(its readiness words for this rank never arrived) or ``STATUS_ENTER_TIMEOUT``
(it never entered the call, so this rank skipped its stores to it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from cake_sp.kernels import _config
from cake_sp.layouts import HeadPlan, ReadinessLayout

STATUS_READY_TIMEOUT = 1
STATUS_ENTER_TIMEOUT = 2
_READY_TIMEOUT: tl.constexpr = tl.constexpr(STATUS_READY_TIMEOUT)
_ENTER_TIMEOUT: tl.constexpr = tl.constexpr(STATUS_ENTER_TIMEOUT)
_SPIN_POLLS_INTERPRET: tl.constexpr = tl.constexpr(_config.SPIN_POLLS_INTERPRET)


@dataclass(frozen=True)
class ProducerSignals:
    """What the producer needs to take part in the NVLink protocol (all tensors on its device).

    Attributes
    ----------
    epoch : Tensor
        int64 ``[1]``, this rank's device-resident call counter, bumped by
        :func:`barrier_arrive`; the producer reads the call's epoch from it.
    enter : Tensor
        int64 ``[W]``, this rank's entry words: ``enter[d]`` is the last call rank
        ``d`` entered (written by ``d``'s :func:`barrier_arrive`).
    word_table : Tensor
        int64 ``[W]``, byte address of each rank's readiness-word array (int64
        ``[readiness.words]``, in symmetric memory), as seen from this rank.
    source_rank : int
        This rank's index in the group.
    readiness : ReadinessLayout
        Layout of the readiness words; ``max_row_blocks`` must count row blocks of
        the producer's ``block_m``.
    status : Tensor
        int64 ``[1 + W]`` error flags (see the module docstring); device memory,
        or pinned host memory mapped into the device's address space.
    timeout_ns : int
        How long one spin may last before it gives up, in nanoseconds.
    """

    epoch: torch.Tensor
    enter: torch.Tensor
    word_table: torch.Tensor
    source_rank: int
    readiness: ReadinessLayout
    status: torch.Tensor
    timeout_ns: int

    def validate(self, plan: HeadPlan, *, row_blocks: int, device: torch.device) -> None:
        """Raise ``ValueError``/``TypeError`` unless these signals fit ``plan`` and a call of
        ``row_blocks`` row blocks on ``device``."""
        world = plan.world_size
        check_int64_vector("signals.epoch", self.epoch, 1, device)
        check_int64_vector("signals.enter", self.enter, world, device)
        check_int64_vector("signals.word_table", self.word_table, world, device)
        check_int64_vector("signals.status", self.status, 1 + world, device)
        if not 0 <= self.source_rank < world:
            raise ValueError(f"signals.source_rank must be in [0, {world}), "
                             f"got {self.source_rank}")
        r = self.readiness
        if r.world_size != world or r.heads_per_rank != plan.heads_per_rank:
            raise ValueError(f"signals.readiness {r} does not match the plan ({world} ranks, "
                             f"{plan.heads_per_rank} heads per rank)")
        if r.max_row_blocks < row_blocks:
            raise ValueError(f"signals.readiness has {r.max_row_blocks} row blocks, the call "
                             f"needs {row_blocks} (was it built with the same block_m?)")
        if self.timeout_ns < 0:
            raise ValueError(f"signals.timeout_ns must be >= 0, got {self.timeout_ns}")


# ----------------------------------------------------------------------------- device helpers


@triton.jit
def global_time_ns(INTERPRET: tl.constexpr):
    """``%globaltimer`` in nanoseconds on the GPU; 0 in the interpreter (no inline asm there)."""
    if INTERPRET:
        now = tl.full((), 0, tl.int64)
    else:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                        is_pure=False, pack=1)
    return now


@triton.jit
def deadline_passed(start, polls, timeout_ns, INTERPRET: tl.constexpr):
    """True once a spin that began at ``start`` has polled past its budget.

    GPU: ``timeout_ns`` of wall time.  Interpreter: ``SPIN_POLLS_INTERPRET`` polls,
    because there every writer ran before the reader started.
    """
    if INTERPRET:
        passed = polls >= _SPIN_POLLS_INTERPRET
    else:
        passed = global_time_ns(INTERPRET) - start > timeout_ns
    return passed


@triton.jit
def acquire_load(ptr, mask):
    """Read int64 word(s) with acquire semantics at system scope (an atomic add of 0)."""
    return tl.atomic_add(ptr, 0, mask=mask, sem="acquire", scope="sys")


@triton.jit
def spin_until_at_least(ptr, target, timeout_ns, INTERPRET: tl.constexpr):
    """Acquire-poll the int64 word at ``ptr`` until it is ``>= target``; False on timeout."""
    start = global_time_ns(INTERPRET)
    polls = 1
    value = acquire_load(ptr, None)
    while (value < target) & ~deadline_passed(start, polls, timeout_ns, INTERPRET):
        value = acquire_load(ptr, None)
        polls += 1
    return value >= target


@triton.jit
def publish_run(ptr, stride, count, value, MAX_COUNT: tl.constexpr):
    """Release stores of ``value`` at ``ptr + i * stride`` for ``i < count`` (at most
    ``MAX_COUNT``), sys scope, after one CTA barrier: the CTA's earlier stores are ordered
    before every one of them (a barrier per word would order nothing more)."""
    tl.debug_barrier()
    for i in tl.static_range(MAX_COUNT):
        if i < count:
            tl.atomic_xchg(ptr + i * stride, value, sem="release", scope="sys")


@triton.jit
def publish(ptr, value):
    """Order the CTA's earlier stores before a release store of ``value`` at ``ptr``, sys scope."""
    publish_run(ptr, 0, 1, value, 1)


@triton.jit
def record_timeout(status_ptr, peer, flag):
    """OR ``flag`` into ``status[0]`` and ``status[1 + peer]``."""
    tl.atomic_or(status_ptr, flag, sem="relaxed", scope="sys")
    tl.atomic_or(status_ptr + 1 + peer, flag, sem="relaxed", scope="sys")


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _barrier_arrive_kernel(epoch_ptr, enter_table_ptr, source_rank, WORLD: tl.constexpr):
    e = tl.load(epoch_ptr) + 1
    tl.store(epoch_ptr, e)
    for p in range(WORLD):
        enter = tl.load(enter_table_ptr + p).to(tl.pointer_type(tl.int64))
        tl.atomic_xchg(enter + source_rank, e, sem="release", scope="sys")


@triton.jit
def _wait_ready_kernel(epoch_ptr, words_ptr, status_ptr, first_row_block, row_blocks,
                       max_row_blocks, timeout_ns, HEADS_PER_RANK: tl.constexpr,
                       BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    # One program per source rank: its words for these row blocks are one contiguous run.
    source = tl.program_id(0)
    e = tl.load(epoch_ptr)
    words = words_ptr + (source.to(tl.int64) * max_row_blocks + first_row_block) * HEADS_PER_RANK
    count = row_blocks * HEADS_PER_RANK
    start = global_time_ns(INTERPRET)
    polls = 0
    arrived = True
    first = 0
    while (first < count) & arrived:
        offs = first + tl.arange(0, BLOCK)
        mask = offs < count
        polls += 1
        late = tl.sum((mask & (acquire_load(words + offs, mask) < e)).to(tl.int32), axis=0)
        if late == 0:
            first += BLOCK
        else:
            arrived = ~deadline_passed(start, polls, timeout_ns, INTERPRET)
    if ~arrived:
        record_timeout(status_ptr, source, _READY_TIMEOUT)


# ----------------------------------------------------------------------------- launchers


def check_int64_vector(name: str, t: torch.Tensor, length: int,
                       device: torch.device | None) -> None:
    """``device`` None accepts any device (the first tensor checked sets it for the rest)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    device = t.device if device is None else device
    if t.dtype != torch.int64 or t.dim() != 1 or t.shape[0] < length or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous int64 vector of at least {length} "
                         f"elements, got {t.dtype} {tuple(t.shape)} contiguous={t.is_contiguous()}")
    if t.device != device and not (t.device.type == "cpu" and t.is_pinned()):
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def _check_world(world: int) -> None:
    # The producer keeps one bit per destination rank in an int64.
    if not 1 <= world <= 32:
        raise ValueError(f"world size must be in [1, 32], got {world}")


def barrier_arrive(epoch: torch.Tensor, enter_table: torch.Tensor, *, source_rank: int) -> None:
    """First kernel of a call: bump this rank's epoch and announce it to every rank.

    Parameters
    ----------
    epoch : Tensor
        int64 ``[1]`` on this rank's device; incremented in place to the call's epoch ``e``.
    enter_table : Tensor
        int64 ``[W]``: byte address, as seen from this device, of every rank's
        entry-word array (int64 ``[W]``, including this rank's own).  Word
        ``source_rank`` of each receives ``e`` with a release store at system scope.
    source_rank : int
        This rank's index in ``[0, W)``.

    Runs one program on the current stream; the host does not block.
    """
    check_int64_vector("epoch", epoch, 1, None)
    check_int64_vector("enter_table", enter_table, 1, epoch.device)
    world = enter_table.shape[0]
    _check_world(world)
    if not 0 <= source_rank < world:
        raise ValueError(f"source_rank must be in [0, {world}), got {source_rank}")
    _barrier_arrive_kernel[(1,)](epoch, enter_table, source_rank, WORLD=world, num_warps=1)


def wait_ready(epoch: torch.Tensor, words: torch.Tensor, status: torch.Tensor, *,
               readiness: ReadinessLayout, row_blocks: int, timeout_ns: int,
               first_row_block: int = 0) -> None:
    """Acquire the readiness words addressed to this rank for the current call: every
    source's, for row blocks ``[first_row_block, first_row_block + row_blocks)``.

    Parameters
    ----------
    epoch : Tensor
        int64 ``[1]``: this rank's epoch, already bumped by :func:`barrier_arrive`.
    words : Tensor
        int64 ``[readiness.words]``: this rank's readiness words (written by peers).
    status : Tensor
        int64 ``[1 + W]``: error flags; sources whose words did not all reach the
        epoch within ``timeout_ns`` get ``STATUS_READY_TIMEOUT`` (module docstring).
    readiness : ReadinessLayout
        The word layout the producers used.
    row_blocks : int
        Row blocks to wait for: all of this call, ``ceil(rows / block_m)`` with the
        producer's ``block_m`` (every source has the same rows), or a chunk of them.
    timeout_ns : int
        Wall-time budget of the wait, in nanoseconds (a few polls in the interpreter).
    first_row_block : int
        The first row block waited for (a consumer that works in row chunks waits for
        each chunk before it reads it).

    Runs ``W`` programs on the current stream; the host does not block.  Later
    kernels on the stream see every tile stored before the words were raised.
    """
    world = readiness.world_size
    _check_world(world)
    check_int64_vector("epoch", epoch, 1, None)
    check_int64_vector("words", words, readiness.words, epoch.device)
    check_int64_vector("status", status, 1 + world, epoch.device)
    if not (0 <= first_row_block and 1 <= row_blocks
            and first_row_block + row_blocks <= readiness.max_row_blocks):
        raise ValueError(f"row_blocks {row_blocks} from first_row_block {first_row_block} must "
                         f"be a non-empty range within [0, {readiness.max_row_blocks})")
    if timeout_ns < 0:
        raise ValueError(f"timeout_ns must be >= 0, got {timeout_ns}")
    _wait_ready_kernel[(world,)](
        epoch, words, status, first_row_block, row_blocks, readiness.max_row_blocks, timeout_ns,
        HEADS_PER_RANK=readiness.heads_per_rank, BLOCK=_config.WAIT_BLOCK,
        INTERPRET=_config.INTERPRET, num_warps=_config.WAIT_NUM_WARPS)
