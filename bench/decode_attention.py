"""The decode loop's attention as one kernel: rotary embedding of q and k, the KV cache write and attention
of one new token per sequence over its cached positions (GQA), for bench/e2e.py's fused ways.

At batch 1 the decode step of a Llama-3-8B shape spent about 9 us per layer here in three kernels (Inductor's
rotary + cache write, cuDNN's flash kernel, built for prefill, and its prologue) for a few hundred KB of cache:
launches and latency, not bytes. One program per (sequence, KV head) does the whole of it: it rotates the G
query heads of its group and the new key (in float32, rounded once to the cache's dtype, as Inductor's kernel
did), writes the new key and value into the cache at `pos`, and runs an online softmax over positions
0 .. pos - 1 read from the cache plus position pos from its registers (so it never reads back its own write).
Each block of cached positions loads while the one before is used, the first one before the kernel waits for
the GEMM before it under a programmatic launch (NVFP4 step at batch 1: 2.110 -> 2.044 ms, run 22d). It
releases the GEMM after it (o_proj) at its start: the 8 programs of batch 1 leave the other SMs free, where
o_proj's CTAs start and load their first weight stages while attention runs (session 25: a per-CTA timeline
showed o_proj entering only 0.5 us before attention ended; step 1.95 -> 1.91 ms, run 25e).
8 warps per program: issue-bound at 4 (one warp per scheduler); step 1.913 -> 1.879 ms at 8, 16 warps or 32 /
128 positions per trip no faster (run 25f), nor two blocks of 64 in flight (run 32a).
Long caches split their positions: at batch 1 only 8 programs run, each looping over every cached position
(the NVFP4 step from position 1024 took 2.34 ms against 1.69 from position 16, run 32a). A cache of more than
SPLIT_POSITIONS slots runs `splits` programs per KV head (attention_splits: while they fit the SMs), each over its
share of whole blocks of the positions below pos; each stores its unnormalized output, running maximum and sum,
and the last of them to take a ticket merges the others'. The split count follows the cache's length, which a
captured graph fixes, not pos, which moves on the device; short caches keep one program and no workspace
(splitting the benchmark's short contexts over up to 64 programs made the step slower, session 30).
"""

import math

import torch
import triton
import triton.language as tl

BLOCK_N, NUM_WARPS = 64, 8  # cached positions per loop trip; warps per program
SPLIT_POSITIONS, MAX_SPLITS = 256, 16  # cache slots per program of a KV head, at most this many programs


def attention_splits(cache_len: int, programs: int = 1, sms: int = None) -> int:
    """Programs per (sequence, KV head) for a cache of cache_len positions, where `programs` (sequences x KV heads)
    run unsplit on a GPU of `sms` SMs (None: no limit): a split only while all of them fit the SMs. Batch 16 of
    Llama-3-8B's 8 KV heads from position 1024: NVFP4 step (e) 3.303 ms with 5 splits, 2.730 with none (run 32d)."""
    cap = MAX_SPLITS if sms is None else max(1, sms // programs)
    return max(1, min(MAX_SPLITS, cap, -(-cache_len // SPLIT_POSITIONS)))


@triton.jit
def _rotate(ptr, d, partner, sign, cos, sin, mask):
    """x * cos + rotate_half(x) * sin in float32 for x at ptr + d (rows by the caller's offsets)."""
    x = tl.load(ptr + d, mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(ptr + partner, mask=mask, other=0.0).to(tl.float32)
    return x * cos + sign * x_partner * sin


@triton.jit
def _load_partial(ptr, D: tl.constexpr, d, mask):
    """A split's running maximum, sum and unnormalized output at ptr (rows by the caller's offsets), from L2: other
    programs wrote them."""
    m = tl.load(ptr + D, mask=mask, other=0.0, cache_modifier=".cg")
    l = tl.load(ptr + D + 1, mask=mask, other=0.0, cache_modifier=".cg")  # noqa: E741
    o = tl.load(ptr + d[None, :], mask=mask, other=0.0, cache_modifier=".cg")
    return m, l, o


@triton.jit
def decode_attention_kernel(QKV, COS, SIN, POS, K_CACHE, V_CACHE, O, PARTS, TICKETS,
                            stride_qkv, stride_cache_b, stride_cache_h, stride_cache_l, stride_o, sm_scale,
                            HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, GP: tl.constexpr,
                            BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    if PDL:  # the next GEMM's CTAs start now and load their first weights while this kernel runs
        tl.extra.cuda.gdc_launch_dependents()
    G: tl.constexpr = HQ // HKV
    dtype = K_CACHE.dtype.element_ty
    d = tl.arange(0, D)
    n = tl.arange(0, BLOCK_N)
    cache = b * stride_cache_b + h * stride_cache_h
    blocks = cache + n[:, None] * stride_cache_l + d[None, :]
    # Before the wait, under a programmatic launch: pos, the rotary tables and the first block of cached positions
    # (below pos). No kernel of a decode step before this one writes them (pos moves, and rows are written only
    # here, one step apart)
    pos = tl.load(POS)
    cos = tl.load(COS + pos * D + d).to(tl.float32)
    sin = tl.load(SIN + pos * D + d).to(tl.float32)
    # this program's cached positions [lo, hi): whole blocks of an even share, the last split the rest
    if SPLITS == 1:  # kept apart: the general form made the short-context step 0.2-0.6% slower (run 32b)
        lo = 0
        hi = pos
    else:
        chunk = tl.cdiv(tl.cdiv(pos, SPLITS), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(pos, lo + chunk)
    k_block = tl.load(K_CACHE + blocks + lo * stride_cache_l, mask=(lo + n < hi)[:, None], other=0.0)
    v_block = tl.load(V_CACHE + blocks + lo * stride_cache_l, mask=(lo + n < hi)[:, None], other=0.0)
    if PDL:  # qkv comes from the GEMM before this kernel
        tl.extra.cuda.gdc_wait()

    partner = (d + D // 2) % D  # rotate_half: [-x2, x1]
    sign = tl.where(d < D // 2, -1.0, 1.0)
    row = QKV + b * stride_qkv
    g = tl.arange(0, GP)  # the group's query heads, padded to the dot's 16 rows
    q_rows = (h * G + g)[:, None] * D
    g_mask = (g < G)[:, None]
    q = _rotate(row + q_rows, d[None, :], partner[None, :], sign, cos, sin, g_mask).to(dtype)
    k = _rotate(row + HQ * D + h * D, d, partner, sign, cos, sin, d < D).to(dtype)
    v = tl.load(row + (HQ + HKV) * D + h * D + d)
    if SPLITS == 1:  # a compile-time branch: the one-split kernel keeps its code (170 registers, not 174)
        tl.store(K_CACHE + cache + pos * stride_cache_l + d, k)
        tl.store(V_CACHE + cache + pos * stride_cache_l + d, v)
    elif split == 0:  # one writer
        tl.store(K_CACHE + cache + pos * stride_cache_l + d, k)
        tl.store(V_CACHE + cache + pos * stride_cache_l + d, v)

    # position pos from registers starts split 0's running maximum, sum and output; the other splits start empty
    qk_scale = sm_scale * 1.4426950408889634  # exp2
    m_i = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], 1) * qk_scale
    l_i = tl.full([GP], 1.0, tl.float32)
    acc = tl.zeros([GP, D], tl.float32) + v.to(tl.float32)[None, :]
    if SPLITS > 1:
        m_i = tl.where(split == 0, m_i, -float("inf"))
        l_i = tl.where(split == 0, l_i, 0.0)
        acc = tl.where(split == 0, acc, 0.0)
    start = lo
    while start < hi:  # not a range(): Triton's interpreter cannot take a loaded bound there (CPU tests)
        ahead = (start + BLOCK_N + n < hi)[:, None]  # the next block loads while this one is used
        k_next = tl.load(K_CACHE + blocks + (start + BLOCK_N) * stride_cache_l, mask=ahead, other=0.0)
        v_next = tl.load(V_CACHE + blocks + (start + BLOCK_N) * stride_cache_l, mask=ahead, other=0.0)
        s = tl.dot(q, tl.trans(k_block), input_precision="ieee") * qk_scale
        s = tl.where((start + n < hi)[None, :], s, -float("inf"))  # a block holds at least one: m_new is finite
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(dtype), v_block, input_precision="ieee")
        m_i = m_new
        k_block, v_block = k_next, v_next
        start += BLOCK_N
    out = O + b * stride_o + q_rows + d[None, :]
    if SPLITS == 1:
        tl.store(out, (acc / l_i[:, None]).to(O.dtype.element_ty), mask=g_mask)
    else:
        # PARTS [batch, HQ, SPLITS, D + 2] float32: each split's unnormalized output, then its maximum and sum
        part_rows = PARTS + ((b * HQ + h * G + g) * SPLITS)[:, None] * (D + 2)
        mine = part_rows + split * (D + 2)
        tl.store(mine + d[None, :], acc, mask=g_mask)
        tl.store(mine + D, m_i[:, None], mask=g_mask)
        tl.store(mine + D + 1, l_i[:, None], mask=g_mask)
        tl.debug_barrier()  # every thread's partials before the ticket's release
        ticket = tl.atomic_add(TICKETS + b * HKV + h, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLITS - 1:  # the last split: the others' partials are visible; merged in split order
            m_all, l_all, o = _load_partial(part_rows, D, d, g_mask)  # split 0's maximum is finite
            for r in tl.static_range(1, SPLITS):
                m_r, l_r, o_r = _load_partial(part_rows + r * (D + 2), D, d, g_mask)
                m_new = tl.maximum(m_all, m_r)
                alpha, beta = tl.exp2(m_all - m_new), tl.exp2(m_r - m_new)  # an empty split: beta 0
                l_all = l_all * alpha + l_r * beta
                o = o * alpha + o_r * beta
                m_all = m_new
            tl.store(out, (o / l_all).to(O.dtype.element_ty), mask=g_mask)
            tl.store(TICKETS + b * HKV + h, 0)  # ready for the next call


def _check(qkv, cos, sin, pos, k_cache, v_cache, heads):
    batch, kv_heads, cache_len, head_dim = k_cache.shape
    width = (heads + 2 * kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape != (batch, width) or qkv.stride(1) != 1:
        raise ValueError(f"decode_attention: qkv {tuple(qkv.shape)} must be [batch={batch}, {width}] with unit "
                         f"column stride ({heads} query + 2 x {kv_heads} KV heads of {head_dim})")
    if v_cache.shape != k_cache.shape or k_cache.stride(3) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError(f"decode_attention: k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} "
                         "must be [batch, kv_heads, cache_len, head_dim] with equal strides, head_dim contiguous")
    if qkv.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype or len({t.device for t in (qkv, cos, sin, pos,
                                                                                           k_cache, v_cache)}) > 1:
        raise ValueError(f"decode_attention: qkv ({qkv.dtype}, {qkv.device}) and the caches ({k_cache.dtype}, "
                         f"{v_cache.dtype}) must share a dtype, and all tensors one device")
    if heads % kv_heads or head_dim & (head_dim - 1):
        raise ValueError(f"decode_attention: {heads} query heads over {kv_heads} KV heads of {head_dim} (a power "
                         "of two) needed")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 2 or t.shape[1] != head_dim or not t.is_contiguous():
            raise ValueError(f"decode_attention: {name} {tuple(t.shape)} must be a contiguous [positions, {head_dim}]")
    if pos.numel() != 1 or pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"decode_attention: pos must be one integer, got {tuple(pos.shape)} {pos.dtype}")


@torch.library.custom_op("microscale_bench::decode_attention", mutates_args=("k_cache", "v_cache", "tickets"))
def decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, tickets: torch.Tensor, heads: int, splits: int = 1,
                     pdl: bool = False) -> torch.Tensor:
    """Attention output [batch, heads * head_dim] of one new token per sequence at position `pos` (a device
    scalar, the same for every sequence; positions above it are never read); qkv [batch, (heads + 2 *
    kv_heads) * head_dim] are its projections before the rotary embedding, cos / sin [positions, head_dim]
    the rotary tables. Writes the rotated key and the value into k_cache / v_cache [batch, kv_heads,
    cache_len, head_dim] at pos. splits: programs per (sequence, KV head) (attention_splits), which count
    their tickets in `tickets` (int32 [batch, kv_heads], zeros, left zero). pdl: a programmatic dependent launch
    (Inductor's TORCHINDUCTOR_ENABLE_PDL)."""
    _check(qkv, cos, sin, pos, k_cache, v_cache, heads)
    batch, kv_heads, _, head_dim = k_cache.shape
    if tickets.shape != (batch, kv_heads) or tickets.dtype != torch.int32 or not tickets.is_contiguous() \
            or tickets.device != qkv.device or not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"decode_attention: tickets {tuple(tickets.shape)} {tickets.dtype} must be a contiguous "
                         f"int32 [batch={batch}, kv_heads={kv_heads}] on {qkv.device}, and splits={splits} in "
                         f"1..{MAX_SPLITS}")
    out = torch.empty(batch, heads * head_dim, dtype=qkv.dtype, device=qkv.device)
    parts = out if splits == 1 else torch.empty(batch, heads, splits, head_dim + 2, dtype=torch.float32,
                                                device=qkv.device)
    decode_attention_kernel[(batch, kv_heads, splits)](
        qkv, cos, sin, pos, k_cache, v_cache, out, parts, tickets, qkv.stride(0), *k_cache.stride()[:3],
        out.stride(0), 1.0 / math.sqrt(head_dim), HQ=heads, HKV=kv_heads, D=head_dim,
        GP=max(16, triton.next_power_of_2(heads // kv_heads)), BLOCK_N=BLOCK_N, SPLITS=splits, PDL=pdl,
        num_warps=NUM_WARPS, launch_pdl=pdl)
    return out


@decode_attention.register_fake
def _(qkv, cos, sin, pos, k_cache, v_cache, tickets, heads, splits=1, pdl=False):
    return qkv.new_empty(k_cache.shape[0], heads * k_cache.shape[3])


def decode_attention_reference(qkv, cos, sin, pos: int, k_cache, v_cache, heads: int) -> torch.Tensor:
    """The same in torch (transformers' rotary and SDPA with GQA, in float64), updating the caches the same way;
    the independent check of the kernel."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    batch, kv_heads, _, head_dim = k_cache.shape
    q, k, v = qkv.double().split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q, k, v = (t.view(batch, -1, 1, head_dim) for t in (q, k, v))
    q, k = apply_rotary_pos_emb(q, k, cos[pos].double()[None], sin[pos].double()[None])
    k_cache[:, :, pos] = k[:, :, 0].to(k_cache.dtype)
    v_cache[:, :, pos] = v[:, :, 0].to(v_cache.dtype)
    keys, values = k_cache[:, :, :pos + 1].double(), v_cache[:, :, :pos + 1].double()
    o = torch.nn.functional.scaled_dot_product_attention(q.to(k_cache.dtype).double(), keys, values, enable_gqa=True)
    return o.reshape(batch, heads * head_dim)
