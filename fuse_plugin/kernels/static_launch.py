"""Our traced kernels on Inductor's static launcher, also where a compile worker built them.

The named backend compiles with Inductor's ``static_launch_user_defined_triton_kernels`` (settings
``FUSE_PLUGIN_STATIC_LAUNCH``; launch.py's ``STATIC_LAUNCH_OPTION``), so that our traced kernels
launch from Inductor's static CUDA launcher, as its own kernels do, rather than through Triton's
launcher, which costs far more host time a launch for kernels of 60-100 arguments like ours.

Inductor decides which launcher a kernel gets when it compiles it
(``StaticTritonCompileResult.can_statically_launch``, reading that option from its config). With
parallel compilation (its default: a pool of worker processes, used once warmed up) the decision
is made in the worker, whose config receives only the static launcher's own switch from the
parent (``async_compile``'s ``extra_config``, torch 2.11 and 2.13), never an option a compile
patched in: every kernel of ours a worker compiled came back for Triton's launcher, the parent
reuses the worker's result as it is, and the option reached only the kernels compiled in the
parent (before the pool was warm, or with ``compile_threads`` 1). Measured on an H100 (stop 45,
twins_svt_s training, bs 64, a cold compile): all 36 launches a step of ours went through Triton's
launcher with the option on, the step's backward issued 4.7 ms slower than stock compile's.

``install()`` wraps ``CachingAutotuner.precompile`` once. Under ``FUSE_PLUGIN_STATIC_LAUNCH_WORKERS``
(settings.py; on by default: H100, stop 47), where the parent finishes a kernel that
a worker compiled (``reload_kernel`` given), the kernel is one of ours (``launch.ours``),
Inductor's config in the parent has the option on (the compile of the named backend, or a user
who set it) and the worker's results are not all static, the kernel is loaded again in the
parent and compiled there (Triton's cache holds its binary: nothing is compiled anew), so that
the decision reads the option the compile meant; its results then replace the worker's. Any
failure leaves the worker's results, which launch correctly through Triton's launcher. Kernels
not ours, and every compile without the option, are untouched; without the switch the wrapper is
not installed (backend.py, passes.py install it where the switch is on)."""
from __future__ import annotations

import logging
from typing import Optional

from .launch import kernel_name

log = logging.getLogger(__name__)
recompiled: list = []  # the names of the kernels compiled again in the parent (tests, benchmarks)
_WRAPPED = "_fuse_plugin_static"  # marks the wrapped precompile (install once)


def why_not_recompile(autotuner, reload_kernel) -> Optional[str]:
    """Why the parent leaves ``autotuner``'s compile results as they came (None: it compiles the
    kernel again itself)."""
    from .. import settings
    from . import launch

    if not settings.static_launch_workers():
        return f"{settings.STATIC_LAUNCH_WORKERS} is off"
    if reload_kernel is None:
        return "compiled in this process (the decision read this process's config)"
    heuristic = getattr(autotuner, "heuristic_type", None)
    if getattr(heuristic, "name", None) != "USER_AUTOTUNE":
        return "an Inductor kernel, not a user kernel"
    if not launch.ours(autotuner):
        return "not a kernel of ours"
    if not launch._static_launch():
        return "Inductor's static launch of user kernels is off in this compile"
    results = getattr(autotuner, "compile_results", None) or []
    if not results:
        return "no compile results"
    if _all_static(autotuner):
        return "already static"
    return None


def _all_static(autotuner) -> bool:
    check = getattr(autotuner, "is_statically_launchable", None)
    if check is not None:
        return bool(check())
    return all(type(r).__name__ == "StaticTritonCompileResult" for r in autotuner.compile_results)


def recompile_in_parent(autotuner, reload_kernel) -> bool:
    """Compile ``autotuner``'s kernel again in this process and take its results if they are
    static; True if it did. Leaves ``autotuner`` unchanged otherwise."""
    try:
        fresh = reload_kernel()
        if not fresh.compile_results:
            fresh._precompile_worker()
        if not _all_static(fresh):
            log.debug("%s: not statically launchable in the parent either", kernel_name(autotuner))
            return False
    except Exception as e:  # the worker's results still launch (Triton's launcher)
        log.debug("%s: compiling again in the parent failed: %s", kernel_name(autotuner), e)
        return False
    autotuner.compile_results = fresh.compile_results
    recompiled.append(kernel_name(autotuner))
    return True


def compiled_kernels_of_ours(modules) -> list:
    """[(name, autotuner)] of the kernels of ours that Inductor compiled in these generated modules
    (PyCodeCache's): what the GPU test and benchmarks/host_split.py check for static launch."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    from .launch import ours

    return [(name, v) for m in modules for name, v in vars(m).items()
            if isinstance(v, CachingAutotuner) and ours(v) and v.compile_results]


def live_kernels_of_ours() -> list:
    """[(name, autotuner)] of every compiled kernel of ours alive in this process, found through the
    garbage collector: for a check where the wrapper modules do not hold them as globals."""
    import gc

    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    from .launch import ours

    return [(kernel_name(v), v) for v in gc.get_objects()
            if isinstance(v, CachingAutotuner) and ours(v) and v.compile_results]


def install() -> None:
    """Wrap ``CachingAutotuner.precompile`` (see the module docstring); once, idempotent."""
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    except ImportError:  # no Triton: nothing launches statically
        return
    original = CachingAutotuner.precompile
    if getattr(original, _WRAPPED, False):
        return

    def precompile(self, warm_cache_only=False, reload_kernel=None, *args, **kwargs):
        if not warm_cache_only and why_not_recompile(self, reload_kernel) is None:
            if recompile_in_parent(self, reload_kernel):
                log.debug("%s: compiled again in the parent for Inductor's static launcher", kernel_name(self))
        return original(self, warm_cache_only, reload_kernel, *args, **kwargs)

    setattr(precompile, _WRAPPED, True)
    precompile.__wrapped__ = original
    precompile.__doc__ = original.__doc__
    CachingAutotuner.precompile = precompile
