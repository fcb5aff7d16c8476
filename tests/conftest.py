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
