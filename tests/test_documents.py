"""Packed documents (issue 31): the op's ``documents`` (integer ids (B, L), self-attention: query i sees
the keys j of its own document, doc[j] == doc[i], with or without is_causal), the general kernels that
skip the key blocks outside a block's documents (WINDOW 3: a per-position span table,
call.document_ranges, reduced per block by attention_tiles._doc_span, every visited tile masked by
_same_document), and the rewrite that passes proven document masks instead of an (L, L) bias.

Kernels on the CPU run in Triton's interpreter (tiny shapes, against a float64 reference with the
documents as a -inf mask); the rewrite's tests run the op's CPU reference. No timing here
(benchmarks/documents.py, on a GPU)."""
import pytest
import torch
from helpers import DEVICE, INTERPRETER, check_close
from test_window import _rewritten
from torch import nn

import fuse_plugin
from fuse_plugin.kernels import registry
from fuse_plugin.kernels.attention import AttentionConfig, attention_backward, attention_forward
from fuse_plugin.kernels.call import AttentionCall, document_ranges
from fuse_plugin.ops import reference as ref_ops

ATTENTION = torch.ops.fuse_plugin.attention.default
kernels_here = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRETER, reason="the Triton kernels run on a GPU "
                                  "or, on the CPU, in Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py)")


def keep_of(doc: torch.Tensor, causal: bool) -> torch.Tensor:
    """(B, 1, L, L) keep mask: doc[i] == doc[j] (and j <= i)."""
    keep = (doc[:, :, None] == doc[:, None, :])[:, None]
    if causal:
        keep = keep & torch.ones(doc.shape[-1], doc.shape[-1], dtype=torch.bool, device=doc.device).tril()
    return keep


def reference(q, k, v, doc, causal, bias=None):
    """float64 attention with the documents as a -inf mask (GQA by repeating k/v)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = q.double() @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if bias is not None:
        s = s + bias.double()
    return torch.softmax(s.masked_fill(~keep_of(doc, causal), float("-inf")), -1) @ v


def ids(kind: str, B: int, L: int) -> torch.Tensor:
    """Document ids (B, L): sorted runs, non-contiguous (interleaved: each span a superset), or one."""
    g = torch.Generator().manual_seed(L)
    if kind == "sorted":
        return torch.sort(torch.randint(0, max(1, L // 8), (B, L), generator=g), -1).values * 7 - 3
    if kind == "scattered":
        return torch.randint(0, 3, (B, L), generator=g)
    return torch.full((B, L), 5)


# ------------------------------------------------------------------------------------ the table


def test_document_ranges():
    doc = torch.tensor([[5, 5, 1, 1, 1, 5, 7], [0, 1, 2, 3, 4, 5, 6]])
    table = document_ranges(doc)
    assert table.dtype == torch.int32 and table.shape == (2, 7, 2) and table.is_contiguous()
    assert table[0].tolist() == [[0, 6], [0, 6], [2, 5], [2, 5], [2, 5], [0, 6], [6, 7]]
    assert table[1].tolist() == [[i, i + 1] for i in range(7)]
    # lo names the document: equal lo <=> equal ids
    d = ids("scattered", 3, 40)
    lo = document_ranges(d)[..., 0]
    assert torch.equal(lo[:, :, None] == lo[:, None, :], d[:, :, None] == d[:, None, :])


# ------------------------------------------------------------------------------------ kernels

CASES = [  # (L, ids, causal, Hq, Hkv, dtype, config of the general family or None: its own tiles)
    (49, "sorted", True, 2, 1, torch.float32, AttentionConfig(16, 16, 4, 1)),  # GQA, blocks cut both ways
    (49, "scattered", False, 2, 2, torch.float32, AttentionConfig(16, 16, 4, 1)),  # spans are supersets
    (17, "one", True, 2, 1, torch.float32, None),  # one document: plain causal; one key block
    (1, "one", False, 1, 1, torch.float32, None),
    (40, "sorted", True, 2, 2, torch.bfloat16, AttentionConfig(16, 16, 4, 1)),
]


@kernels_here
@pytest.mark.parametrize("family", ["general", "two_kernel"])
@pytest.mark.parametrize("L, kind, causal, hq, hkv, dtype, cfg", CASES)
def test_kernels_match_the_documents_reference(poisoned, family, L, kind, causal, hq, hkv, dtype, cfg):
    torch.manual_seed(0)
    doc = ids(kind, 2, L).to(DEVICE)
    q = torch.randn(2, hq, L, 16, device=DEVICE).to(dtype)
    k, v = (torch.randn(2, hkv, L, 16, device=DEVICE).to(dtype) for _ in range(2))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = reference(*leaves, doc, causal)
    dout = torch.randn_like(want)
    grads = torch.autograd.grad(want, leaves, dout)
    kw = dict(is_causal=causal, scale=16 ** -0.5, documents=doc)
    out, lse = attention_forward(q, k, v, None, config=cfg if family == "general" else None, **kw)
    dq, dk, dv, _ = attention_backward(dout.to(dtype), q, k, v, None, out, lse, need_dbias=False, config=cfg,
                                       deterministic=family == "two_kernel", **kw)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    check_close("out", out, want, tol)
    for name, got, r in zip(("dq", "dk", "dv"), (dq, dk, dv), grads):
        check_close(name, got, r, tol)


@kernels_here
@pytest.mark.parametrize("family", ["general", "two_kernel"])
def test_kernels_with_a_bias_and_its_gradient(poisoned, family):
    """A float bias (ALiBi-like, per head) next to the documents, and its gradient."""
    torch.manual_seed(1)
    L = 33
    doc = ids("scattered", 1, L).to(DEVICE)
    q, k, v = (torch.randn(1, 2, L, 16, device=DEVICE) for _ in range(3))
    bias = torch.randn(1, 2, L, L, device=DEVICE)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
    want = reference(*leaves[:3], doc, True, leaves[3])
    dout = torch.randn_like(want)
    grads = list(torch.autograd.grad(want, leaves, dout))
    grads[3] = grads[3].masked_fill(~keep_of(doc, True), 0.0)  # (eager's NaN-free zeros where hidden)
    kw = dict(is_causal=True, scale=16 ** -0.5, documents=doc)
    cfg = AttentionConfig(16, 16, 4, 1)
    out, lse = attention_forward(q, k, v, bias, config=cfg, **kw)
    dq, dk, dv, dbias = attention_backward(dout.float(), q, k, v, bias, out, lse, need_dbias=True, config=cfg,
                                           deterministic=family == "two_kernel", **kw)
    check_close("out", out, want, 1e-5)
    for name, got, r in zip(("dq", "dk", "dv", "dbias"), (dq, dk, dv, dbias), grads):
        check_close(name, got, r, 1e-5)


@kernels_here
@pytest.mark.parametrize("family", ["general", "two_kernel"])
def test_blocks_outside_the_documents_are_never_read(poisoned, family):
    """Two documents of 32 keys, tiles of 16: k and v of the second are NaN. Had a block of the first
    document's queries (or a key block of the second, in the backward) visited the other's blocks,
    0 * NaN would reach its rows; they match the first document attended alone."""
    L, half = 64, 32
    doc = torch.tensor([[0] * half + [1] * half], device=DEVICE)
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, L, 16, device=DEVICE) for _ in range(3))
    k[:, :, half:], v[:, :, half:] = float("nan"), float("nan")
    kw = dict(is_causal=False, scale=0.25, documents=doc)
    cfg = AttentionConfig(16, 16, 4, 1)
    out, lse = attention_forward(q, k, v, None, config=cfg, **kw)
    dout = torch.randn_like(out)
    dq, dk, dv, _ = attention_backward(dout, q, k, v, None, out, lse, need_dbias=False, config=cfg,
                                       deterministic=family == "two_kernel", **kw)
    first = [t[:, :, :half].detach().double().requires_grad_() for t in (q, k, v)]
    want = reference(*first, doc[:, :half], False)
    grads = torch.autograd.grad(want, first, dout[:, :, :half].double())
    check_close("out", out[:, :, :half], want, 1e-5)
    for name, got, r in zip(("dq", "dk", "dv"), (dq, dk, dv), grads):
        check_close(name, got[:, :, :half], r, 1e-5)


@kernels_here
def test_kernels_with_dropout_and_softcap_match_the_op_reference():
    """Dropout and a softcap compose with the documents: the kernels against ops/reference.py (the same
    dropout draw bit for bit), forward and backward."""
    torch.manual_seed(3)
    L = 24
    doc = ids("sorted", 2, L).to(DEVICE)
    q, k, v = (torch.randn(2, 2, L, 16, device=DEVICE) for _ in range(3))
    seed = torch.tensor(1234, dtype=torch.int64, device=DEVICE)
    kw = dict(is_causal=True, scale=0.25, dropout_p=0.25, dropout_seed=seed, softcap=3.0, documents=doc)
    out, lse = attention_forward(q, k, v, None, **kw)
    dout = torch.randn_like(out)
    dq, dk, dv, _ = attention_backward(dout, q, k, v, None, out, lse, need_dbias=False, **kw)
    want_out, want_lse = ref_ops.attention_forward(q, k, v, None, True, 0.25, 0.25, seed, softcap=3.0, documents=doc)
    want = ref_ops.attention_backward(dout, q, k, v, None, True, 0.25, False, 0.25, seed, softcap=3.0, documents=doc)
    check_close("out", out, want_out, 1e-5)
    check_close("lse", lse, want_lse, 1e-5)
    for name, got, r in zip(("dq", "dk", "dv"), (dq, dk, dv), want[:3]):
        check_close(name, got, r, 1e-5)


@pytest.mark.parametrize("band", [None, "window", "chunk"])
def test_other_families_say_why_not(band):
    q = torch.randn(1, 2, 64, 64, device="meta")
    doc = torch.zeros(1, 64, dtype=torch.int64, device="meta")
    if band is not None:
        with pytest.raises(ValueError, match="one band at a time"):
            AttentionCall.forward(q, q, q, None, is_causal=True, scale=0.125, documents=doc, **{band: 16})
        return
    call = AttentionCall.forward(q, q, q, None, is_causal=True, scale=0.125, documents=doc)
    reasons = registry.reasons(call)
    assert reasons["general"] is None
    for name in ("cudnn", "decode", "small", "gluon", "tma", "efficient"):
        if name in reasons:
            assert reasons[name] == "it takes no documents (the general kernels do)", name
    with registry.forced("cudnn"), pytest.raises(registry.FamilyError, match="no documents"):
        registry.choose(call)
    assert "documents" in call.describe()


# ------------------------------------------------------------------------------------ the op


@pytest.mark.parametrize("causal", [False, True])
def test_op_documents_match_sdpa_with_the_mask(causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 20, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    doc = ids("scattered", 2, 20)
    out, _ = ATTENTION(q, k, v, None, 0.0, causal, 0.25, documents=doc)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep_of(doc, causal), scale=0.25)
    torch.testing.assert_close(out, want)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v))):
        torch.testing.assert_close(a, b)
    torch.library.opcheck(ATTENTION, (q, k, v, None, 0.0, causal, 0.25), {"documents": doc})


def test_op_documents_one_row_for_every_batch():
    q, k, v = (torch.randn(3, 2, 12, 16, dtype=torch.float64) for _ in range(3))
    doc = ids("sorted", 1, 12)
    out, _ = ATTENTION(q, k, v, None, 0.0, True, 0.25, documents=doc)
    want, _ = ATTENTION(q, k, v, None, 0.0, True, 0.25, documents=doc.expand(3, 12).contiguous())
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("lk, kw, match", [
    (8, dict(documents=torch.zeros(1, 6, dtype=torch.int64)), "self-attention"),
    (6, dict(documents=torch.zeros(1, 6)), "integer ids"),
    (6, dict(documents=torch.zeros(2, 6, dtype=torch.int64)), "must be"),
    (6, dict(documents=torch.zeros(6, dtype=torch.int64)), "must be"),
    (6, dict(documents=torch.zeros(1, 6, dtype=torch.int64), window=2), "one band at a time"),
    (6, dict(documents=torch.zeros(1, 6, dtype=torch.int64), chunk=2), "one band at a time"),
])
def test_op_documents_errors(lk, kw, match):
    q = torch.randn(1, 1, 6, 16)
    k = torch.randn(1, 1, lk, 16)
    with pytest.raises(ValueError, match=match):
        ATTENTION(q, k, k, None, 0.0, True, 0.25, **kw)


# ------------------------------------------------------------------------------------ the rewrite


class Packed(nn.Module):
    """Hand-written attention over packed documents: ``keep(doc, L)`` the (B, L, L) keep mask, lifted
    over the heads; ``fill``: -inf by masked_fill, or HF's additive finfo.min; ``pad``: a float
    padding bias beside it."""

    def __init__(self, keep, additive=False, pad=False):
        super().__init__()
        self.keep, self.additive, self.pad = keep, additive, pad

    def forward(self, q, k, v, doc):
        L = q.shape[-2]
        s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
        keep = self.keep(doc, L)[:, None]
        if self.additive:
            s = s + torch.where(keep, torch.tensor(0.0, dtype=q.dtype), torch.finfo(q.dtype).min)
        else:
            s = s.masked_fill(~keep, float("-inf"))
        if self.pad:
            s = s + torch.linspace(-1.0, 0.0, L, dtype=q.dtype)
        return s.softmax(-1) @ v


def _same(d, L):
    return d[:, :, None] == d[:, None, :]


def _tril(L):
    return torch.ones(L, L, dtype=torch.bool).tril()


@pytest.mark.parametrize("keep, causal", [
    (_same, False),
    (lambda d, L: _same(d, L) & _tril(L), True),
    (lambda d, L: _tril(L) & (d.unsqueeze(-2) == d.unsqueeze(-1)), True),
], ids=["documents", "and_causal", "causal_and"])
@pytest.mark.parametrize("additive", [False, True])
def test_document_masks_become_the_documents_argument(keep, causal, additive):
    model = Packed(keep, additive=additive)
    q, k, v = (torch.randn(2, 3, 13, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    doc = ids("scattered", 2, 13)
    calls, out = _rewritten(model, q, k, v, doc)
    assert len(calls) == 1 and calls[0].kwargs.get("documents") is not None
    assert calls[0].args[3] is None and calls[0].args[5] is causal  # no (L, L) bias built
    want = model(q, k, v, doc)
    torch.testing.assert_close(out, want)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v))):
        torch.testing.assert_close(a, b)


def test_documents_beside_a_float_bias():
    """-inf fills beside an additive term: the documents become the argument, the term stays the bias."""
    model = Packed(lambda d, L: _same(d, L) & _tril(L), pad=True)
    q, k, v = (torch.randn(2, 2, 10, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    doc = ids("sorted", 2, 10)
    calls, out = _rewritten(model, q, k, v, doc)
    assert len(calls) == 1 and calls[0].kwargs.get("documents") is not None and calls[0].args[3] is not None
    torch.testing.assert_close(out, model(q, k, v, doc))


def test_one_dimensional_ids():
    model = Packed(lambda d, L: (d[:, None] == d[None, :]).unsqueeze(0).expand(2, L, L))
    q, k, v = (torch.randn(2, 2, 10, 16, dtype=torch.float64) for _ in range(3))
    doc = ids("sorted", 1, 10)[0]
    calls, out = _rewritten(model, q, k, v, doc)
    assert len(calls) == 1 and calls[0].kwargs.get("documents") is not None and calls[0].args[3] is None
    torch.testing.assert_close(out, model(q, k, v, doc))


class Unlifted(nn.Module):
    """(B, L, L) document mask applied to (B, H, L, L) scores without a head dim: eager broadcasts it
    right-aligned, so its rows meet the heads (B == H here): not the op's documents."""

    def forward(self, q, k, v, doc):
        s = q @ k.transpose(-2, -1) * 0.25
        return s.masked_fill(~(doc[:, :, None] == doc[:, None, :]), float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("model, doc, why", [
    (Packed(lambda d, L: d[:, :, None] == (d + 1)[:, None, :]), ids("sorted", 2, 12), "two different id tensors"),
    (Packed(lambda d, L: d[:, :, None] == d[:, :, None].transpose(1, 2).transpose(1, 2)), ids("sorted", 2, 12),
     "the same axis twice"),
    (Packed(lambda d, L: d[:, :, None] != d[:, None, :]), ids("sorted", 2, 12), "!= (other documents)"),
    (Packed(_same), ids("sorted", 2, 12).double(), "float ids"),
    (Unlifted(), ids("sorted", 3, 12), "rows along the heads"),
], ids=["two_tensors", "same_axis", "ne", "float", "unlifted"])
def test_near_misses_pass_no_documents(model, doc, why):
    q, k, v = (torch.randn(3 if why.startswith("rows") else 2, 3, 12, 16, dtype=torch.float64) for _ in range(3))
    calls, out = _rewritten(model, q, k, v, doc)
    assert len(calls) == 1 and "documents" not in calls[0].kwargs, why
    torch.testing.assert_close(out, model(q, k, v, doc), equal_nan=True)


def test_explain_names_the_documents():
    model = Packed(lambda d, L: _same(d, L) & _tril(L))
    q, k, v = (torch.randn(2, 2, 12, 16) for _ in range(3))
    text = str(fuse_plugin.explain(model, q, k, v, ids("sorted", 2, 12)))
    assert "is_causal" in text
    assert "documents (ids from" in text and "passed to the op: the kernels skip" in text


def test_compiled_model_matches_eager():
    torch._dynamo.reset()
    model = Packed(lambda d, L: _same(d, L) & _tril(L), additive=True)
    q, k, v = (torch.randn(2, 2, 12, 16, dtype=torch.float64) for _ in range(3))
    doc = ids("scattered", 2, 12)
    got = torch.compile(model, backend="fuse_plugin")(q, k, v, doc)
    torch.testing.assert_close(got, model(q, k, v, doc))


# ------------------------------------------------------- HF's packed sequences, told apart by positions


class PackedByPositions(nn.Module):
    """HF masking_utils' mask for sequences packed in one row with restarting position ids and no
    attention mask (transformers 5.24, as Dynamo captures it): doc = cumsum(diff(pos) != 1), then
    (pos[b, kv] <= pos[b, q]) & (doc[b, q] == doc[b, kv]) by advanced indexing, filled finfo.min;
    "index": transformers 5.17's, causal on the indices (kv <= q) beside the same looked-up ids.
    ``spell`` changes one piece for the near misses."""

    def __init__(self, spell="hf"):
        super().__init__()
        self.spell = spell

    def forward(self, q, k, v, pos):
        B, L = q.shape[0], q.shape[-2]
        step = 2 if self.spell == "step2" else 1
        doc = (torch.diff(pos, dim=-1, prepend=pos[:, :1] - 1) != step).cumsum(-1)
        pos_e = pos.expand(B, -1)
        b = torch.arange(B)[:, None, None, None]
        qi = (torch.arange(L) + 0)[None, None, :, None]
        ki = (torch.arange(L) + 0)[None, None, None, :]
        keep = q.new_ones((), dtype=torch.bool)
        if self.spell == "anti":  # pos[q] <= pos[kv]: the future, not causal
            keep = keep & (pos_e[b, qi] <= pos_e[b, ki])
        elif self.spell.startswith("index"):  # transformers 5.17: causal on the indices, ids looked up
            keep = keep & (ki <= qi)
        elif self.spell == "ge":
            keep = keep & (pos_e[b, qi] >= pos_e[b, ki])
        else:
            keep = keep & (pos_e[b, ki] <= pos_e[b, qi])
        other = doc if self.spell != "other_ids" else (pos != 0).cumsum(-1)
        if self.spell == "index_ne":  # other documents, not the same one
            keep = keep & (other[b, qi] != other[b, ki])
        elif self.spell == "index_rows":  # the ids of batch row B-1-b: rows not along the batch
            keep = keep & (other[b.flip(0), qi] == other[b.flip(0), ki])
        else:
            keep = keep & (other[b, qi] == other[b, ki])
        mask = torch.where(keep.expand(B, -1, L, L), torch.zeros((), dtype=q.dtype), torch.finfo(q.dtype).min)
        return (q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 + mask).softmax(-1) @ v


def positions(B: int, L: int) -> torch.Tensor:
    """Restarting positions, a different packing per row, one row not starting at 0."""
    rows = [torch.cat([torch.arange(5), torch.arange(4), torch.arange(L - 9)]),
            torch.cat([torch.arange(3, 3 + L - 6), torch.arange(6)])]
    return torch.stack(rows[:B])


@pytest.mark.parametrize("spell", ["hf", "ge", "index"])
def test_packed_positions_become_documents_and_causal(spell):
    model = PackedByPositions(spell)
    q, k, v = (torch.randn(2, 3, 14, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    pos = positions(2, 14)
    calls, out = _rewritten(model, q, k, v, pos)
    assert len(calls) == 1 and calls[0].kwargs.get("documents") is not None
    assert calls[0].args[3] is None and calls[0].args[5] is True  # no (L, L) bias, is_causal
    want = model(q, k, v, pos)
    torch.testing.assert_close(out, want)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v))):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("spell, why", [
    ("anti", "the positions compared the other way (keys after the query)"),
    ("step2", "ids that change where the step is not 2: positions then rise by 2 inside a document"),
    ("other_ids", "ids not made from the positions' steps"),
    ("index_ne", "looked-up ids compared by != (transformers 5.17's form otherwise)"),
    ("index_rows", "looked-up ids of another batch row"),
])
def test_packed_positions_near_misses_keep_the_bias(spell, why):
    model = PackedByPositions(spell)
    q, k, v = (torch.randn(2, 3, 14, 16, dtype=torch.float64) for _ in range(3))
    pos = positions(2, 14)
    calls, out = _rewritten(model, q, k, v, pos)
    assert len(calls) == 1 and "documents" not in calls[0].kwargs and calls[0].args[3] is not None, why
    torch.testing.assert_close(out, model(q, k, v, pos), equal_nan=True)


def test_explain_names_packed_positions():
    q, k, v = (torch.randn(2, 2, 14, 16) for _ in range(3))
    text = str(fuse_plugin.explain(PackedByPositions(), q, k, v, positions(2, 14)))
    assert "rising by one inside each document" in text and "documents (ids from" in text, text
