"""The small-problem attention family (fuse_plugin.kernels.attention_small) against float64.

Runs on the GPU when there is one, else in Triton's CPU interpreter (see conftest.py), so every
problem is tiny (B·H <= 12). Outputs start as NaN (``helpers.poisoned_empty``), so an element a
kernel does not write fails. The reference is float64 eager attention under autograd; the bias
is a float64 leaf in its compact shape (Swin's (nW, H, L, L), a (1, H, L, L) per-head bias, a
(B, 1, 1, Lk) key-padding bias, ...) broadcast to (B, H, Lq, Lk) inside the graph, so its
gradient is the reduced dbias the kernel must produce. Dropout is checked against
``fuse_plugin.ops.reference`` (in float64), which draws the kernels' mask.
"""
import pytest
import torch
from helpers import DEVICE, check_close, poisoned_empty, rel_err

from fuse_plugin.kernels import attention_small as small
from fuse_plugin.kernels.host import dropout_scale
from fuse_plugin.ops import reference as ops_reference

# The interpreter evaluates with numpy, which warns about the intended 0/0 and log2(0) of fully
# masked rows (real ones and the padding rows of the tiles).
pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning",
    "ignore:divide by zero encountered:RuntimeWarning")

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
NEG_INF = float("-inf")


@pytest.fixture(autouse=True)
def no_tf32():
    """fp32 is checked to 1e-5: ieee dots (the launcher follows this flag on a GPU)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def reference(q, k, v, bias, is_causal, scale):
    """float64 eager attention -> (out, lse); bias (B, Hq, Lq, Lk) bool or float. Fully masked
    rows come out as 0 (max and sum guarded) so that autograd stays finite: the kernels' backward
    treats such rows as contributing nothing, which is what these gradients are."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        s = s.masked_fill(~bias, NEG_INF) if bias.dtype == torch.bool else s + bias
    if is_causal:
        Lq, Lk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(Lq, Lk, dtype=torch.bool, device=s.device).tril(), NEG_INF)
    with torch.no_grad():
        lse = torch.logsumexp(s, -1)
        m = s.amax(-1, keepdim=True)
        m = m.masked_fill(torch.isinf(m), 0.0)
    e = torch.exp(s - m)
    l = e.sum(-1, keepdim=True)
    return e / torch.where(l > 0, l, torch.ones_like(l)) @ v, lse


def make_qkv(B, Hq, Hkv, Lq, Lk, D, Dv, dtype, layout):
    """q, k, v in one of the layouts the op passes: "bhld" (contiguous), "blhd" (the head split
    of a projection, (B, L, H, D) seen transposed) or "packed" (timm's fused qkv,
    ``qkv.reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4)``: rows strided by 3·H·D)."""
    if layout == "packed":
        assert Hq == Hkv and Lq == Lk and D == Dv
        qkv = torch.randn(B, Lq, 3, Hq, D, device=DEVICE).to(dtype)
        return tuple(qkv.permute(2, 0, 3, 1, 4))

    def rand(H, L, d):
        if layout == "blhd":
            return torch.randn(B, L, H, d, device=DEVICE).to(dtype).transpose(1, 2)
        return torch.randn(B, H, L, d, device=DEVICE).to(dtype)
    return rand(Hq, Lq, D), rand(Hkv, Lk, D), rand(Hkv, Lk, Dv)


def _leaf(shape, dtype, edit=None):
    """A float64 leaf holding values representable in ``dtype`` (the kernel reads them exact),
    changed by ``edit`` (in place) first."""
    leaf = (2 * torch.randn(*shape, device=DEVICE)).to(dtype).double()
    if edit is not None:
        edit(leaf)
    return leaf.requires_grad_()


def _swin_mask(nW, Lq, Lk):
    """A shifted-window style mask: 0 or -100 (timm's value), each window its own pattern,
    key 0 always visible."""
    mask = torch.where(torch.rand(nW, 1, Lq, Lk, device=DEVICE) < 0.3, -100.0, 0.0)
    mask[..., 0] = 0.0
    return mask.double()


def make_bias(form, B, H, Lq, Lk, dtype, nW=None, edit=None):
    """(leaf, bias, full): the reference's leaf (float64 requiring grad, in the bias's compact
    shape: its gradient is the dbias asked for; bool masks as they are), the kernel's bias (a
    (Pb, H, Lq, Lk) view of the leaf in ``dtype``) and the leaf broadcast to (B, H, Lq, Lk)
    (differentiable) for the reference. ``edit(leaf)`` changes the "full" and "bool_keypad"
    leaves' values first (rows masked by it)."""
    if form is None:
        return None, None, None
    if form == "head":  # (1, H, L, L) per head, expanded: batch stride 0, Pb = B
        leaf = _leaf((1, H, Lq, Lk), dtype)
        return leaf, leaf.detach().to(dtype).expand(B, H, Lq, Lk), leaf.expand(B, H, Lq, Lk)
    if form == "head_pb1":  # the same bias as Pb = 1
        leaf = _leaf((1, H, Lq, Lk), dtype)
        return leaf, leaf.detach().to(dtype), leaf.expand(B, H, Lq, Lk)
    if form == "keypad":  # (B, 1, 1, Lk) key padding: stride 0 over heads and queries
        leaf = _leaf((B, 1, 1, Lk), dtype)
        return leaf, leaf.detach().to(dtype).expand(B, H, Lq, Lk), leaf.expand(B, H, Lq, Lk)
    if form == "full":
        leaf = _leaf((B, H, Lq, Lk), dtype, edit)
        return leaf, leaf.detach().to(dtype), leaf
    if form in ("swin", "swin_relpos"):
        # Swin's combined bias (nW, H, L, L) = window mask (nW, 1, L, L) + relative-position
        # bias (1, H, L, L), periodic over the batch (Pb = nW): dbias of the combined tensor
        # ("swin", (nW, H, L, L)) or of the relative-position bias ("swin_relpos", (1, H, L, L)).
        mask, relpos = _swin_mask(nW, Lq, Lk), _leaf((1, H, Lq, Lk), dtype)
        combined = mask + relpos
        bias = combined.detach().to(dtype)
        if form == "swin":
            leaf = combined.detach().requires_grad_()
            return leaf, bias, leaf.repeat(B // nW, 1, 1, 1)
        return relpos, bias, combined.repeat(B // nW, 1, 1, 1)
    if form == "bool_keypad":  # key 0 kept: no dead row
        keep = torch.rand(B, 1, 1, Lk, device=DEVICE) > 0.4
        keep[..., 0] = True
        if edit is not None:
            edit(keep)
        return keep, keep.expand(B, H, Lq, Lk), keep.expand(B, H, Lq, Lk)
    raise ValueError(form)


def check_out(name, got, want, tol, dead):
    """NaN exactly on the ``dead`` rows (a bool mask over the leading dims), else within tol."""
    nan = torch.isnan(got)
    if got.dim() == 4:
        assert nan[dead].all(), f"{name}: the fully masked rows are not NaN"
    assert not nan[~dead].any(), f"{name}: NaN (an element the kernel did not write?)"
    check_close(name, got[~dead], want[~dead], tol)


def run_case(*, dtype, B, Hq, Hkv, Lq, Lk, D, Dv, causal=False, bias=None, nW=None,
             layout="bhld", need_dbias=False, config=None, edit=None, padded_lse=False):
    """Forward and backward against the float64 reference (``edit``: see ``make_bias``;
    ``padded_lse``: lse a view of a (B, Hq, 32-row-padded) buffer, written and read through
    its strides)."""
    torch.manual_seed(0)
    scale = D ** -0.5
    q, k, v = make_qkv(B, Hq, Hkv, Lq, Lk, D, Dv, dtype, layout)
    leaf, bias_t, full = make_bias(bias, B, Hq, Lq, Lk, dtype, nW, edit)
    dout = torch.randn(B, Hq, Lq, Dv, device=DEVICE).to(dtype)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference(*leaves, full, causal, scale)
    ref_out.backward(dout.double())

    out = poisoned_empty((B, Lq, Hq, Dv), dtype, DEVICE).transpose(1, 2)  # the op's layout
    lse = poisoned_empty((B, Hq, -(-Lq // 32) * 32 if padded_lse else Lq), torch.float32, DEVICE)[..., :Lq]
    small.forward(q, k, v, bias_t, is_causal=causal, scale=scale, out=out, lse=lse,
                  config=config)
    tol = TOL[dtype]
    dead = torch.isneginf(ref_lse)
    check_out("out", out, ref_out, tol, dead)
    assert torch.isneginf(lse[dead]).all(), "lse of a fully masked row must be -inf"
    huge = ref_lse.abs() > 1e30  # finfo.min rows: only to fp32's relative precision
    assert torch.allclose(lse[huge].double(), ref_lse[huge], rtol=1e-6, atol=0)
    check_close("lse", lse[~dead & ~huge], ref_lse[~dead & ~huge], tol)

    dq, dk, dv = (poisoned_empty(t.shape, t.dtype, DEVICE, like=t) for t in (q, k, v))
    dbias = poisoned_empty(leaf.shape, torch.float32, DEVICE) if need_dbias else None
    small.backward(dout, q, k, v, bias_t, out, lse, is_causal=causal, scale=scale, dq=dq, dk=dk,
                   dv=dv, dbias=dbias, config=config)
    for name, got, ref in (("dq", dq, leaves[0]), ("dk", dk, leaves[1]), ("dv", dv, leaves[2])):
        check_close(name, got, ref.grad, tol)
    if need_dbias:
        check_close("dbias", dbias, leaf.grad, tol)


CASES = {
    # Swin stage-1 shape: L 49, D 32, timm's packed qkv; periodic bias over nW 2 windows (B 6),
    # dbias (nW, H, L, L): 3 images per slot, 4 units per program, so programs straddle slots
    # and heads (atomics).
    "fp32-swin-nw2-packed-dbias": dict(
        dtype=torch.float32, B=6, Hq=2, Hkv=2, Lq=49, Lk=49, D=32, Dv=32, bias="swin", nW=2,
        layout="packed", need_dbias=True, config=(4, 4, 2)),
    # An odd window count, dbias reduced to the relative-position bias (1, H, L, L): one slot of
    # 9 units, 4 units per program (9 not a multiple of 4).
    "fp32-swin-nw3-relpos-dbias-4-per-program": dict(
        dtype=torch.float32, B=9, Hq=1, Hkv=1, Lq=49, Lk=49, D=32, Dv=32, bias="swin_relpos",
        nW=3, need_dbias=True, config=(4, 4, 2)),
    # bf16, nW 4 (B 8): each slot's 2 units in one program, so plain dbias stores.
    "bf16-swin-nw4-dbias-stored": dict(
        dtype=torch.bfloat16, B=8, Hq=1, Hkv=1, Lq=49, Lk=49, D=32, Dv=32, bias="swin", nW=4,
        layout="blhd", need_dbias=True, config=(2, 4, 2)),
    # LeViT-like D 16 / Dv 64, GQA 4/2, causal with Lq < Lk, a bool key-padding mask,
    # transposed layouts, 3 units per program over 4 units.
    "bf16-gqa-causal-d16-dv64-boolpad": dict(
        dtype=torch.bfloat16, B=2, Hq=4, Hkv=2, Lq=17, Lk=33, D=16, Dv=64, causal=True,
        bias="bool_keypad", layout="blhd", config=(3, 4, 2)),
    # A float key-padding bias (B, 1, 1, Lk): dbias summed over the queries in the kernel and
    # over a GQA group's heads and the kv heads (a slot of 2 units, one unit per program).
    # (Lq 100 too would pass an H100's shared memory in fp32 GQA: test_cases_fit_an_h100.)
    "fp32-gqa-keypad-dbias-lq60-lk100-d64": dict(
        dtype=torch.float32, B=2, Hq=4, Hkv=2, Lq=60, Lk=100, D=64, Dv=64, bias="keypad",
        need_dbias=True),
    # BERT-like full tiles: L 128, D 128, a full (B, H, L, L) bias (dbias stored per problem).
    "bf16-full-bias-l128-d128-dbias": dict(
        dtype=torch.bfloat16, B=1, Hq=2, Hkv=2, Lq=128, Lk=128, D=128, Dv=128, bias="full",
        need_dbias=True),
    # A per-head bias expanded over the batch (stride 0, Pb = B), dbias (1, H, L, L) with GQA:
    # a unit's heads feed different slots in turn (atomics); D 80 (a padded head dim), causal.
    # L 31: at L 64 the fp32 GQA backward's tiles pass an H100's shared memory.
    "fp32-gqa-head-bias-dbias-d80-causal-l31": dict(
        dtype=torch.float32, B=3, Hq=4, Hkv=2, Lq=31, Lk=31, D=80, Dv=80, causal=True,
        bias="head", need_dbias=True),
    # The same bias given as Pb = 1, causal with Lq > Lk, fp16, 2 units per program (each
    # slot's 2 batches in one program: stores).
    "fp16-head-bias-pb1-causal-lq-gt-lk": dict(
        dtype=torch.float16, B=2, Hq=2, Hkv=2, Lq=100, Lk=64, D=64, Dv=64, causal=True,
        bias="head_pb1", need_dbias=True, config=(2, 4, 2)),
    # The stage-1 case with its lse a view of a 32-row-padded buffer (both kernels take lse
    # through its strides).
    "fp32-swin-nw2-packed-dbias-padded-lse": dict(
        dtype=torch.float32, B=6, Hq=2, Hkv=2, Lq=49, Lk=49, D=32, Dv=32, bias="swin", nW=2,
        layout="packed", need_dbias=True, config=(4, 4, 2), padded_lse=True),
    # One query, one key.
    "fp32-l1": dict(dtype=torch.float32, B=2, Hq=2, Hkv=1, Lq=1, Lk=1, D=16, Dv=16),
    # L 7, causal, no bias, three heads.
    "bf16-l7-causal": dict(dtype=torch.bfloat16, B=2, Hq=3, Hkv=3, Lq=7, Lk=7, D=32, Dv=32,
                           causal=True),
    # Lq < Lk at the tile limit, D 128 against Dv 16.
    "fp32-lq17-lk128-d128-dv16": dict(dtype=torch.float32, B=1, Hq=2, Hkv=2, Lq=17, Lk=128,
                                      D=128, Dv=16, layout="blhd"),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_matches_reference(case):
    run_case(**case)


H100_SHARED_MEMORY = 232448  # bytes a block may take (Triton's max_shared_mem on an H100)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_cases_fit_an_h100(direction, monkeypatch):
    """Every case is a problem the family takes on an H100, in both directions: on the CPU
    ``why_not`` knows no shared-memory limit, so a case past it would pass in CI and fail on
    the GPU (two did, stop 41: fp32 GQA backwards at L 64-100)."""
    monkeypatch.setattr(small, "smem_limit", lambda device: H100_SHARED_MEMORY)
    for name, c in CASES.items():
        q, k, v = make_qkv(c["B"], c["Hq"], c["Hkv"], c["Lq"], c["Lk"], c["D"], c["Dv"],
                           c["dtype"], c.get("layout", "bhld"))
        _, bias, _ = make_bias(c.get("bias"), c["B"], c["Hq"], c["Lq"], c["Lk"], c["dtype"],
                               c.get("nW"))
        reason = small.why_not(q, k, v, bias, need_dbias=c.get("need_dbias", False),
                               direction=direction)
        assert reason is None, f"{name}: {reason}"


def _rows_masked(dtype):
    """Row 3 of (0, 0) fully masked by -inf; row 5 of (0, 1) biased by finfo(dtype).min
    everywhere (uniform weights as eager; its gradients need the exact row statistics)."""
    def edit(leaf):
        leaf[0, 0, 3, :] = NEG_INF
        leaf[0, 1, 5, :] = torch.finfo(dtype).min
    return edit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_and_finfo_min_rows(dtype):
    """Out NaN and lse -inf on the -inf row, no NaN in any gradient, dbias 0 on it."""
    run_case(dtype=dtype, B=1, Hq=2, Hkv=1, Lq=17, Lk=33, D=16, Dv=16, bias="full",
             need_dbias=True, edit=_rows_masked(dtype))


def test_bool_dead_row():
    """A bool mask that removes a whole row (with causal): NaN out, -inf lse, finite grads."""
    def edit(keep):
        keep[1, 0, 0, :] = False  # batch 1: every row, hence all of its rows are dead
    run_case(dtype=torch.float16, B=2, Hq=2, Hkv=1, Lq=9, Lk=9, D=16, Dv=16, causal=True,
             bias="bool_keypad", edit=edit)


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_matches_reference(causal):
    """The kernels' dropout mask (ops.reference draws it too), kept weights scaled, lse of the
    undropped softmax; the backward redraws it. dbias of a key-padding bias, summed."""
    torch.manual_seed(0)
    B, Hq, Hkv, Lq, Lk, D, p = 2, 4, 2, 33, 40, 32, 0.25
    scale = D ** -0.5
    q, k, v = make_qkv(B, Hq, Hkv, Lq, Lk, D, D, torch.float32, "blhd")
    leaf, bias, full = make_bias("keypad", B, Hq, Lq, Lk, torch.float32)
    seed = torch.tensor([0x1234_5678_9ABC], dtype=torch.int64, device=DEVICE)
    dout = torch.randn(B, Hq, Lq, D, device=DEVICE)
    q64, k64, v64, bias64 = (t.detach().double() for t in (q, k, v, full))
    ref_out, ref_lse = ops_reference.attention_forward(q64, k64, v64, bias64, causal, scale,
                                                       dropout_p=p, dropout_seed=seed)
    ref_grads = ops_reference.attention_backward(dout.double(), q64, k64, v64, bias64, causal,
                                                 scale, True, dropout_p=p, dropout_seed=seed)

    out = poisoned_empty((B, Lq, Hq, D), torch.float32, DEVICE).transpose(1, 2)
    lse = poisoned_empty((B, Hq, Lq), torch.float32, DEVICE)
    small.forward(q, k, v, bias, is_causal=causal, scale=scale, out=out, lse=lse, dropout_p=p,
                  dropout_seed=seed)
    check_close("out", out, ref_out, 1e-5)
    check_close("lse", lse, ref_lse, 1e-5)
    dq, dk, dv = (poisoned_empty(t.shape, t.dtype, DEVICE, like=t) for t in (q, k, v))
    dbias = poisoned_empty(leaf.shape, torch.float32, DEVICE)
    small.backward(dout, q, k, v, bias, out, lse, is_causal=causal, scale=scale, dq=dq, dk=dk,
                   dv=dv, dbias=dbias, dropout_p=p, dropout_seed=seed)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        check_close(name, got, want, 1e-5)
    check_close("dbias", dbias, ref_grads[3].sum((1, 2), keepdim=True), 1e-5)
    # (a sanity check of the comparison: the undropped output is far from the dropped one)
    assert rel_err(out, reference(q64, k64, v64, bias64, causal, scale)[0]) > 0.05
    assert dropout_scale(p) == pytest.approx(1 / (1 - p), rel=1e-4)


class _Deterministic:
    def __enter__(self):
        self.old = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self.old)


@pytest.mark.parametrize("bias, Hq, Hkv", [("head", 4, 2), ("swin_relpos", 1, 1)],
                         ids=["gqa-per-head-added", "one-slot-stored"])
def test_deterministic_dbias(bias, Hq, Hkv):
    """Deterministic mode: whole dbias slots per program (no atomics), results as the
    reference; GQA with a per-head dbias adds into the zeroed dbias, a (1, H, L, L) slot of one
    head is stored once."""
    with _Deterministic():
        run_case(dtype=torch.float32, B=3, Hq=Hq, Hkv=Hkv, Lq=20, Lk=20, D=16, Dv=16,
                 bias=bias, nW=3, need_dbias=True, config=(2, 4, 2))


@pytest.mark.parametrize("B, Hq, Hkv, shape, per_program, deterministic, expected", [
    # Swin (nW 4, 2 images): a slot's 2 units per program -> stores, else atomics
    (8, 3, 3, (4, 3, 49, 49), 2, False, (small.DBIAS_STORE, True, 2)),
    (8, 3, 3, (4, 3, 49, 49), 3, False, (small.DBIAS_ATOMIC, True, 3)),
    (8, 3, 3, (4, 3, 49, 49), 3, True, (small.DBIAS_STORE, True, 4)),
    # (1, H, L, L) of all 8 batches: one slot of 8 units per head
    (8, 3, 3, (1, 3, 49, 49), 16, False, (small.DBIAS_STORE, True, 16)),
    (8, 3, 3, (1, 3, 49, 49), 5, True, (small.DBIAS_STORE, True, 8)),
    # a full bias: one problem per slot
    (8, 3, 3, (8, 3, 49, 49), 5, False, (small.DBIAS_STORE, True, 5)),
    # key padding (B, 1, 1, Lk) with GQA: a slot is a batch's 2 kv heads, rows summed
    (8, 4, 2, (8, 1, 1, 49), 1, False, (small.DBIAS_ATOMIC, False, 1)),
    (8, 4, 2, (8, 1, 1, 49), 4, False, (small.DBIAS_STORE, False, 4)),
    # GQA with a per-head dbias over 8 batches: a unit's heads interleave their slots
    (8, 4, 2, (1, 4, 49, 49), 8, False, (small.DBIAS_ATOMIC, True, 8)),
    (8, 4, 2, (1, 4, 49, 49), 3, True, (small.DBIAS_ADD, True, 8)),
    (8, 4, 2, (8, 4, 49, 49), 3, True, (small.DBIAS_STORE, True, 3)),
])
def test_dbias_plan(B, Hq, Hkv, shape, per_program, deterministic, expected):
    """How dbias is written (module docstring): stores where each slot lies whole inside one
    program, atomics (zeroed first) otherwise, never atomics in deterministic mode."""
    plan = small._dbias_plan(B, Hq, Hkv, shape, per_program, deterministic)
    assert (plan.mode, plan.rows, plan.per_program) == expected
    assert plan.zero == (plan.mode != small.DBIAS_STORE)


def _t(*shape, dtype=torch.float32, device="meta"):
    return torch.empty(*shape, dtype=dtype, device=device)


@pytest.mark.parametrize("args, kwargs, reason", [
    ((_t(2, 3, 49, 32), _t(2, 3, 129, 32), _t(2, 3, 129, 32), None), {}, "Lk 129 > 128"),
    ((_t(2, 3, 197, 32), _t(2, 3, 49, 32), _t(2, 3, 49, 32), None), {}, "Lq 197 > 128"),
    ((_t(2, 3, 49, 256), _t(2, 3, 49, 256), _t(2, 3, 49, 256), None), {}, "head dim 256 > 128"),
    ((_t(2, 3, 49, 32), _t(2, 3, 49, 32), _t(2, 3, 49, 8), None), {}, "head dim 8 < 16"),
    ((_t(2, 3, 49, 32, dtype=torch.float64),) * 3 + (None,), {}, "fp64"),
    ((_t(2, 3, 49, 32),) * 3 + (None,), dict(softcap=True), "a softcap"),
    ((_t(2, 3, 49, 32),) * 3 + (None,), dict(rope=True), "rope"),
    ((_t(2, 3, 49, 32),) * 3 + (None,), dict(replace=True), "a replace mask"),
    ((_t(4, 3, 49, 32),) * 3 + (_t(3, 3, 49, 49),), {}, "bias shape (3, 3, 49, 49) is not"),
    # a (1, H, L, L) bias expanded over 128 windows: 128 units per slot
    ((_t(128, 3, 49, 32),) * 3 + (_t(1, 3, 49, 49).expand(128, 3, 49, 49),),
     dict(need_dbias=True, deterministic=True), "a deterministic dbias of 128 problems"),
])
def test_why_not_reasons(args, kwargs, reason):
    assert (small.why_not(*args, **kwargs) or "").startswith(reason)


@pytest.mark.parametrize("args, kwargs", [
    ((_t(8, 3, 49, 32),) * 3 + (_t(4, 3, 49, 49),), dict(need_dbias=True)),  # Swin, nW 4
    ((_t(8, 3, 49, 32),) * 3 + (_t(4, 3, 49, 49),), dict(need_dbias=True, deterministic=True)),
    ((_t(2, 4, 128, 16), _t(2, 2, 128, 16), _t(2, 2, 128, 64), None), dict(dropout=True)),
    ((_t(2, 12, 128, 64, dtype=torch.bfloat16),) * 3
     + (_t(2, 1, 1, 128, dtype=torch.bool).expand(2, 12, 128, 128),), {}),
])
def test_why_not_accepts(args, kwargs):
    assert small.why_not(*args, **kwargs) is None


def test_a_gqa_backward_counts_its_query_heads(monkeypatch):
    """Shared memory a stage: k/v once, the query side once per head of the GQA group (kernel's
    unrolled group loop). Llama 1 x 128 (bf16, D 64, GQA 16/4): every backward config failed on
    the H100 (362-364 KB at 2 stages); the family now says so before compiling. The forward, and
    the same backward without GQA, still fit."""
    monkeypatch.setattr(small, "smem_limit", lambda device: H100_SHARED_MEMORY)
    q = _t(1, 16, 128, 64, dtype=torch.bfloat16)
    kv = _t(1, 4, 128, 64, dtype=torch.bfloat16)
    assert small.stage_bytes("bwd", 128, 128, 64, 64, torch.bfloat16, None, 4) > H100_SHARED_MEMORY
    assert small.stage_bytes("bwd", 128, 128, 64, 64, torch.bfloat16, None) == \
        small.stage_bytes("bwd", 128, 128, 64, 64, torch.bfloat16, None, 1)
    reason = small.why_not(q, kv, kv, None, direction="bwd")
    assert reason.startswith("its bwd tiles need 228 KB of shared memory (> 227 KB)")
    assert small.why_not(q, kv, kv, None, direction="fwd") is None
    assert small.why_not(q, q, q, None, direction="bwd") is None


def test_why_not_on_symbolic_fake_tensors():
    """Fake tensors with SymInt sizes are read by their hints, without adding a guard."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (DimDynamic, ShapeEnv,
                                                       StatelessSymbolicContext)

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 4)

    def fake(*shape):
        return mode.from_tensor(torch.empty(*shape), symbolic_context=ctx)

    q, k = fake(6, 3, 49, 32), fake(6, 3, 197, 32)
    assert isinstance(q.shape[2], torch.SymInt)
    assert small.why_not(q, q, q, None) is None
    assert small.why_not(q, k, k, None) == "Lk 197 > 128"
    assert not env.guards


def test_default_config():
    # Swin stage 1 (B·H 12288, bf16): 16 units per program, 4 warps on 64-wide tiles
    assert small.default_config("fwd", 12288, 49, 49, 32, 32, torch.bfloat16) == (16, 4, 3)
    assert small.default_config("bwd", 12288, 49, 49, 32, 32, torch.bfloat16) == (16, 4, 1)
    # BERT at 128 tokens, B 32 x H 12: one unit per program, 8 warps on 128-wide tiles
    assert small.default_config("bwd", 384, 128, 128, 64, 64, torch.bfloat16) == (1, 8, 2)
    # D 128 in the backward: 8 warps (the fp32 dK/dV accumulators)
    assert small.default_config("bwd", 4000, 49, 49, 128, 128, torch.float16).num_warps == 8
    assert small.default_config("fwd", 4000, 49, 49, 128, 128, torch.float16).num_warps == 4
    # fp32 (ieee dots: operands in registers) from 64-wide tiles
    assert small.default_config("fwd", 4000, 49, 49, 32, 32, torch.float32).num_warps == 8
    assert small.default_config("fwd", 4000, 32, 32, 32, 32, torch.float32).num_warps == 4
    with pytest.raises(ValueError, match="direction"):
        small.default_config("both", 1, 1, 1, 16, 16, torch.float16)


def test_launchers_refuse():
    q = torch.randn(1, 1, 129, 16, device=DEVICE)
    lse = torch.empty(1, 1, 129, device=DEVICE)
    with pytest.raises(ValueError, match="Lq 129 > 128"):
        small.forward(q, q, q, None, is_causal=False, scale=1.0, out=q.clone(), lse=lse)
    q = torch.randn(2, 2, 8, 16, device=DEVICE)
    bias = torch.randn(2, 2, 8, 8, device=DEVICE)
    with pytest.raises(ValueError, match="dbias shape"):
        small.backward(q, q, q, q, bias, q, lse, is_causal=False, scale=1.0, dq=q.clone(),
                       dk=q.clone(), dv=q.clone(), dbias=torch.empty(2, 2, 2, 8, device=DEVICE))
    with pytest.raises(ValueError, match="every field"):
        small.forward(q, q, q, None, is_causal=False, scale=1.0, out=q.clone(),
                      lse=torch.empty(2, 2, 8, device=DEVICE), config=(0, 4, 2))
