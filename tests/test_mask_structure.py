"""Mask structure read from the graph (issue 31): a sliding window's lower bound, chunks and
documents, proven from their index comparisons for every size and named by `explain`. A window
beside the causal mask becomes the op's `window` argument (tests/test_window.py), chunks beside it
its `chunk` argument (tests/test_chunk.py), documents the op's `documents` (tests/test_documents.py);
chunks without a causal mask stay in the bias (the rewrite's numbers unchanged)."""
import pytest
import torch
from torch import nn

import fuse_plugin


class Windowed(nn.Module):
    """Hand-written attention with a mask built from aranges: `keep(i, j)` over query i, key j."""

    def __init__(self, keep):
        super().__init__()
        self.keep = keep

    def forward(self, q, k, v):
        L = q.shape[-2]
        i = torch.arange(L, device=q.device)[:, None]
        j = torch.arange(L, device=q.device)[None, :]
        s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        s = s.masked_fill(~self.keep(i, j), float("-inf"))
        return s.softmax(-1) @ v


def explained(keep, L=12):
    q, k, v = (torch.randn(2, 3, L, 16) for _ in range(3))
    return str(fuse_plugin.explain(Windowed(keep), q, k, v))


def test_causal_window_is_named():
    text = explained(lambda i, j: (j <= i) & (j > i - 4))
    assert "fused   attention" in text
    assert "sliding window 4 (proved: query i sees keys from i-3; arange comparison)" in text


@pytest.mark.parametrize("keep, w", [
    (lambda i, j: (j <= i) & (j >= i - 4), 5),  # >= instead of >: one key more
    (lambda i, j: (i - j < 3) & (j <= i), 3),  # the difference spelled the other way round
    (lambda i, j: ~(j <= i - 6) & (j <= i), 6),  # the hidden side negated
])
def test_window_size_follows_the_comparison(keep, w):
    assert f"sliding window {w} (proved" in explained(keep)


@pytest.mark.parametrize("keep", [
    lambda i, j: (j <= i) & (j > 2 * i - 4),  # not a band: the bound moves two keys a query
    lambda i, j: (j <= i) & (i > j - 4),  # hides keys after i + 3 (a look-ahead bound), not a window
    lambda i, j: (j <= i) & (j > 3),  # a fixed key range, not relative to the query
])
def test_near_misses_name_no_window(keep):
    text = explained(keep)
    assert "fused   attention" in text  # still fused, with the mask in the bias
    assert "sliding window" not in text


def test_window_gives_eager_numbers():
    model = Windowed(lambda i, j: (j <= i) & (j > i - 4))
    q, k, v = (torch.randn(2, 3, 12, 16, dtype=torch.float64) for _ in range(3))
    torch._dynamo.reset()
    got = torch.compile(model, backend="fuse_plugin")(q, k, v)
    torch.testing.assert_close(got, model(q, k, v))


def test_hf_mistral_sliding_window_is_named():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MistralConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     sliding_window=4, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(cfg).eval()
    text = str(fuse_plugin.explain(model, torch.randint(0, 100, (2, 16))))
    assert "fused (3 site(s)" not in text and "fused (1 attention" in text
    assert "sliding window 4 (proved" in text and "the kernels skip the key blocks it hides" in text
    # HF's finfo.min causal band is all the mask: no bias is left for the op
    assert "bias:" not in text


@pytest.mark.parametrize("chunk", [lambda i, j: (i // 4) == (j // 4),
                                   lambda i, j: torch.div(j, 4, rounding_mode="floor") == torch.div(i, 4, rounding_mode="floor")])
def test_chunks_are_named(chunk):
    """Llama 4's chunked attention: keys of the query's own chunk (with causal beside it)."""
    text = explained(lambda i, j: (j <= i) & chunk(i, j))
    assert "chunks of 4 (proved: query i sees keys j with j // 4 == i // 4, j <= i): the kernels skip" in text
    # without the causal mask (block-diagonal): named, kept in the bias
    text = explained(chunk)
    assert "chunks of 4 (proved: query i sees keys j with j // 4 == i // 4), kept in the bias" in text


@pytest.mark.parametrize("keep", [
    lambda i, j: (i // 4) == (j // 3),  # two chunk sizes
    lambda i, j: (i // 4) == ((j + 1) // 4),  # shifted chunks: not proven (offsets are not read)
])
def test_chunk_near_misses(keep):
    assert "chunks of" not in explained(lambda i, j: (j <= i) & keep(i, j))


class Packed(nn.Module):
    """Sequences packed in one row: a query sees the keys of its own document (doc ids (B, L))."""

    def __init__(self, lift):
        super().__init__()
        self.lift = lift

    def forward(self, q, k, v, doc):
        s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        keep = self.lift(doc)[:, None]  # (B, 1, L, L)
        return s.masked_fill(~keep, float("-inf")).softmax(-1) @ v


def _docs(B=2, L=12):
    return torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [0] * 12])[:B]


@pytest.mark.parametrize("lift", [lambda d: d[:, :, None] == d[:, None, :],
                                  lambda d: d.unsqueeze(-1) == d.unsqueeze(-2),
                                  lambda d: d[:, None, :] == d[:, :, None]])
def test_documents_are_named_and_give_eager_numbers(lift):
    model = Packed(lift)
    q, k, v = (torch.randn(2, 3, 12, 16, dtype=torch.float64) for _ in range(3))
    text = str(fuse_plugin.explain(model, q, k, v, _docs()))
    assert "fused   attention" in text and "documents (ids from" in text
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(model, backend="fuse_plugin")(q, k, v, _docs()), model(q, k, v, _docs()))


@pytest.mark.parametrize("lift", [
    lambda d: d[:, :, None] == d[:, :, None].transpose(1, 2).transpose(1, 2),  # the same axis twice
    lambda d: d[:, :, None] == (d + 1)[:, None, :],  # two different tensors
    lambda d: d[:, :, None] <= d[:, None, :],  # not an equality
])
def test_document_near_misses(lift):
    q, k, v = (torch.randn(2, 3, 12, 16) for _ in range(3))
    text = str(fuse_plugin.explain(Packed(lift), q, k, v, _docs()))
    assert "documents (ids" not in text


@pytest.mark.parametrize("keep", [
    lambda i, j: i >= j,  # the query on the left
    lambda i, j: i - j >= 0,
    lambda i, j: ~(i < j),
])
def test_causal_with_the_query_on_the_left_is_proved(keep):
    """`i >= j` holds exactly where `j <= i` does (found when chunked attention was spelled so)."""
    text = explained(keep)
    assert "is_causal (arange comparison)" in text


def test_causal_from_one_arange_is_proved_and_computes_eager():
    class OneArange(nn.Module):
        def forward(self, q, k, v):
            i = torch.arange(q.shape[-2])
            s = (q @ k.transpose(-2, -1)) * 0.25
            return s.masked_fill(~(i[:, None] >= i[None, :]), float("-inf")).softmax(-1) @ v

    q, k, v = (torch.randn(2, 3, 7, 16, requires_grad=True) for _ in range(3))
    assert "is_causal (arange comparison)" in str(fuse_plugin.explain(OneArange(), q, k, v))
    torch._dynamo.reset()
    got = torch.compile(OneArange(), backend="fuse_plugin")(q, k, v)
    assert torch.allclose(got, OneArange()(q, k, v), atol=1e-5)


@pytest.mark.parametrize("keep", [
    lambda i, j: i > j,  # the diagonal hidden: not causal
    lambda i, j: i + 1 >= j,  # one key past the diagonal
    lambda i, j: i <= j,  # the other triangle
])
def test_near_causal_with_the_query_on_the_left_stays_a_mask(keep):
    text = explained(keep)
    assert "is_causal" not in text
