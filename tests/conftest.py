"""Test set-up shared by every test module.

The Triton kernels are exercised on machines without a GPU through Triton's
interpreter. `TRITON_INTERPRET` is read when a kernel is *decorated*, and
importing `torch._dynamo` imports triton, so the variable is set here, before
any test module (or fuse_plugin) is imported.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite exercises the rope-into-attention fold (opt-in for users while it is slower than the
# unfused pair); tests of the default set FUSE_PLUGIN_ROPE_ATTENTION=0 themselves.
os.environ.setdefault("FUSE_PLUGIN_ROPE_ATTENTION", "1")
# The suite exercises the rewrite on the CPU, where users' sites are left as written
# (patterns/choice.off_cuda: our ops run their reference there); tests of that default set
# FUSE_PLUGIN_CPU_SITES=auto themselves.
os.environ.setdefault("FUSE_PLUGIN_CPU_SITES", "ours")


import pytest  # noqa: E402


@pytest.fixture
def poisoned(monkeypatch):
    """Every kernel output starts as NaN, so an element a kernel forgets to write fails a NaN or
    accuracy check; fp32 is checked to 1e-5, so tf32 dots are switched off (the launcher follows
    this flag)."""
    from fuse_plugin.kernels import host

    from helpers import poisoned_empty

    monkeypatch.setattr(host, "empty", poisoned_empty)
    # (not monkeypatch.setattr: cuBLASModule serves the flag through __getattr__, which newer
    # pytest refuses to patch)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old
