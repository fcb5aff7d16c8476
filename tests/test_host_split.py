"""benchmarks/host_split.py (a host-bound step's time per phase), its pure-Python parts on the CPU:
the wrapper counts read from generated code, and a round's phases timed by the host's clock."""
import os
import sys

import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCH)
import host_split  # noqa: E402

WRAPPER = '''
def other(x):
    triton_poi_fused_0.run(x)
def call(self, args):
    buf0 = empty_strided_cuda((4, 4), (4, 1), torch.bfloat16)
    extern_kernels.mm(a, b, out=buf0)
    triton_poi_fused_1.run(buf0, stream=stream0)
    attention_fwd_kernel_0.run(buf0, 1, 2, stream=stream0)
    buf1 = reinterpret_tensor(buf0, (16,), (1,), 0)
    torch.ops.fuse_plugin.attention.default(buf1)
    return (buf1,)
def after(x):
    extern_kernels.bmm(x)
'''


def test_wrapper_counts_read_only_the_call():
    c = host_split.wrapper_counts(WRAPPER)
    assert (c["launch"], c["alloc"], c["extern"], c["aten"], c["view"]) == (2, 1, 1, 1, 1)
    assert c["lines"] == 7  # the statements after the signature line


def test_a_round_times_each_phase_and_the_sum_is_the_step():
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    images, labels = torch.randn(3, 8), torch.tensor([0, 1, 2])
    sums, wall = host_split.timed_round(model, model, opt, images, labels, 3, 3, "cpu")
    assert len(sums) == 3 and all(s > 0 for s in sums) and sum(sums) <= wall
    assert model.weight.grad is None  # the optimizer phase ran (zero_grad set_to_none)
    sums, wall = host_split.timed_round(model, model, None, images, labels, 2, 1, "cpu")
    assert len(sums) == 1 and 0 < sums[0] <= wall


def test_flags():
    args = host_split.parse([])
    assert (args.model, args.task, args.batch, args.rounds, args.steps) == ("twins_svt_s", "train", 64, 30, 2)
    assert args.variants.split(",") == list(host_split.VARIANTS)
