"""A step of tests/test_compiled_gpu.py in a process of its own (a fresh process, so that nothing
an earlier test compiled is reused): the tiny Llama trained a step under the named backend with
Inductor's pool of compile workers warm, so that the workers, not this process, compile the
kernels (kernels/static_launch.py). Prints one line per kernel of ours that Inductor compiled,
"ours <name> static <True|False>", then "recompiled <n>" (kernels the parent compiled again,
kernels/static_launch.py) and "rel_err <x>" of the compiled loss against eager's.

    python tests/static_launch_child.py
"""
import os
import sys

import torch

os.environ.setdefault("FUSE_PLUGIN_SITE_CHOICE", "ours")
os.environ.setdefault("FUSE_PLUGIN_CHOICE_TABLE", "off")
os.environ.setdefault("FUSE_PLUGIN_ROPE_ATTENTION", "0")
os.environ.setdefault("FUSE_PLUGIN_STATIC_LAUNCH_WORKERS", "on")  # the mend under test


def main() -> int:
    from torch._inductor import config
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.codecache import PyCodeCache

    import fuse_plugin  # noqa: F401  (registers the backend name)
    from fuse_plugin.demo import LlamaConfig, TinyLlama
    from fuse_plugin.kernels import static_launch

    if config.compile_threads <= 1:
        print("skip: Inductor compiles in this process alone (compile_threads 1)")
        return 0
    pool = AsyncCompile.process_pool()
    ready = getattr(pool, "ready_future", None)
    if ready is not None:
        ready.result(timeout=300)  # warm: the kernels go to the workers
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab=1000, hidden=256, layers=2, heads=4, kv_heads=2, mlp=512)
    model = TinyLlama(cfg).cuda().to(torch.bfloat16)
    ids = torch.randint(0, 1000, (2, 300), device="cuda")
    with config.patch({"force_disable_caches": True}):
        compiled = torch.compile(model, backend="fuse_plugin")
        got = compiled(ids).float().pow(2).mean()
        got.backward()
    expected = model(ids).float().pow(2).mean()
    in_modules = static_launch.compiled_kernels_of_ours(PyCodeCache.modules)
    live = static_launch.live_kernels_of_ours()
    print(f"found {len(in_modules)} in the wrapper modules, {len(live)} alive")
    kernels = in_modules or live
    for name, kernel in kernels:
        print(f"ours {name} static {kernel.is_statically_launchable()}")
    print(f"recompiled {len(static_launch.recompiled)}")
    print(f"rel_err {abs(got.item() - expected.item()) / abs(expected.item()):.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
