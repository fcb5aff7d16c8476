"""A trained bias table read through an index (issue 28): the op `fuse_plugin::table_gather` and
the rewrite that puts it in place of LeViT's `table[:, idx]` and Swin's / BEiT's
`table[idx.view(-1)]` (patterns/bias_table.py, ops/table_gather.py)."""
import pytest
import torch
from torch import nn
from torch.library import opcheck

import fuse_plugin
from fuse_plugin.patterns import bias_table

OP = torch.ops.fuse_plugin.table_gather


# ------------------------------------------------------------------------------------------ the op


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_the_op_is_indexing_and_its_gradient_is_exact(dim, index_dtype):
    g = torch.Generator().manual_seed(dim)
    table = torch.randn(5, 7, dtype=torch.float64, generator=g, requires_grad=True)
    n = table.shape[dim]
    index = torch.randint(-n, n, (4, 6), generator=g).to(index_dtype)  # negative ones count from the end
    want = table[index.long()] if dim == 0 else table[:, index.long()]
    assert torch.equal(OP(table, index, dim), want)
    torch.autograd.gradcheck(lambda t: OP(t, index, dim), (table,))
    opcheck(OP, (table, index, dim))
    opcheck(OP, (table.detach().float().requires_grad_(), index, dim))


def test_bf16_gradient_is_added_in_float32():
    """Many reads of one entry (LeViT's tables: up to 676 per entry at 14x14): the op's bf16
    gradient is the float64 sum rounded once; autograd's bf16 index_put adds in bf16."""
    table = torch.randn(2, 3, dtype=torch.bfloat16, requires_grad=True)
    index = torch.zeros(40, 40, dtype=torch.long)  # every read hits entry 0
    grad = torch.randn(2, 40, 40, dtype=torch.bfloat16)
    OP(table, index, 1).backward(grad)
    want = grad.double().sum((1, 2))
    assert torch.allclose(table.grad[:, 0].double(), want, rtol=1e-2, atol=0)
    assert (table.grad[:, 1:] == 0).all()


@pytest.mark.parametrize("dim", [0, 1])
def test_the_backward_saves_the_index_as_given(dim):
    """The op's two implementations, as Inductor traces them on CUDA (ops/inductor.py), in one
    training graph split by AOTAutograd's partitioner (Inductor's): the backward reads the index
    as given, so the forward saves that, not its normalised copy (which Inductor wrote to memory:
    one kernel per site a step, Swin-T stop 48), and returns nothing computed from the index."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._functorch.aot_autograd import aot_function

    from fuse_plugin.ops import table_gather as tg

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, table, index):
            ctx.save_for_backward(index)
            ctx.shape = list(table.shape)
            return tg._table_gather(table, index, dim)

        @staticmethod
        def backward(ctx, grad):
            (index,) = ctx.saved_tensors
            return tg._table_gather_backward(grad, index, dim, ctx.shape, grad.dtype), None

    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    table = torch.randn(5, 7, requires_grad=True)
    index = torch.randint(-table.shape[dim], table.shape[dim], (4, 6))
    fn = aot_function(lambda t, i: Gather.apply(t, i).sum(), fw_compiler=keep, bw_compiler=keep,
                      partition_fn=min_cut_rematerialization_partition)
    fn(table, index).backward()
    want = torch.zeros_like(table).index_add_(dim, torch.where(index < 0, index + table.shape[dim], index).flatten(),
                                              torch.ones(_shape(table.shape, index.numel(), dim)))
    assert torch.equal(table.grad, want)
    forward = graphs[0].graph
    saved = [a for a in forward.find_nodes(op="output")[0].args[0][1:] if a is not None]
    computed = [a for a in saved if not a.meta["val"].is_floating_point() and not _index_as_given(a)]
    assert computed == [], [(a.name, a.target) for a in computed]


def _index_as_given(node) -> bool:
    """node is a graph input, or a view of one (no kernel: nothing written to memory)."""
    while node.op == "call_function" and node.target in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default):
        node = node.args[0]
    return node.op == "placeholder"


def _shape(table_shape, n, dim):
    return [*table_shape[:dim], n, *table_shape[dim + 1:]]


def test_the_op_names_bad_input():
    t = torch.randn(3, 4)
    with pytest.raises(ValueError, match="index must be int64 or int32"):
        OP(t, torch.zeros(2, dtype=torch.bool), 0)
    with pytest.raises(ValueError, match="dim 2 is out of range"):
        OP(t, torch.zeros(2, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="must be a float tensor"):
        OP(torch.zeros(3, 4, dtype=torch.long), torch.zeros(2, dtype=torch.long), 0)


# ------------------------------------------------------------------------------------------ the rewrite


class LevitAttention(nn.Module):
    """LeViT's attention (timm levit.Attention, non-conv): biases `table[:, idx]`, table (H, R*R)."""

    def __init__(self, heads=2, res=3, d=16, index_first=False):
        super().__init__()
        self.h, self.d = heads, d
        self.qkv = nn.Linear(32, heads * 3 * d)
        self.index_first = index_first  # (a near miss: table (N, H) read as table[idx, :])
        self.attention_biases = nn.Parameter(torch.randn(res * res, heads) if index_first else
                                             torch.randn(heads, res * res))
        pos = torch.stack(torch.meshgrid(torch.arange(res), torch.arange(res), indexing="ij")).flatten(1)
        rel = (pos[..., :, None] - pos[..., None, :]).abs()
        idx = rel[0] * res + rel[1]
        self.register_buffer("idx", idx, persistent=False)

    def forward(self, x, table=None):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, self.h, -1).split([self.d] * 3, dim=3)
        q, k, v = q.permute(0, 2, 1, 3), k.permute(0, 2, 3, 1), v.permute(0, 2, 1, 3)
        t = self.attention_biases if table is None else table
        bias = t[self.idx, :].permute(2, 0, 1) if self.index_first else t[:, self.idx]
        attn = q @ k * self.d ** -0.5 + bias
        return (attn.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1)


class SwinAttention(nn.Module):
    """Swin's window attention (timm swin_transformer.WindowAttention): a (2W-1)^2 x H table read
    by `table[index.view(-1)].view(N, N, -1).permute(2, 0, 1)`."""

    def __init__(self, heads=2, window=3, d=16):
        super().__init__()
        self.h, self.d = heads, d
        self.qkv = nn.Linear(32, heads * 3 * d)
        self.relative_position_bias_table = nn.Parameter(torch.randn((2 * window - 1) ** 2, heads))
        c = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        rel = (c[:, :, None] - c[:, None, :]).permute(1, 2, 0) + (window - 1)
        self.register_buffer("relative_position_index", rel[..., 0] * (2 * window - 1) + rel[..., 1],
                             persistent=False)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.h, -1).permute(2, 0, 3, 1, 4).unbind(0)
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(n, n, -1)
        attn = (q * self.d ** -0.5) @ k.transpose(-2, -1) + bias.permute(2, 0, 1).contiguous().unsqueeze(0)
        return (attn.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1)


class BeitSdpaAttention(SwinAttention):
    """BEiT on timm's default fused path: the gathered table passed to SDPA as its attn_mask."""

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.h, -1).permute(2, 0, 3, 1, 4).unbind(0)
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(n, n, -1)
        mask = bias.permute(2, 0, 1).contiguous().unsqueeze(0)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, n, -1)


def _ops_in(model, *args):
    """The custom ops in the graph our backend rewrote, and the compiled model's output."""
    seen = []

    def backend(gm, example_inputs):
        fuse_plugin.patterns.rewrite(gm)
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    return seen, torch.compile(model, backend=backend)(*args)


@pytest.mark.parametrize("model", [LevitAttention, SwinAttention, BeitSdpaAttention])
def test_a_trained_table_is_gathered_by_the_op(model, monkeypatch):
    """Whatever the site's decision: our op (forced here for the SDPA call too) or left as it is
    (the next test)."""
    monkeypatch.setenv("FUSE_PLUGIN_SITE_CHOICE", "ours")
    torch.manual_seed(0)
    m, x = model(), torch.randn(2, 9, 32)
    seen, out = _ops_in(m, x)
    assert "fuse_plugin.table_gather.default" in seen and "fuse_plugin.attention.default" in seen
    out.square().sum().backward()
    table = next(p for name, p in m.named_parameters() if "bias" in name and "qkv" not in name)
    got, table.grad = table.grad, None
    want = m(x)
    assert torch.allclose(out, want, atol=1e-6)
    want.square().sum().backward()
    assert torch.allclose(got, table.grad, rtol=1e-5, atol=1e-6)
    report = fuse_plugin.explain(m, x)
    assert bias_table.DETAIL in str(report)


def test_an_sdpa_call_left_as_it_is_gets_the_op_too(monkeypatch):
    """An SDPA call the choice leaves as SDPA (here: no table on the CPU) still reads its trained
    table through the op; with FUSE_PLUGIN_SDPA_SITES=off nothing of the call is touched."""
    m, x = BeitSdpaAttention(), torch.randn(2, 9, 32)
    seen, out = _ops_in(m, x)
    assert "fuse_plugin.table_gather.default" in seen and "fuse_plugin.attention.default" not in seen
    report = str(fuse_plugin.explain(m, x))
    assert "left as SDPA" in report and bias_table.DETAIL in report
    out.square().sum().backward()
    got, m.relative_position_bias_table.grad = m.relative_position_bias_table.grad, None
    m(x).square().sum().backward()
    assert torch.allclose(got, m.relative_position_bias_table.grad, rtol=1e-5, atol=1e-6)
    monkeypatch.setenv("FUSE_PLUGIN_SDPA_SITES", "off")
    seen, _ = _ops_in(m, x)
    assert "fuse_plugin.table_gather.default" not in seen


def test_inference_and_frozen_tables_keep_the_gather():
    """Under no_grad, or with a table that is not trained, the forward is the same either way:
    the graph keeps its getitem (Inductor fuses it where the bias is read)."""
    m, x = LevitAttention(), torch.randn(2, 9, 32)
    with torch.no_grad():
        seen, _ = _ops_in(m, x)
    assert "fuse_plugin.attention.default" in seen and "fuse_plugin.table_gather.default" not in seen
    m.attention_biases.requires_grad_(False)
    seen, _ = _ops_in(m, x)
    assert "fuse_plugin.attention.default" in seen and "fuse_plugin.table_gather.default" not in seen


def test_near_misses_keep_the_gather():
    """A table that is an input (not a parameter), an index before a slice (a form the op does
    not take), a gather not building the bias: left as they are (the attention itself is fused)."""
    m, x = LevitAttention(), torch.randn(2, 9, 32)
    table = torch.randn(2, 9, requires_grad=True)
    seen, _ = _ops_in(m, x, table)  # the table as an input
    assert "fuse_plugin.attention.default" in seen and "fuse_plugin.table_gather.default" not in seen
    seen, _ = _ops_in(LevitAttention(index_first=True), x)  # table[idx, :]
    assert "fuse_plugin.attention.default" in seen and "fuse_plugin.table_gather.default" not in seen

    class Elsewhere(LevitAttention):  # the gathered table feeds the output, not a bias
        def forward(self, x):
            return super().forward(x) + self.attention_biases[:, self.idx].sum()

    seen, _ = _ops_in(Elsewhere(), x)
    assert seen.count("fuse_plugin.table_gather.default") == 1  # the bias's gather only


def test_forced_inductor_keeps_the_gather(monkeypatch):
    """FUSE_PLUGIN_SITE_CHOICE=inductor leaves every site as it is, its bias's gather too."""
    monkeypatch.setenv("FUSE_PLUGIN_SITE_CHOICE", "inductor")
    seen, _ = _ops_in(LevitAttention(), torch.randn(2, 9, 32))
    assert "fuse_plugin.attention.default" not in seen and "fuse_plugin.table_gather.default" not in seen


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the op decomposed by Inductor on CUDA")
@pytest.mark.parametrize("model", [LevitAttention, SwinAttention])
def test_gpu_compiled_gradient_against_float64(model):
    torch.manual_seed(0)
    m = model().cuda()
    x = torch.randn(4, 9, 32, device="cuda")
    ref = model().cuda().double()
    ref.load_state_dict(m.state_dict())
    m = m.bfloat16()
    torch._dynamo.reset()
    out = torch.compile(m, backend="fuse_plugin")(x.bfloat16())
    grad = torch.randn_like(out)
    out.backward(grad)
    want = ref(x.double())
    want.backward(grad.double())
    t, t_ref = (next(p for n, p in mm.named_parameters() if "bias" in n and "qkv" not in n) for mm in (m, ref))
    assert (out.double() - want).abs().max() <= 2e-2 * want.abs().max()
    assert (t.grad.double() - t_ref.grad).abs().max() <= 2e-2 * t_ref.grad.abs().max()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed (DTensor)")
def test_dtensors_replicated_only():
    """The op's sharding rule (ops/sharding.py): Replicate() runs, a shard is an error naming it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from fuse_plugin.ops.sharding import ShardingError

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        table, index = torch.randn(4, 6), torch.randint(0, 6, (3, 3))
        t = distribute_tensor(table, mesh, [Replicate()])
        i = distribute_tensor(index, mesh, [Replicate()])
        assert torch.equal(OP(t, i, 1).full_tensor(), table[:, index])
        # (DTensor's dispatch re-raises the rule's ShardingError as a RuntimeError with its message)
        with pytest.raises((ShardingError, RuntimeError), match="table_gather: argument 0 has placement Shard"):
            OP(distribute_tensor(table, mesh, [Shard(0)]), i, 1)
    finally:
        if own:
            dist.destroy_process_group()
