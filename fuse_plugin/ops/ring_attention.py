"""Ring attention: context parallelism over `fuse_plugin::attention` (issue 32, first part).

    out, lse = ring_attention(q, k, v, is_causal=True, scale=None, group=None, load_balanced=True,
                              window=0, bias=None)

    # the same without autograd, for callers that own the differentiation (ops/context_parallel.py):
    out, lse = ring_attention_forward(q, k, v, is_causal=..., scale=..., group=..., load_balanced=...)
    dq, dk, dv = ring_attention_backward(dout, q, k, v, out, lse, is_causal=..., ...)

computes, on every rank of `group`, that rank's rows of softmax(q·kᵀ·scale [causal]) · v over the
WHOLE sequence, when each rank holds only its shard of the sequence of q, k and v:
  q (B, Hq, Lq, D), k (B, Hkv, Lq, D), v (B, Hkv, Lq, Dv): the LOCAL shards, every rank with the
  same shapes (Lq tokens each, the global sequence W·Lq for W ranks); Hq a multiple of Hkv (GQA:
  k/v travel and are read with their Hkv heads, never repeated);
  is_causal top-left aligned over the global positions (key j visible to query i iff j <= i), the
  op's rule;
  scale None for 1/sqrt(D);
  group a ProcessGroup or a 1-D DeviceMesh (its group) of the context-parallel ranks; None: the
  default group;
  load_balanced (read only with is_causal) which tokens a rank holds, see Layout.
Outputs: out (B, Hq, Lq, Dv) in q's dtype laid out (B, Lq, Hq, Dv) in memory (the op's layout:
the head merge after it is a view), lse (B, Hq, Lq) float32 (natural log), the rank's rows of the
full attention's. Differentiable in q, k and v (not lse); the backward is collective too: every rank
of the group must run it. dq/dk/dv come back in q/k/v's memory order, as the op's.

Layout (the same as PyTorch's context parallelism, torch.distributed.tensor.experimental:
`context_parallel(...)` and `_context_parallel_shard` with its default `_HeadTailLoadBalancer`, so
tensors sharded by either one are the other's shards too):
  load_balanced (causal): the sequence cut into 2W chunks of c = Lq/2 tokens; rank r holds chunks
    r and 2W-1-r, in that order (Lq must be even). Each rank then has one early and one late chunk,
    the same number of visible causal pairs.
  not load_balanced: rank r holds the contiguous tokens [r·Lq, (r+1)·Lq) (plain Shard on the
    sequence dim). Causal work is then uneven: rank W-1 sees every key, rank 0 only its own.
  Without is_causal every query sees every key, so any sharding works alike (q with k/v).
`shard_sequence` / `unshard_sequence` cut and reassemble a full tensor in this order,
`shard_positions` gives the global positions of a rank's tokens (for rotary tables),
`load_balance_indices` the whole permutation (PyTorch's `_generate_indices()[0]`).

The ring (forward): W steps. At step i rank r holds the k/v block of rank s = (r - i) mod W; it
POSTS the send of that block to rank r+1 and the receive of the next from rank r-1
(`batch_isend_irecv`) BEFORE computing on it, and waits only after, so the transfer of block i+1
overlaps the attention on block i. Each (query chunk, key chunk) pair is classified by the chunks'
global order under the causal mask: full (key chunk earlier: no mask), diagonal (the same chunk:
causal within it) or hidden (key chunk later: nothing to compute). A step runs the op on the
smallest rectangles that hold its visible pairs (`block_calls`); in both layouts that is one op
call per step or none:
  load_balanced, step 0 (own block): one causal call over both chunks (the local concatenation keeps
    the global order, so top-left causal there is exact); source s < r: all queries x the block's
    first chunk, full; s > r: the second query chunk x the whole block, full. Every step of every
    rank costs 2c² visible pairs (step 0: c(2c+1)): balanced.
  not load_balanced: s == r causal, s < r full, s > r hidden: skipped, not computed.
Each call returns its rows' partial (out_b, lse_b) for its keys; they are merged exactly by
logsumexp, lse' = logaddexp(lse, lse_b), out' = out·exp(lse - lse') + out_b·exp(lse_b - lse'),
accumulated in float32 (float64 for float64 inputs), cast to q's dtype at the end. A row whose lse
is -inf (no key visible, only possible once masks come) adds nothing to the merge.

Masks (`window`, `bias`; issue 32's second part):
  window (int, 0: none; needs is_causal): query i sees keys i-W+1..i over the global positions, the
    op's sliding window. The plan then makes one op call per (query chunk, key chunk) pair
    (`pair_calls`, `window_pair_kind`): a pair every one of whose distances i - j is >= W is HIDDEN
    and never computed (at long context most remote blocks: with chunks of c tokens only the pairs
    within W of the diagonal are called, so the ring's work follows the window, as the kernels'
    does); the diagonal pair runs the op's causal window; an earlier pair entirely within W is
    FULL; one the window cuts (BAND) runs with a (1, 1, c, c) -inf mask where d + i - j >= W (d the
    chunks' distance; the op's own window is causal, top-left, and cannot say it).
  bias (B|1, Hq|1, Lq|1, L): a dense additive bias (a mask: -inf hides) sharded with the queries:
    this rank's rows in its shard order (1 row: the same for every query, a per-key padding bias),
    every key column in GLOBAL order; each call reads its rows at its key chunk's global columns.
    A constant: its gradient is not computed (a bias that requires grad is an error). Nothing is
    skipped for a bias (it is not inspected on the host); with a bias `load_balanced` says the
    shards' layout even without is_causal (the columns must be found).
  Rows with no visible key in a block add nothing to the merge (lse -inf); a row with none at all
  gives what the op gives (NaN, as eager).

Backward (flash-attention's ring backward): with the GLOBAL out and lse, p = exp(s - lse) of a
block is exactly that block's share of the full softmax and Delta = rowsum(dout ∘ out) is the full
row's, so each block's backward gives exactly its share of dq and its full dk/dv for the local
queries. The k/v blocks go around the ring again (send posted before compute, as forward); each
block's dk/dv accumulator (float32) rides along with it, each holder adding its share, and a last
hop brings it home to its owner (W hops for dk/dv, W-1 for k/v); the accumulator's receive is
waited for only after the step's compute. dq accumulates locally (float32).
  On CUDA (and on the CPU under FUSE_PLUGIN_CPU_KERNELS=triton) the block backward is the op's
  `attention_backward`, whose kernels take p from the lse and Delta from the out they are passed.
  The CPU reference of that op ignores the out/lse it is passed (it recomputes the block's own
  softmax), which is right for one op call and wrong for a ring block; there the block backward is
  `_reference_block_backward` below: the same formulas in plain torch (float32; float64 inputs:
  float64), reading the global out/lse.

Numerics: in float32 the ring equals the single-process op to rounding (tests: rel err ~1e-7,
checked at 1e-5 for out, 1e-4 for gradients). In 16-bit types each block's out and dk/dv are
rounded to q's dtype by the op before the float32 merge / accumulation, so the ring differs from
one op call by about one 16-bit rounding per block (as PyTorch's context parallelism with SDPA).

Sequence-sharded DTensors: `fuse_plugin::attention` (and its backward op) on q/k/v DTensors placed
Shard(2) on a 1-D mesh run this ring through `ring_attention_forward` / `ring_attention_backward`,
contiguous layout (ops/context_parallel.py).

Compiled models under PyTorch's `context_parallel(...)`: ops/context_parallel.py wraps this ring in
opaque custom ops (`fuse_plugin::ring_attention` and its backward) and routes the rewritten graph's
attention sites to them (`route`, run by both entry points after the rewrite).

GPU (H100 x2, NCCL, bf16, 2026-11-26; benchmarks/ring_check.py): against float64, out / dq / dk /
dv within 5.9e-3 of max |ref| (MHA and GQA, causal balanced and contiguous, full, D 64 / 128,
chunks of 1000 tokens). The blocks run the op's chosen family (cuDNN there, fed the global out /
lse in the backward).

Not here: document structure (not yet an op parameter, issue 31), biases through `route` and the
DTensor handlers, windows through the DTensor handlers (they refuse them: ContextParallelError /
ShardingError; `route` passes a window), dropout,
q and k of different lengths (cross-attention), shards of different lengths across ranks (every
rank must hold the same number of tokens; a mismatch is not detected locally and fails in the P2P
transfer), GPU timings of the windowed ring.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..kernels.host import in_layout_of, layout_like
from .attention import _runs_kernel  # the op's own test for "the kernels run this call"

__all__ = ["ring_attention", "ring_attention_forward", "ring_attention_backward", "shard_sequence",
           "unshard_sequence", "shard_positions", "load_balance_indices", "block_calls", "pair_calls", "BlockCall",
           "FULL", "DIAGONAL", "HIDDEN", "BAND"]

FULL, DIAGONAL, HIDDEN, BAND = "full", "diagonal", "hidden", "band"


# ----------------------------------------------------------------------------- layout


def chunks_of(rank: int, world_size: int, load_balanced: bool) -> tuple[int, ...]:
    """The global chunk indices rank `rank` holds, in its local order: (r, 2W-1-r) of 2W chunks
    when load-balanced, else (r,) of W chunks."""
    return (rank, 2 * world_size - 1 - rank) if load_balanced else (rank,)


def load_balance_indices(seq_len: int, world_size: int, device=None) -> Tensor:
    """(seq_len,) int64: the global position of each token of the concatenated shards of ranks
    0..W-1 in the load-balanced order, i.e. shard r = x[..., idx[r·L/W:(r+1)·L/W], ...]. Equal to
    PyTorch's `_HeadTailLoadBalancer(seq_len, W, device)._generate_indices()[0]`."""
    if seq_len % (2 * world_size):
        raise ValueError(f"ring_attention: a load-balanced sequence of {seq_len} tokens over {world_size} ranks: "
                         f"the length must be a multiple of 2·world_size = {2 * world_size}")
    chunks = torch.arange(seq_len, device=device).view(2 * world_size, -1)
    return torch.cat([chunks[list(chunks_of(r, world_size, True))].reshape(-1) for r in range(world_size)])


def shard_positions(local_len: int, rank: int, world_size: int, *, load_balanced: bool = True,
                    device=None) -> Tensor:
    """(local_len,) int64: the global positions of the tokens rank `rank` holds (its rotary
    positions, say), for shards of local_len tokens."""
    if load_balanced:
        return load_balance_indices(local_len * world_size, world_size, device)[
            rank * local_len:(rank + 1) * local_len]
    return torch.arange(rank * local_len, (rank + 1) * local_len, device=device)


def shard_sequence(x: Tensor, rank: int, world_size: int, *, dim: int = 2, load_balanced: bool = True) -> Tensor:
    """Rank `rank`'s shard of the full tensor `x` along its sequence dim `dim` (a new tensor):
    chunks r and 2W-1-r of 2W (load-balanced) or the r-th of W contiguous pieces. The length must
    divide evenly (by 2W, or W)."""
    n = 2 * world_size if load_balanced else world_size
    if x.shape[dim] % n:
        raise ValueError(f"ring_attention: cannot shard {x.shape[dim]} tokens (dim {dim}) over {world_size} ranks "
                         f"{'load-balanced ' if load_balanced else ''}into {n} equal chunks")
    chunks = x.chunk(n, dim=dim)
    return torch.cat([chunks[c] for c in chunks_of(rank, world_size, load_balanced)], dim=dim)


def unshard_sequence(x: Tensor, *, dim: int = 2, group=None, load_balanced: bool = True) -> Tensor:
    """The full tensor from every rank's shard `x` (a collective: all-gather over `group`), in
    global order. Not differentiable (for outputs, checks and tests)."""
    pg = _resolve_group(group)
    world_size = dist.get_world_size(pg)
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(world_size)]
    dist.all_gather(parts, x.contiguous(), group=pg)
    n = 2 if load_balanced else 1
    chunks: list[Optional[Tensor]] = [None] * (n * world_size)
    for r, part in enumerate(parts):
        for c, piece in zip(chunks_of(r, world_size, load_balanced), part.chunk(n, dim=dim)):
            chunks[c] = piece
    return torch.cat(chunks, dim=dim)


# ----------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class BlockCall:
    """One op call of a ring step: local query rows `q` against rows `k` of the k/v block held
    at that step, top-left causal inside that rectangle when `causal` (a diagonal pair).
    With a sliding window (`pair_calls`): `window` the window (the op's window argument for a
    diagonal pair), `band` the global distance d of an off-diagonal pair's chunks cut by it (query
    row i and key row j of the rectangle are d + i - j apart; those >= the window are hidden, by
    a -inf mask: the op's window is causal, top-left), and
    `k_cols` the key chunk's global columns (what a bias sharded with the queries is read at)."""

    q: slice
    k: slice
    causal: bool
    window: int = 0
    band: Optional[int] = None
    k_cols: Optional[slice] = None


def pair_kind(q_chunk: int, k_chunk: int, is_causal: bool) -> str:
    """FULL, DIAGONAL or HIDDEN: how the causal mask covers (query chunk, key chunk), from the
    chunks' global order (equal chunk lengths)."""
    if not is_causal or k_chunk < q_chunk:
        return FULL
    return DIAGONAL if k_chunk == q_chunk else HIDDEN


def block_calls(q_chunks: Sequence[int], k_chunks: Sequence[int], chunk_len: int, is_causal: bool) -> list[BlockCall]:
    """The op calls that compute every visible pair of the local queries (chunks `q_chunks`, in
    local order) against a k/v block (chunks `k_chunks`), each pair once; [] when all are hidden.
    One call when the visible pairs are one full rectangle of contiguous local chunks, or when the
    block is the queries' own (then causal over it is exact: the local order keeps the global
    one); otherwise, a layout this module does not make, one call per visible pair."""
    kinds = {(i, j): pair_kind(a, b, is_causal) for i, a in enumerate(q_chunks) for j, b in enumerate(k_chunks)}
    live = [ij for ij, kind in kinds.items() if kind != HIDDEN]
    if not live:
        return []

    def span(first: int, last: int) -> slice:
        return slice(first * chunk_len, (last + 1) * chunk_len)

    rows, cols = sorted({i for i, _ in live}), sorted({j for _, j in live})
    if (all(kinds[i, j] == FULL for i in rows for j in cols) and rows == list(range(rows[0], rows[-1] + 1))
            and cols == list(range(cols[0], cols[-1] + 1))):
        return [BlockCall(span(rows[0], rows[-1]), span(cols[0], cols[-1]), False)]
    if list(q_chunks) == list(k_chunks) and list(q_chunks) == sorted(q_chunks):
        return [BlockCall(span(0, len(q_chunks) - 1), span(0, len(k_chunks) - 1), True)]
    return [BlockCall(span(i, i), span(j, j), kinds[i, j] == DIAGONAL) for i, j in live]


def window_pair_kind(q_chunk: int, k_chunk: int, chunk_len: int, is_causal: bool, window: int) -> str:
    """pair_kind under a sliding window too (`window` 0: none): a pair whose every (query, key)
    distance is >= the window is HIDDEN, one whose every distance is below it stays FULL, and an
    off-diagonal pair cut by it is BAND."""
    kind = pair_kind(q_chunk, k_chunk, is_causal)
    if not window or kind != FULL or not is_causal:
        return kind
    d = (q_chunk - k_chunk) * chunk_len  # query row i, key row j: d + i - j apart
    if d - (chunk_len - 1) >= window:
        return HIDDEN
    return FULL if d + chunk_len - 1 < window else BAND



def pair_calls(q_chunks: Sequence[int], k_chunks: Sequence[int], chunk_len: int, is_causal: bool,
               window: int = 0) -> list[BlockCall]:
    """One op call per visible (query chunk, key chunk) pair, each with its key chunk's global
    columns: the plan when a window or a bias is given (a window cuts pairs unevenly; a bias
    sharded with the queries is read at the key chunk's columns). Hidden pairs are skipped."""
    calls = []
    for i, a in enumerate(q_chunks):
        for j, b in enumerate(k_chunks):
            kind = window_pair_kind(a, b, chunk_len, is_causal, window)
            if kind == HIDDEN:
                continue
            rows, cols = slice(i * chunk_len, (i + 1) * chunk_len), slice(j * chunk_len, (j + 1) * chunk_len)
            calls.append(BlockCall(rows, cols, kind == DIAGONAL, window if kind in (DIAGONAL, BAND) else 0,
                                   (a - b) * chunk_len if kind == BAND else None,
                                   slice(b * chunk_len, (b + 1) * chunk_len)))
    return calls


def step_calls(rank: int, world_size: int, step: int, local_len: int, is_causal: bool,
               load_balanced: bool, window: int = 0, per_pair: bool = False) -> list[BlockCall]:
    """The calls of rank `rank` at ring step `step` (holding the block of rank (rank - step) mod W);
    with a window or `per_pair` (a bias), one per visible chunk pair (`pair_calls`)."""
    # (without is_causal and a bias any sharding computes alike; a bias's key columns are read at the
    # key chunks' global places, so there the layout is the one the shards really have)
    balanced = load_balanced and (is_causal or per_pair)
    q_chunks = chunks_of(rank, world_size, balanced)
    k_chunks = chunks_of((rank - step) % world_size, world_size, balanced)
    if window or per_pair:
        return pair_calls(q_chunks, k_chunks, local_len // len(q_chunks), is_causal, window)
    return block_calls(q_chunks, k_chunks, local_len // len(q_chunks), is_causal)


# ----------------------------------------------------------------------------- communication


def _resolve_group(group):
    """The ProcessGroup: `group` itself, a 1-D DeviceMesh's group, or the default group."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("ring_attention: no process group: pass group= (a ProcessGroup or a 1-D DeviceMesh of "
                             "the context-parallel ranks) or initialise the default one with "
                             "torch.distributed.init_process_group")
        return dist.group.WORLD
    if hasattr(group, "get_group"):  # a DeviceMesh
        if group.ndim != 1:
            raise ValueError(f"ring_attention: a {group.ndim}-D DeviceMesh: pass the 1-D mesh (or the group) of the "
                             "context-parallel dim")
        return group.get_group()
    return group


class _Pending:
    """Posted transfers of one shift; `wait()` returns the received tensors."""

    def __init__(self, works, received: list[Tensor], sent: list[Tensor]):
        self.works, self.received, self.sent = works, received, sent  # `sent` kept alive until done

    def wait(self) -> list[Tensor]:
        for work in self.works:
            work.wait()
        self.sent = []
        return self.received


class _Ring:
    """The group seen as a ring: rank r sends to r+1 and receives from r-1 (group ranks)."""

    def __init__(self, group):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.next, self.prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size

    def shift(self, tensors: Sequence[Tensor], tag: int = 0) -> _Pending:
        """Post the send of `tensors` to the next rank and the receive of as many tensors like them
        (contiguous) from the previous one; returns at once."""
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent]
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=self.next, tag=tag + i)
               for i, t in enumerate(sent)]
        ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=self.prev, tag=tag + i)
                for i, t in enumerate(received)]
        return _Pending(dist.batch_isend_irecv(ops), received, sent)


# ----------------------------------------------------------------------------- blocks


def _block_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, window: int = 0,
                   bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """The op on one rectangle: its partial (out, lse)."""
    if window:
        return torch.ops.fuse_plugin.attention(q, k, v, bias, 0.0, causal, scale, None, 0.0, None, window)
    return torch.ops.fuse_plugin.attention(q, k, v, bias, 0.0, causal, scale)


def _block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                    scale: float, window: int = 0, bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of one rectangle from the GLOBAL out and lse of its rows (see the module doc)."""
    if _runs_kernel(q, v):
        extra = (0.0, None, window) if window else ()
        dq, dk, dv, _ = torch.ops.fuse_plugin.attention_backward(
            dout, q, k, v, bias, out, lse.contiguous(), 0.0, causal, scale, None, False, *extra)
        return dq, dk, dv
    return _reference_block_backward(dout, q, k, v, out, lse, causal, scale, window, bias)


def _call_bias(call: BlockCall, bias: Optional[Tensor], q: Tensor) -> Optional[Tensor]:
    """The additive bias of one call: the rows-sharded bias (B|1, H|1, Lq, L) at the call's rows
    and its key chunk's global columns, plus for a band pair -inf where the distance d + i - j
    reaches the window; None when neither."""
    part = None if bias is None else bias[:, :, call.q if bias.shape[2] != 1 else slice(None), call.k_cols]
    if call.band is None:
        return part
    n_q, n_k = call.q.stop - call.q.start, call.k.stop - call.k.start
    i = torch.arange(n_q, device=q.device)[:, None]
    j = torch.arange(n_k, device=q.device)[None, :]
    dtype = bias.dtype if bias is not None else q.dtype
    band = torch.zeros(n_q, n_k, dtype=dtype, device=q.device).masked_fill(
        call.band + i - j >= call.window, float("-inf"))[None, None]
    return band if part is None else part + band


def _op_window(call: BlockCall) -> int:
    """The op's window argument of a call: the window on a diagonal (causal) pair, else 0."""
    return call.window if call.causal else 0


def _reference_block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                              causal: bool, scale: float, window: int = 0,
                              bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """The kernels' block backward in plain torch: p = exp(s - lse), Delta = rowsum(dout ∘ out)
    with the lse and out given (rows whose lse is -inf add nothing); GQA by grouping the q heads
    of each kv head ((B, Hkv, G, L, ·) views), never repeating k/v. Float32 math (float64 for
    float64 inputs), results in the inputs' dtypes. `bias` added to the scores, `window` (with
    causal) hides keys i - j >= window."""
    ct = torch.float64 if torch.float64 in (q.dtype, k.dtype, v.dtype) else torch.float32
    b, hq, lq, d = q.shape
    hkv, lk, dv_ = k.shape[1], k.shape[2], v.shape[-1]
    g = hq // hkv
    qg = q.to(ct).reshape(b, hkv, g, lq, d)
    kk, vv = k.to(ct).unsqueeze(2), v.to(ct).unsqueeze(2)
    do = dout.to(ct).reshape(b, hkv, g, lq, dv_)
    row_lse = lse.to(ct).reshape(b, hkv, g, lq, 1)
    scores = qg @ kk.transpose(-1, -2) * scale
    if bias is not None:  # (B|1, Hq|1, Lq, Lk) -> grouped like the scores
        bb = bias.to(ct).expand(b, hq, lq, lk).reshape(b, hkv, g, lq, lk)
        scores = scores + bb
    p = torch.exp(scores - row_lse)
    hide = (row_lse == float("-inf")) | (scores == float("-inf"))
    if causal:
        i = torch.arange(lq, device=q.device)[:, None]
        j = torch.arange(lk, device=q.device)[None, :]
        hidden = j > i
        if window:
            hidden = hidden | (i - j >= window)
        hide = hide | hidden
    p = p.masked_fill(hide, 0.0)
    delta = (do * out.to(ct).reshape(b, hkv, g, lq, dv_)).sum(-1, keepdim=True)
    dv = (p.transpose(-1, -2) @ do).sum(2)
    ds = p * (do @ vv.transpose(-1, -2) - delta)
    dq = (ds @ kk).reshape(b, hq, lq, d) * scale
    dk = (ds.transpose(-1, -2) @ qg).sum(2) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _merge(out: Tensor, lse: Tensor, rows: slice, out_b: Tensor, lse_b: Tensor) -> None:
    """out[rows], lse[rows] (the float accumulators, updated in place) merged with a block's
    partial (out_b, lse_b) by logsumexp; a row whose lse_b is -inf (nothing visible) changes
    nothing, and one whose accumulated lse is still -inf takes the block's as it is."""
    acc, acc_lse = out[:, :, rows], lse[:, :, rows]
    lse_b = lse_b.to(lse.dtype)
    new = torch.logaddexp(acc_lse, lse_b)
    safe = new.masked_fill(new == float("-inf"), 0.0)  # both -inf: keep exp() finite (weights 0)
    w_acc, w_b = torch.exp(acc_lse - safe).unsqueeze(-1), torch.exp(lse_b - safe).unsqueeze(-1)
    out_b = out_b.to(out.dtype).masked_fill((lse_b == float("-inf")).unsqueeze(-1), 0.0)  # its NaN rows
    acc.mul_(w_acc).add_(w_b * out_b)
    acc_lse.copy_(new)


def _rows(t: Tensor, rows: slice) -> Tensor:
    return t[:, :, rows]


# ----------------------------------------------------------------------------- the ring


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float, ring: _Ring,
                  load_balanced: bool, window: int = 0, bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, hq, lq, _ = q.shape
    out = q.new_zeros((b, lq, hq, v.shape[-1]), dtype=acc_dtype).transpose(1, 2)  # the op's layout
    lse = torch.full((b, hq, lq), float("-inf"), dtype=acc_dtype, device=q.device)
    kv = [k, v]
    for step in range(ring.size):
        pending = ring.shift(kv) if step < ring.size - 1 else None  # the next block travels meanwhile
        for call in step_calls(ring.rank, ring.size, step, lq, is_causal, load_balanced, window, bias is not None):
            out_b, lse_b = _block_forward(_rows(q, call.q), _rows(kv[0], call.k), _rows(kv[1], call.k),
                                          call.causal, scale, _op_window(call), _call_bias(call, bias, q))
            _merge(out, lse, call.q, out_b, lse_b)
        if pending is not None:
            kv = pending.wait()
    return out.to(q.dtype), lse.float()


def _ring_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, is_causal: bool,
                   scale: float, ring: _Ring, load_balanced: bool, window: int = 0,
                   bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lq = q.shape[2]
    dq = layout_like(q, acc_dtype).zero_()
    kv = [k, v]
    dkv: list[Tensor] = []
    incoming: Optional[_Pending] = None  # the accumulator of the block held next, on its way
    for step in range(ring.size):
        pending = ring.shift(kv) if step < ring.size - 1 else None
        parts = []
        for call in step_calls(ring.rank, ring.size, step, lq, is_causal, load_balanced, window, bias is not None):
            dq_b, dk_b, dv_b = _block_backward(_rows(dout, call.q), _rows(q, call.q), _rows(kv[0], call.k),
                                               _rows(kv[1], call.k), _rows(out, call.q), lse[:, :, call.q],
                                               call.causal, scale, _op_window(call), _call_bias(call, bias, q))
            _rows(dq, call.q).add_(dq_b)
            parts.append((call.k, dk_b, dv_b))
        # this block's dk/dv so far (from the ranks that held it before), waited for only now
        dkv = incoming.wait() if incoming is not None else [
            torch.zeros(t.shape, dtype=acc_dtype, device=t.device) for t in kv]
        for rows, dk_b, dv_b in parts:
            _rows(dkv[0], rows).add_(dk_b)
            _rows(dkv[1], rows).add_(dv_b)
        if ring.size > 1:  # on to the next holder; after the last step, home to its owner
            incoming = ring.shift(dkv, tag=2)
        if pending is not None:
            kv = pending.wait()
    dk, dv = incoming.wait() if incoming is not None else dkv
    return dq.to(q.dtype), in_layout_of(dk.to(k.dtype), k), in_layout_of(dv.to(v.dtype), v)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal, scale, group, load_balanced, window, bias):
        out, lse = _ring_forward(q, k, v, is_causal, scale, _Ring(group), load_balanced, window, bias)
        ctx.save_for_backward(q, k, v, out, lse, bias)
        ctx.is_causal, ctx.scale, ctx.group, ctx.load_balanced = is_causal, scale, group, load_balanced
        ctx.window = window
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        # (dout is never None: autograd materialises zeros, so every rank runs the collective ring)
        q, k, v, out, lse, bias = ctx.saved_tensors
        dq, dk, dv = ring_attention_backward(dout, q, k, v, out, lse, is_causal=ctx.is_causal, scale=ctx.scale,
                                             group=ctx.group, load_balanced=ctx.load_balanced, window=ctx.window,
                                             bias=bias)
        return dq, dk, dv, None, None, None, None, None, None


def _check_mask(q: Tensor, k: Tensor, is_causal: bool, window: int, bias: Optional[Tensor], world_size: int,
                load_balanced: bool = True) -> None:
    """The window and the bias a ring takes (module doc, Masks)."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"ring_attention: window must be an int >= 0 (0: none), got {window!r}")
    if window and not is_causal:
        raise ValueError(f"ring_attention: window={window} needs is_causal=True (query i sees keys i-W+1..i)")
    if bias is None:
        return
    if load_balanced and q.shape[2] % 2:
        raise ValueError(f"ring_attention: a bias with load-balanced shards (two chunks of equal length each) needs "
                         f"an even shard length, got {q.shape[2]} (pass load_balanced=False for contiguous shards)")
    rows, cols = q.shape[2], q.shape[2] * world_size
    if (bias.dim() != 4 or bias.shape[0] not in (1, q.shape[0]) or bias.shape[1] not in (1, q.shape[1])
            or bias.shape[2] not in (1, rows) or bias.shape[3] != cols):
        raise ValueError(f"ring_attention: bias {tuple(bias.shape)} must be this rank's query rows of the whole "
                         f"sequence's bias, (B|1, Hq|1, {rows}|1, {cols}): rows in the shard's order (1: the same "
                         f"for every query, a per-key padding bias), key columns in global order "
                         f"(q {tuple(q.shape)}, {world_size} ranks)")
    if bias.requires_grad:
        raise ValueError("ring_attention: the bias requires grad; the ring takes a bias as a constant mask (its "
                         "gradient is not computed): pass bias.detach() if that is what you mean")
    if bias.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64) or bias.device != q.device:
        raise ValueError(f"ring_attention: bias must be a floating tensor on q's device, got {bias.dtype} on "
                         f"{bias.device}")


def _check(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, load_balanced: bool) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"ring_attention: q, k, v must be 4-D (B, H, L_local, D), got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"ring_attention: the local shards of q and k differ in length (q {q.shape[2]} tokens, "
                         f"k {k.shape[2]}): each rank must hold the same positions of q and of k/v (self-attention "
                         f"sharded alike; cross-attention is not supported)")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"ring_attention: k {tuple(k.shape)} and v {tuple(v.shape)} differ in batch, heads or length")
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1] or q.shape[1] % k.shape[1]:
        raise ValueError(f"ring_attention: q {tuple(q.shape)} and k {tuple(k.shape)}: the batch and head dim must "
                         f"agree and the q heads be a multiple of the kv heads")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(f"ring_attention: q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} "
                         f"on {q.device}/{k.device}/{v.device}")
    if is_causal and load_balanced and q.shape[2] % 2:
        raise ValueError(f"ring_attention: a load-balanced causal shard holds two chunks of equal length, so its "
                         f"length must be even, got {q.shape[2]} (shard with shard_sequence(..., load_balanced=True) "
                         f"or pass load_balanced=False for contiguous shards)")


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool, scale: Optional[float] = None,
                   group=None, load_balanced: bool = True, window: int = 0,
                   bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """This rank's (out, lse) of attention over the whole sequence from sequence-sharded q, k, v
    (shapes, layout, masks and numerics: the module doc). Collective over `group` (forward and
    backward)."""
    _check(q, k, v, is_causal, load_balanced)
    pg = _resolve_group(group)
    _check_mask(q, k, is_causal, window, bias, dist.get_world_size(pg), load_balanced)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, bool(is_causal), scale, pg, bool(load_balanced), int(window), bias)


def ring_attention_forward(q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool, scale: Optional[float] = None,
                           group=None, load_balanced: bool = True, window: int = 0,
                           bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """`ring_attention`'s forward without autograd: this rank's (out, lse), nothing recorded for a
    backward (the caller keeps out and lse and runs `ring_attention_backward`). For callers that
    own the differentiation, e.g. `fuse_plugin::attention` on sequence-sharded DTensors
    (ops/context_parallel.py), whose op autograd calls the backward op. Collective over `group`."""
    _check(q, k, v, is_causal, load_balanced)
    pg = _resolve_group(group)
    _check_mask(q, k, is_causal, window, None if bias is None else bias.detach(), dist.get_world_size(pg),
                load_balanced)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    with torch.no_grad():
        return _ring_forward(q, k, v, bool(is_causal), scale, _Ring(pg), bool(load_balanced), int(window), bias)


def ring_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
                            is_causal: bool, scale: Optional[float] = None, group=None,
                            load_balanced: bool = True, window: int = 0,
                            bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of this rank's shards (in q/k/v's memory order) from the output gradient `dout`
    and the rank's rows of the forward's GLOBAL out (B, Hq, Lq, Dv) and lse (B, Hq, Lq), as
    `ring_attention_forward` (or `ring_attention`) returned them: the ring backward of the module
    doc. The arguments must be those of the forward (same layout, causal, scale, group).
    `ring_attention`'s autograd runs exactly this. Collective over `group`; not differentiable."""
    _check(q, k, v, is_causal, load_balanced)
    rows = (*q.shape[:3], v.shape[-1])
    if tuple(dout.shape) != rows or tuple(out.shape) != rows or tuple(lse.shape) != rows[:3]:
        raise ValueError(f"ring_attention: dout {tuple(dout.shape)}, out {tuple(out.shape)} and lse "
                         f"{tuple(lse.shape)} must be this rank's rows of the forward's outputs: {rows} and "
                         f"{rows[:3]} for q {tuple(q.shape)} and v {tuple(v.shape)}")
    pg = _resolve_group(group)
    _check_mask(q, k, is_causal, window, None if bias is None else bias.detach(), dist.get_world_size(pg),
                load_balanced)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    with torch.no_grad():
        return _ring_backward(dout, q, k, v, out, lse, bool(is_causal), scale, _Ring(pg), bool(load_balanced),
                              int(window), bias)
