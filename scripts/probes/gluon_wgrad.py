"""Gluon kernels (SM90) for the experts' block-scaled wgrad, both operands 1x128 along the tokens,
that overlap each 128-token step's FP32 promotion with the next step's tensor-core work. A
probe's kernels (``probe_gluon_wgrad.py``), not the package's: none beat cuBLAS.

Why they were tried: cuBLAS's kernel for this scale pair runs ~26% slower than its 1x128 x
128x128 dgrad of the same shape (docs/benchmarks.md runs X and Y) and has no faster
configuration, and Triton's ``tl.dot`` (``triton_grouped.grouped_kgroup``) waits for every MMA
before it scales the result. Here each step's MMA is issued asynchronously into one of two
accumulators while the previous step's result is scaled (``s_a[n] * s_b[k]`` per output element)
into the FP32 sum.

Four kernels, which differ in how the operands reach shared memory (docs/benchmarks.md run Z;
TFLOP/s at 8 experts x 2048 tokens, both shapes, the best configuration of each, against
846-867 for cuBLAS per expert and 632-647 for the Triton kernel):

==============================  ===================================================  ==========
kernel                          copies                                               TFLOP/s
==============================  ===================================================  ==========
``_wgrad_kernel``               ``cp.async`` by every thread, CTA barriers per step  643-673
``_wgrad_tma_kernel``           TMA, descriptors built in each program               499-507
``_wgrad_tma_expert_kernel``    TMA, host descriptors, one launch per expert         568-588
``_wgrad_ws_expert_kernel``     the same, warp-specialized (copier warp, mbarriers)  644-671
==============================  ===================================================  ==========

All give cuBLAS's bits. With 8192 tokens an expert (64 steps a tile) the warp-specialized one
reached 775-830 against cuBLAS's 917-940, so even long tiles leave it 10-18% behind, and at 16
steps each program's fill and store cost more (a persistent kernel would recover part of that,
not the rest).

ptxas keeps two asynchronous MMAs in flight only while no loop back-edge separates one
accumulator's MMA from a read of the other (otherwise it serializes them: warning C7514), so the
loops run ``UNROLL`` steps per trip and wait for all of them at the end; registers (three
64-value accumulators per thread) cap ``UNROLL`` at 2 for the ``cp.async`` kernel, 4 for the
others.

Problem and operand layout as ``grouped_kgroup`` with ``blocked=True``: per expert
``dw_e = a_e @ b_e.T`` over its tokens, ``a_e [N, m_e]`` and ``b_e [K, m_e]`` back to back in
one buffer each (at ``N * start_e`` and ``K * start_e``), scales ``[M/128, N]`` and ``[M/128, K]``
(one per 128 tokens of each row), every ``m_e`` a multiple of 128.
"""

from __future__ import annotations

from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

BLOCK = 128  # tokens per scale and per MMA step
# shared-memory layouts of an FP8 operand tile (128-byte rows, swizzled for the MMAs) and of a row
# of 128 FP32 scales: the kernels' and the host's TMA descriptors
OPERAND_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2))
SCALE_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))


@gluon.jit
def _load_step(ops, smems, rows_a, rows_b, cols, sc_n, sc_k, m_e, step, STAGES: gl.constexpr):
    """Start the copies of one 128-token step of both operands and their scales into its stage
    (nothing past ``m_e``)."""
    a_base, b_base, sa_base, sb_base, N, K = ops
    a_smem, b_smem, sa_smem, sb_smem = smems
    stage = step % STAGES
    tt = step * 128 + cols
    mask = tt[None, :] < m_e
    async_copy.async_copy_global_to_shared(a_smem.index(stage), a_base + rows_a[:, None] * m_e + tt[None, :], mask)
    async_copy.async_copy_global_to_shared(b_smem.index(stage), b_base + rows_b[:, None] * m_e + tt[None, :], mask)
    ok = step * 128 < m_e
    async_copy.async_copy_global_to_shared(sa_smem.index(stage), sa_base + step * N + sc_n, (sc_n >= 0) & ok)
    async_copy.async_copy_global_to_shared(sb_smem.index(stage), sb_base + step * K + sc_k, (sc_k >= 0) & ok)
    async_copy.commit_group()


@gluon.jit
def _sync(STAGES: gl.constexpr):
    """Wait for this thread's copies of the oldest step and make them visible to the tensor cores'
    (async proxy) reads. The CTA-wide barriers the step also needs (every thread's copies landed;
    every warp done with the MMA two steps back, whose stage the next copy reuses) are Triton's:
    it puts one after the copy wait and one before the MMA (an explicit one cost 4%, run Z). The
    test of the SM90 build checks that they are there."""
    async_copy.wait_group(STAGES - 3)
    fence_async_shared()


@gluon.jit
def _step(ops, smems, rows_a, rows_b, cols, sc_n, sc_k, m_e, step, buf, STAGES: gl.constexpr):
    """Issue one step's MMA into ``buf`` (overwritten, not added to) once its copies landed, after
    starting the copies ``STAGES - 2`` steps ahead."""
    _sync(STAGES)
    _load_step(ops, smems, rows_a, rows_b, cols, sc_n, sc_k, m_e, step + STAGES - 2, STAGES)
    stage = step % STAGES
    return warpgroup_mma(smems[0].index(stage), smems[1].index(stage).permute((1, 0)), buf, use_acc=False,
                         is_async=True)


@gluon.jit
def _promote(acc, part, smems, step, STAGES: gl.constexpr, mma: gl.constexpr, SCALED: gl.constexpr = True):
    """``acc + part * s_a[n] * s_b[k]`` with one step's scales of the tile's rows (a) and columns (b)
    (``SCALED=False``: ``acc + part``, a wrong result that times the pipeline without the scales)."""
    if not SCALED:
        return acc + part
    s_a = smems[2].index(step % STAGES).load(gl.SliceLayout(1, mma))
    s_b = smems[3].index(step % STAGES).load(gl.SliceLayout(0, mma))
    return acc + part * (s_a[:, None] * s_b[None, :])


@gluon.jit
def _two_accumulators(issue, retire, ctx, n_steps, acc, buf_x, buf_y, UNROLL: gl.constexpr, STAGES: gl.constexpr,
                      mma: gl.constexpr, SCALED: gl.constexpr = True):
    """``acc`` plus the promoted products of ``n_steps`` steps, two accumulators taking the steps
    in turn: while one step's MMA runs (``issue(ctx, step, buf, STAGES)``, asynchronous), the
    previous step's result is scaled into ``acc`` (``retire(ctx, acc, part, step, STAGES, mma,
    SCALED)``; ``ctx``: the kernel's tensors and buffers, constants go as arguments). ptxas keeps MMAs
    asynchronous only while no loop back-edge separates an accumulator's MMA from a read of the
    other one, so the loop runs UNROLL steps per trip and waits for all of them at its end (that
    step's promotion is not overlapped); the last n_steps % UNROLL steps run one at a time."""
    n_main = n_steps // UNROLL * UNROLL
    for g in range(0, n_main, UNROLL):
        tok_x = issue(ctx, g, buf_x, STAGES)
        for u in gl.static_range(1, UNROLL):
            if u % 2 == 1:
                tok_y = issue(ctx, g + u, buf_y, STAGES)
                buf_x = warpgroup_mma_wait(num_outstanding=1, deps=(tok_x, ))
                acc = retire(ctx, acc, buf_x, g + u - 1, STAGES, mma, SCALED)
            else:
                tok_x = issue(ctx, g + u, buf_x, STAGES)
                buf_y = warpgroup_mma_wait(num_outstanding=1, deps=(tok_y, ))
                acc = retire(ctx, acc, buf_y, g + u - 1, STAGES, mma, SCALED)
        buf_y = warpgroup_mma_wait(num_outstanding=0, deps=(tok_y, ))
        acc = retire(ctx, acc, buf_y, g + UNROLL - 1, STAGES, mma, SCALED)
    for i in range(n_main, n_steps):
        tok_x = issue(ctx, i, buf_x, STAGES)
        buf_x = warpgroup_mma_wait(num_outstanding=0, deps=(tok_x, ))
        acc = retire(ctx, acc, buf_x, i, STAGES, mma, SCALED)
    return acc


@gluon.jit
def _cp_issue(ctx, step, buf, STAGES: gl.constexpr):
    ops, smems, rows_a, rows_b, cols, sc_n, sc_k, m_e = ctx
    return _step(ops, smems, rows_a, rows_b, cols, sc_n, sc_k, m_e, step, buf, STAGES)


@gluon.jit
def _cp_retire(ctx, acc, part, step, STAGES: gl.constexpr, mma: gl.constexpr, SCALED: gl.constexpr):
    return _promote(acc, part, ctx[1], step, STAGES, mma, SCALED)


@gluon.jit
def _store_tile(c_ptr, acc, row0, col0, K, BN: gl.constexpr, BK: gl.constexpr, mma: gl.constexpr):
    """Write the ``BN x BK`` tile ``acc`` at (``row0``, ``col0``) of the row-major ``[*, K]``
    output at ``c_ptr``."""
    rn = row0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    rk = col0 + gl.arange(0, BK, layout=gl.SliceLayout(0, mma))
    gl.store(c_ptr + rn[:, None].to(gl.int64) * K + rk[None, :], acc.to(c_ptr.dtype.element_ty))


@gluon.jit
def _tma_buffers(descs, STAGES: gl.constexpr):
    """Shared memory for ``STAGES`` steps of the four TMA copies, each in its descriptor's layout."""
    return (gl.allocate_shared_memory(descs[0].dtype, [STAGES] + descs[0].block_type.shape, descs[0].layout),
            gl.allocate_shared_memory(descs[1].dtype, [STAGES] + descs[1].block_type.shape, descs[1].layout),
            gl.allocate_shared_memory(descs[2].dtype, [STAGES] + descs[2].block_type.shape, descs[2].layout),
            gl.allocate_shared_memory(descs[3].dtype, [STAGES] + descs[3].block_type.shape, descs[3].layout))


@gluon.jit
def _tile(off_ptr, n_tn, n_tk):
    """This program's expert, output tile (row and column block) and the expert's first token and
    token count (``off_ptr``: the experts' token offsets, int32 or int64, multiples of 128)."""
    pid = gl.program_id(0)
    per_e = n_tn * n_tk
    e = pid // per_e
    start = gl.multiple_of(gl.load(off_ptr + e).to(gl.int32), 128)
    m_e = gl.multiple_of(gl.load(off_ptr + e + 1).to(gl.int32) - start, 128)
    return e, (pid % per_e) // n_tk, (pid % per_e) % n_tk, start, m_e


@gluon.jit
def _wgrad_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, off_ptr, N, K, n_tn, n_tk,
                  BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, WN: gl.constexpr, UNROLL: gl.constexpr,
                  SCALED: gl.constexpr, num_warps: gl.constexpr):
    BT: gl.constexpr = 128
    e, pid_n, pid_k, start, m_e = _tile(off_ptr, n_tn, n_tk)
    n_steps = m_e // BT

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps // WN, WN],
                                                  instr_shape=[16, BK // WN, 32])
    # a warp copies four whole 128-byte rows per instruction (one row segment of 64 bytes per
    # thread needs fewer address registers but ran 27% slower)
    ld: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[4, 8],
                                        warps_per_cta=[num_warps, 1], order=[1, 0])
    vec: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    smems = (gl.allocate_shared_memory(a_ptr.dtype.element_ty, [STAGES, BN, BT], OPERAND_SMEM),
             gl.allocate_shared_memory(b_ptr.dtype.element_ty, [STAGES, BK, BT], OPERAND_SMEM),
             gl.allocate_shared_memory(gl.float32, [STAGES, BN], vec),
             gl.allocate_shared_memory(gl.float32, [STAGES, BK], vec))

    rows_a = (pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, ld))).to(gl.int64)
    rows_b = (pid_k * BK + gl.arange(0, BK, layout=gl.SliceLayout(1, ld))).to(gl.int64)
    cols = gl.arange(0, BT, layout=gl.SliceLayout(0, ld))
    sc: gl.constexpr = gl.BlockedLayout(size_per_thread=[4], threads_per_warp=[32], warps_per_cta=[num_warps],
                                        order=[0])
    sc_n = pid_n * BN + gl.arange(0, BN, layout=sc)
    sc_k = pid_k * BK + gl.arange(0, BK, layout=sc)
    tb0 = start // BT
    ops = (a_ptr + N.to(gl.int64) * start, b_ptr + K.to(gl.int64) * start, sa_ptr + tb0 * N, sb_ptr + tb0 * K, N, K)
    acc = gl.zeros([BN, BK], dtype=gl.float32, layout=mma)
    for j in gl.static_range(STAGES - 2):  # the first steps' copies in flight
        _load_step(ops, smems, rows_a, rows_b, cols, sc_n, sc_k, m_e, j, STAGES)
    ctx = (ops, smems, rows_a, rows_b, cols, sc_n, sc_k, m_e)
    acc = _two_accumulators(_cp_issue, _cp_retire, ctx, n_steps, acc, gl.zeros_like(acc), gl.zeros_like(acc), UNROLL,
                            STAGES, mma, SCALED)
    async_copy.wait_group(0)
    _store_tile(c_ptr + e.to(gl.int64) * N * K, acc, pid_n * BN, pid_k * BK, K, BN, BK, mma)


@gluon.jit
def _tma_issue(descs, smems, ready, rows, step, n_steps, STAGES: gl.constexpr):
    """Start the TMA copies of one step (both operands' tiles and their scales) into its stage;
    ``ready`` of the stage completes when all have landed. Nothing past the last step."""
    stage = step % STAGES
    ok = step < n_steps
    bar = ready.index(stage)
    nbytes: gl.constexpr = (descs[0].block_type.nbytes + descs[1].block_type.nbytes  # both tiles
                               + descs[2].block_type.nbytes + descs[3].block_type.nbytes)  # their scales
    mbarrier.expect(bar, nbytes, pred=ok)
    tma.async_copy_global_to_shared(descs[0], [rows[0], step * 128], bar, smems[0].index(stage), pred=ok)
    tma.async_copy_global_to_shared(descs[1], [rows[1], step * 128], bar, smems[1].index(stage), pred=ok)
    tma.async_copy_global_to_shared(descs[2], [step, rows[0]], bar, smems[2].index(stage), pred=ok)
    tma.async_copy_global_to_shared(descs[3], [step, rows[1]], bar, smems[3].index(stage), pred=ok)


@gluon.jit
def _tma_step(descs, smems, ready, rows, step, n_steps, buf, STAGES: gl.constexpr):
    """Wait for one step's copies, line up the CTA (every warp has then finished the MMA two steps
    back, whose stage the next copy reuses), start the copies ``STAGES - 2`` steps ahead and issue
    the step's MMA into ``buf`` (overwritten)."""
    stage = step % STAGES
    mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
    gl.thread_barrier()
    _tma_issue(descs, smems, ready, rows, step + STAGES - 2, n_steps, STAGES)
    return warpgroup_mma(smems[0].index(stage), smems[1].index(stage).permute((1, 0)), buf, use_acc=False,
                         is_async=True)


@gluon.jit
def _tma_promote(acc, part, smems, step, STAGES: gl.constexpr, mma: gl.constexpr):
    """``acc + part * s_a[n] * s_b[k]`` with one step's scales from shared memory."""
    s_a = smems[2].index(step % STAGES).reshape([128]).load(gl.SliceLayout(1, mma))
    s_b = smems[3].index(step % STAGES).reshape([128]).load(gl.SliceLayout(0, mma))
    return acc + part * (s_a[:, None] * s_b[None, :])


@gluon.jit
def _tma_issue_step(ctx, step, buf, STAGES: gl.constexpr):
    descs, smems, ready, rows, n_steps = ctx
    return _tma_step(descs, smems, ready, rows, step, n_steps, buf, STAGES)


@gluon.jit
def _tma_retire(ctx, acc, part, step, STAGES: gl.constexpr, mma: gl.constexpr, SCALED: gl.constexpr):
    return _tma_promote(acc, part, ctx[1], step, STAGES, mma)


@gluon.jit
def _tma_mainloop(descs, smems, rows, n_steps, STAGES: gl.constexpr, UNROLL: gl.constexpr, mma: gl.constexpr):
    """The FP32 sum of a 128x128 output tile over ``n_steps`` (> 0) steps: ``STAGES`` buffers of
    TMA copies, two accumulators in turn (see ``_wgrad_kernel``)."""
    acc = gl.zeros([128, 128], dtype=gl.float32, layout=mma)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    fence_async_shared()
    gl.thread_barrier()
    for j in gl.static_range(STAGES - 2):
        _tma_issue(descs, smems, ready, rows, j, n_steps, STAGES)
    acc = _two_accumulators(_tma_issue_step, _tma_retire, (descs, smems, ready, rows, n_steps), n_steps, acc,
                            gl.zeros_like(acc), gl.zeros_like(acc), UNROLL, STAGES, mma)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
    return acc


@gluon.jit
def _wgrad_tma_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, off_ptr, N, K, n_tn, n_tk, STAGES: gl.constexpr,
                      UNROLL: gl.constexpr, num_warps: gl.constexpr):
    """``_wgrad_kernel`` with TMA copies (one thread issues them; an mbarrier per stage says they
    landed) in place of every thread's ``cp.async``: fewer registers and instructions per step."""
    BT: gl.constexpr = 128
    e, pid_n, pid_k, start, m_e = _tile(off_ptr, n_tn, n_tk)
    n_steps = m_e // BT
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, 128, 32])
    acc = gl.zeros([128, 128], dtype=gl.float32, layout=mma)
    if n_steps > 0:
        tb0 = start // BT
        descs = (tma.make_tensor_descriptor(a_ptr + N.to(gl.int64) * start, [N, m_e], [m_e, 1], [128, BT],
                                            OPERAND_SMEM),
                 tma.make_tensor_descriptor(b_ptr + K.to(gl.int64) * start, [K, m_e], [m_e, 1], [128, BT],
                                            OPERAND_SMEM),
                 tma.make_tensor_descriptor(sa_ptr + tb0 * N, [n_steps, N], [N, 1], [1, 128], SCALE_SMEM),
                 tma.make_tensor_descriptor(sb_ptr + tb0 * K, [n_steps, K], [K, 1], [1, 128], SCALE_SMEM))
        acc = _tma_mainloop(descs, _tma_buffers(descs, STAGES), (pid_n * 128, pid_k * 128), n_steps, STAGES, UNROLL,
                            mma)
    _store_tile(c_ptr + e.to(gl.int64) * N * K, acc, pid_n * 128, pid_k * 128, K, 128, 128, mma)


@gluon.jit
def _wgrad_tma_expert_kernel(a_desc, b_desc, sa_desc, sb_desc, c_ptr, K, n_steps, n_tk, STAGES: gl.constexpr,
                             UNROLL: gl.constexpr, num_warps: gl.constexpr):
    """One expert's ``_wgrad_tma_kernel``, its TMA descriptors built on the host (no descriptor
    set-up in each program): ``a [N, m]``, ``b [K, m]``, scales ``[m/128, N]``, ``[m/128, K]``."""
    pid = gl.program_id(0)
    pid_n = pid // n_tk
    pid_k = pid % n_tk
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, 128, 32])
    descs = (a_desc, b_desc, sa_desc, sb_desc)
    acc = _tma_mainloop(descs, _tma_buffers(descs, STAGES), (pid_n * 128, pid_k * 128), n_steps, STAGES, UNROLL, mma)
    _store_tile(c_ptr, acc, pid_n * 128, pid_k * 128, K, 128, 128, mma)


@gluon.jit
def _ws_loads(descs, smems, ready, empty, rows, n_steps, STAGES: gl.constexpr):
    """Warp-specialized copier (one warp): each step's four TMA copies as soon as its stage is
    free (``empty``), ``ready`` completing when they land."""
    for i in range(n_steps):
        stage = i % STAGES
        mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
        bar = ready.index(stage)
        nbytes: gl.constexpr = (descs[0].block_type.nbytes + descs[1].block_type.nbytes  # both tiles
                               + descs[2].block_type.nbytes + descs[3].block_type.nbytes)  # their scales
        mbarrier.expect(bar, nbytes)
        tma.async_copy_global_to_shared(descs[0], [rows[0], i * 128], bar, smems[0].index(stage))
        tma.async_copy_global_to_shared(descs[1], [rows[1], i * 128], bar, smems[1].index(stage))
        tma.async_copy_global_to_shared(descs[2], [i, rows[0]], bar, smems[2].index(stage))
        tma.async_copy_global_to_shared(descs[3], [i, rows[1]], bar, smems[3].index(stage))


@gluon.jit
def _ws_issue(ctx, step, buf, STAGES: gl.constexpr):
    """Issue a step's MMA once the copier says its copies landed."""
    smems, ready, empty = ctx
    stage = step % STAGES
    mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
    return warpgroup_mma(smems[0].index(stage), smems[1].index(stage).permute((1, 0)), buf, use_acc=False,
                         is_async=True)


@gluon.jit
def _ws_retire(ctx, acc, part, step, STAGES: gl.constexpr, mma: gl.constexpr, SCALED: gl.constexpr):
    """Scale a finished step into ``acc``, then hand its stage back to the copier (after every
    consumer warp is done with it)."""
    smems, ready, empty = ctx
    acc = _tma_promote(acc, part, smems, step, STAGES, mma)
    gl.thread_barrier()
    mbarrier.arrive(empty.index(step % STAGES), count=1)
    return acc


@gluon.jit
def _ws_mma(smems, ready, empty, n_steps, STAGES: gl.constexpr, UNROLL: gl.constexpr, mma: gl.constexpr):
    """Warp-specialized consumer (the default partition): the two-accumulator loop of
    ``_tma_mainloop`` with mbarrier hand-offs in place of CTA barriers."""
    acc = gl.zeros([128, 128], dtype=gl.float32, layout=mma)
    acc = _two_accumulators(_ws_issue, _ws_retire, (smems, ready, empty), n_steps, acc, gl.zeros_like(acc),
                            gl.zeros_like(acc), UNROLL, STAGES, mma)
    return (acc, )  # a partition's results go back as a tuple


@gluon.jit
def _wgrad_ws_expert_kernel(a_desc, b_desc, sa_desc, sb_desc, c_ptr, K, n_steps, n_tk, STAGES: gl.constexpr,
                            UNROLL: gl.constexpr, LOAD_REGS: gl.constexpr, num_warps: gl.constexpr):
    """``_wgrad_tma_expert_kernel`` warp-specialized: one warp copies, the kernel's warps (two
    warpgroups) run the MMAs and promotions; they hand stages over through mbarriers."""
    pid = gl.program_id(0)
    pid_n = pid // n_tk
    pid_k = pid % n_tk
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, 128, 32])
    descs = (a_desc, b_desc, sa_desc, sb_desc)
    smems = _tma_buffers(descs, STAGES)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    rows = (pid_n * 128, pid_k * 128)
    acc = gl.warp_specialize([(_ws_mma, (smems, ready, empty, n_steps, STAGES, UNROLL, mma)),
                              (_ws_loads, (descs, smems, ready, empty, rows, n_steps, STAGES))], [1], [LOAD_REGS])[0]
    _store_tile(c_ptr, acc, pid_n * 128, pid_k * 128, K, 128, 128, mma)


def _check(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, splits: list[int], n: int,
           k: int, stages: int, unroll: int) -> None:
    """The operands and settings the kernels assume, or a ValueError naming what is off."""
    m = sum(splits)
    problems = []
    if n % BLOCK or k % BLOCK:
        problems.append(f"N={n} and K={k} must be multiples of {BLOCK}")
    if any(s % BLOCK or s < 0 for s in splits):
        problems.append(f"every split must be a non-negative multiple of {BLOCK} (got {splits})")
    if stages < 3:
        problems.append(f"stages={stages} must be at least 3 (the copies run stages - 2 steps ahead)")
    if unroll < 2 or unroll % 2:
        problems.append(f"unroll={unroll} must be even and at least 2")
    for name, t, numel in (("a", a, n * m), ("b", b, k * m)):
        if t.numel() != numel or not t.is_contiguous() or t.element_size() != 1:
            problems.append(f"{name} must be {numel} contiguous FP8 values (got {t.numel()} {t.dtype})")
    for name, t, width in (("sa", sa, n), ("sb", sb, k)):
        if tuple(t.shape) != (m // BLOCK, width) or t.dtype != torch.float32 or not t.is_contiguous():
            problems.append(f"{name} must be contiguous FP32 [{m // BLOCK}, {width}] (got {tuple(t.shape)} {t.dtype})")
    if problems:
        raise ValueError("gluon_wgrad: " + "; ".join(problems))


def grouped_wgrad_1d1d(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, offsets: torch.Tensor,
                       splits: list[int], n: int, k: int, out_dtype: torch.dtype, *, stages: int = 4, wn: int = 1,
                       unroll: int = 2, warps: int = 8, scaled: bool = True) -> torch.Tensor:
    """``[a_e @ b_e.T for e]`` as ``[G, N, K]`` (see the module docstring); ``offsets``: the
    experts' token offsets on the device, ``splits`` their counts on the host (checked, never read
    back from the device, so that a CUDA graph can capture the call). ``wn``: warps along the
    output's columns; ``unroll``: steps per loop trip (even); ``scaled=False`` leaves the scales
    out (wrong results: for timing the pipeline alone)."""
    g = len(splits)
    _check(a, b, sa, sb, splits, n, k, stages, unroll)
    if wn not in (1, 2) or warps % (4 * wn):
        raise ValueError(f"grouped_wgrad_1d1d: wn={wn} must be 1 or 2, warps={warps} a multiple of 4 * wn")
    c = torch.empty((g, n, k), dtype=out_dtype, device=a.device)
    n_tn, n_tk = n // BLOCK, k // BLOCK
    _wgrad_kernel[(g * n_tn * n_tk,)](a, b, c, sa, sb, offsets, n, k, n_tn, n_tk, BN=BLOCK, BK=BLOCK, STAGES=stages,
                                      WN=wn, UNROLL=unroll, SCALED=scaled, num_warps=warps)
    return c


def grouped_wgrad_tma(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, offsets: torch.Tensor,
                      splits: list[int], n: int, k: int, out_dtype: torch.dtype, *, stages: int = 4,
                      unroll: int = 2) -> torch.Tensor:
    """``grouped_wgrad_1d1d`` through ``_wgrad_tma_kernel``. Each program builds its expert's TMA
    descriptors in global scratch memory (512 bytes a program), which Triton asks torch for."""
    import triton

    g = len(splits)
    _check(a, b, sa, sb, splits, n, k, stages, unroll)
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=a.device))
    c = torch.empty((g, n, k), dtype=out_dtype, device=a.device)
    n_tn, n_tk = n // BLOCK, k // BLOCK
    _wgrad_tma_kernel[(g * n_tn * n_tk,)](a, b, c, sa, sb, offsets, n, k, n_tn, n_tk, STAGES=stages, UNROLL=unroll,
                                          num_warps=8)
    return c


def grouped_wgrad_tma_experts(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                              splits: list[int], n: int, k: int, out_dtype: torch.dtype, *, stages: int = 4,
                              unroll: int = 4, ws: bool = False, load_regs: int = 40) -> torch.Tensor:
    """``grouped_wgrad_tma`` as one launch per expert (the host knows the splits), each with TMA
    descriptors built on the host; zero for an expert without tokens. ``ws``: the
    warp-specialized kernel (one copier warp with ``load_regs`` registers)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _check(a, b, sa, sb, splits, n, k, stages, unroll)
    op, sc = OPERAND_SMEM.value, SCALE_SMEM.value
    c = torch.empty((len(splits), n, k), dtype=out_dtype, device=a.device)
    start = 0
    for e, m in enumerate(splits):
        if not m:
            c[e].zero_()
            continue
        a_e = a[n * start:n * (start + m)].view(n, m)
        b_e = b[k * start:k * (start + m)].view(k, m)
        sa_e, sb_e = sa[start // BLOCK:(start + m) // BLOCK], sb[start // BLOCK:(start + m) // BLOCK]
        descs = [TensorDescriptor.from_tensor(t, block, layout)
                 for t, block, layout in ((a_e, [BLOCK, BLOCK], op), (b_e, [BLOCK, BLOCK], op),
                                          (sa_e, [1, BLOCK], sc), (sb_e, [1, BLOCK], sc))]
        grid = (n // BLOCK * (k // BLOCK),)
        if ws:
            _wgrad_ws_expert_kernel[grid](*descs, c[e], k, m // BLOCK, k // BLOCK, STAGES=stages, UNROLL=unroll,
                                          LOAD_REGS=load_regs, num_warps=8)
        else:
            _wgrad_tma_expert_kernel[grid](*descs, c[e], k, m // BLOCK, k // BLOCK, STAGES=stages, UNROLL=unroll,
                                           num_warps=8)
        start += m
    return c


def _sm90_signature(warp_specialized: bool) -> tuple[Any, list[tuple[str, str]], dict[str, Any], list[str]]:
    """Kernel, argument types, constexprs (the wrappers' defaults) and the arguments a launch on
    the probe's shapes marks 16-byte aligned, for an ahead-of-time build (the launch also marks
    its other integers divisible by 16, which this leaves out)."""
    if not warp_specialized:
        args = [("a_ptr", "*fp8e5"), ("b_ptr", "*fp8e4nv"), ("c_ptr", "*bf16"), ("sa_ptr", "*fp32"),
                ("sb_ptr", "*fp32"), ("off_ptr", "*i64")] + [(name, "i32") for name in ("N", "K", "n_tn", "n_tk")]
        const = dict(BN=BLOCK, BK=BLOCK, STAGES=4, WN=1, UNROLL=2, SCALED=True, num_warps=8)
        return _wgrad_kernel, args, const, [n for n, t in args if t.startswith("*")] + ["N", "K"]
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    op, sc = OPERAND_SMEM.value, SCALE_SMEM.value
    host = [(torch.empty(256, 256, dtype=torch.float8_e5m2), [BLOCK, BLOCK], op),
            (torch.empty(256, 256, dtype=torch.float8_e4m3fn), [BLOCK, BLOCK], op),
            (torch.empty(2, 256), [1, BLOCK], sc), (torch.empty(2, 256), [1, BLOCK], sc)]
    args = [(name, mangle_type(TensorDescriptor.from_tensor(*h)))
            for name, h in zip(("a_desc", "b_desc", "sa_desc", "sb_desc"), host)]
    args += [("c_ptr", "*bf16"), ("K", "i32"), ("n_steps", "i32"), ("n_tk", "i32")]
    const = dict(STAGES=4, UNROLL=4, LOAD_REGS=40, num_warps=8)
    return _wgrad_ws_expert_kernel, args, const, ["c_ptr", "K"]


def sm90_report(warp_specialized: bool = False, **const: Any) -> tuple[str, str]:
    """Build the ``cp.async`` kernel (or the warp-specialized TMA one) ahead of time for
    ``sm_90a`` (no GPU needed; the wrappers' defaults unless given): its PTX and what
    ``ptxas -v`` (Triton's) says about it (registers, spills, and warning C7514/C7515 where it
    serialized the asynchronous MMAs)."""
    from kernel_resources import ptxas_report
    from triton.experimental.gluon._runtime import GluonASTSource

    fn, args, defaults, aligned = _sm90_signature(warp_specialized)
    const = defaults | const
    sig = dict(args) | {name: "constexpr" for name in const}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    kernel, text = ptxas_report(GluonASTSource(fn, sig, const, attrs), const["num_warps"])
    return kernel.asm["ptx"], text


def barrier_before_each_mma(ptx: str) -> bool:
    """Whether a CTA barrier comes between every group of ``cp.async`` copies and the next MMA in
    ``ptx`` (what ``_sync`` relies on Triton for)."""
    last = None
    for line in ptx.splitlines():
        op = line.strip()
        if op.startswith(("cp.async", "bar.sync", "barrier.sync")):
            last = "copy" if op.startswith("cp.async") else "barrier"
        elif op.startswith("wgmma.fence") and last == "copy":
            return False
    return True


if __name__ == "__main__":
    print(sm90_report()[1])
    print(sm90_report(warp_specialized=True)[1])
