"""Steps of tests/test_compiled_gpu.py that run in a process of their own (a crash in
AOTInductor's loader must not take the test session down; the load must prove the package runs
without fuse_plugin).

    python tests/aoti_child.py compile-plain PATH   # AOTInductor package of a plain nn.Linear
    python tests/aoti_child.py compile-ours PATH    # ... of a block calling our ops
    python tests/aoti_child.py load PATH            # load and run it WITHOUT importing fuse_plugin
    python tests/aoti_child.py cpp-wrapper          # torch.compile(cpp_wrapper=True) of the block
Prints "rel_err <x>" against eager where it runs a model.
"""
import re
import sys

import torch
from torch import nn


def block_and_inputs():
    import fuse_plugin

    class Block(nn.Module):
        """Our ops called directly (as HF's attn_implementation="fuse_plugin" does)."""

        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(256, 3 * 256)

        def forward(self, x, cos, sin):
            b, s, _ = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, 4, 64).unbind(2)
            q, k = fuse_plugin.apply_rotary_qk(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            return fuse_plugin.attention(q, k, v.transpose(1, 2), is_causal=True)

    torch.manual_seed(0)
    block = Block().cuda().to(torch.bfloat16)
    x = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16)
    cos = torch.randn(1, 1, 300, 64, device="cuda", dtype=torch.bfloat16)
    sin = torch.randn(1, 1, 300, 64, device="cuda", dtype=torch.bfloat16)
    return block, (x, cos, sin)


def rel_err(got, expected) -> float:
    got = got[0] if isinstance(got, (list, tuple)) else got
    return ((got.double() - expected.double()).norm() / expected.double().norm()).item()


def compile_package(block, args, path):
    with torch.no_grad():
        torch.save((args, block(*args)), path + ".io")
        torch._inductor.aoti_compile_and_package(torch.export.export(block, args),
                                                 package_path=path)


def main(step, path=None):
    if step == "compile-plain":
        torch.manual_seed(0)
        compile_package(nn.Linear(64, 64).cuda(), (torch.randn(8, 64, device="cuda"),), path)
    elif step == "compile-ours":
        compile_package(*block_and_inputs(), path)
    elif step == "load":
        args, expected = torch.load(path + ".io")
        got = torch._inductor.aoti_load_package(path)(*args)
        assert "fuse_plugin" not in sys.modules
        print("rel_err", rel_err(got, expected))
    elif step == "cpp-wrapper":
        from torch._inductor.utils import run_and_get_code

        block, args = block_and_inputs()
        with torch.no_grad():
            expected = block(*args)
            got, code = run_and_get_code(torch.compile(block, options={"cpp_wrapper": True}), *args)
        code = "\n".join(code)
        assert "attention_fwd" in code, "no attention kernel in the C++ wrapper's code"
        assert not re.search(r"fuse_plugin(::|\.)(attention|rotary)", code), "an opaque op call is left"
        print("rel_err", rel_err(got, expected))
    else:
        raise SystemExit(f"unknown step {step!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])
