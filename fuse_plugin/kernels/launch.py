"""The one launch interface of every Triton kernel of the package: eager, or traced for Inductor.

    launch(kernel, grid, *args, num_warps=4, num_stages=None, **constexprs)

launches ``kernel[grid](*args, **constexprs)``. A positional argument may be a ``Desc(tensor,
block)``: a host-side TMA descriptor of the 4-D (B, H, L, D) ``tensor`` with ``block`` tiles
([1, 1, rows, D]); the kernel receives a ``TensorDescriptor``.

Two modes
---------
* **eager** (the default): the kernel runs now, through Triton's JIT launcher. Descriptors get
  normalised strides (a size-1 dim's stride is never stepped over, so it is replaced by one
  16-byte unit: torch leaves such strides arbitrary).
* **traced** (inside ``tracing()``: the ops' decomposition while AOTAutograd traces a graph for
  Inductor, ops/inductor.py): nothing runs. Each launch becomes Inductor's
  ``triton_kernel_wrapper_mutation`` higher-order op, with the TMA descriptors recorded as
  metadata (torch.library.wrap_triton cannot do that outside Dynamo), so Inductor compiles the
  kernel with the same constexprs, num_warps and num_stages and emits the launch in its own
  generated code: what a call of our op costs on the host is then what one Inductor launch
  costs, and everything decided here (table lookup, kernel family, tiles, grid) was decided once,
  when the graph compiled. Inductor rebuilds the descriptors with ``TensorDescriptor.from_tensor``
  (every stride as it is: callers only pick a TMA kernel for tensors whose leading strides are
  all 16-byte multiples, see ``tma_strides_ok``), holds each tensor argument to the strides it
  had here (``triton_kernel_default_layout_constraint``) and copies inputs that are misaligned at
  run time, which is why ``aligned16`` may read the storage offset instead of the address.

Inductor compiles a user kernel with its own specialisation, not Triton's launcher's: an int
argument equal to 1 becomes a constant (the kernels call no methods on int arguments), and a
Python float arrives as an fp64 argument (the kernels cast their float arguments to fp32 first
thing, as Triton's launcher would have passed them).

``writes`` names the kernel parameters the launch writes (outputs and scratch buffers). Traced,
Inductor works out what a user kernel writes from its Triton IR, and orders, frees and reuses
buffers by that; an analysis that misses a write (a TMA reduction, say) would let it run the
kernel after the read of its output, or drop it. So a traced launch first checks that the
analysis finds exactly ``writes`` (and, at most, the ``address_reads``: parameters whose loaded values
bound the kernel's loops, so that the addresses it writes depend on them, which the analysis counts as
writes: the documents table; Inductor then orders and copies them as written, safe, a read never
misplaced), and raises ``Untraceable`` otherwise: the op then stays one
opaque node in that graph (ops/inductor.py), correct at the old host cost.

Gluon kernels (attention_*_gluon.py) cannot be traced: Inductor re-emits a user kernel's source
under ``@triton.jit`` (torch 2.11 and 2.13). They keep an opaque op of their own
(ops/gluon.py), whose implementation launches them eagerly (Triton's JIT launcher, ~0.1-0.3 ms
of host time per Gluon backward at small sizes on the H100 host: kernels/attention.py takes them
in compiled graphs only for problems large enough to cover that).
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, NamedTuple, Optional

import torch

_state = threading.local()


class Untraceable(RuntimeError):
    """A launch Inductor could not take as it is (see ``writes`` in the module docstring)."""


class Desc(NamedTuple):
    """A host-side TMA descriptor request: ``tensor`` (4-D, unit last stride) in ``block`` tiles."""

    tensor: torch.Tensor
    block: tuple


GRADIENT_BUFFER = "_fuse_plugin_buffer"  # on a host.gradient_buffer view: the buffer it views


def is_tracing() -> bool:
    return getattr(_state, "tracing", False)


def hint(n) -> int:
    """A size as a plain int without adding a guard: an int as it is, a SymInt (dynamic shapes)
    as its hint, the value the graph is being traced with. For choices within a kernel family
    that only change speed (tiles, splits, the GQA split): a graph compiled for dynamic shapes
    keeps the choice of the shape it was traced with for every shape it runs. The launchers
    compare the SymInt itself (a guard: Dynamo recompiles across it) where correctness depends
    on a size and at the few family boundaries (decode, cuDNN, the TMA/Gluon size threshold)."""
    if isinstance(n, torch.SymInt):
        if not n.node.has_hint():
            raise Untraceable("a data-dependent size (no hint to choose kernels by)")
        return int(n.node.hint)
    return n


def symbolic(*tensors: torch.Tensor) -> bool:
    """Has any of these tensors a symbolic size (dynamic shapes)?"""
    return any(isinstance(n, torch.SymInt) for t in tensors for n in t.shape)


@contextlib.contextmanager
def tracing():
    """Launches inside become graph nodes for Inductor instead of running (see module doc)."""
    old = is_tracing()
    _state.tracing = True
    try:
        yield
    finally:
        _state.tracing = old


def python_ops_allowed() -> bool:
    """May a traced launcher keep an opaque Python op in the graph (the Gluon kernels')? Not
    where Inductor compiles C++ (AOTInductor, cpp_wrapper): those packages hold Triton kernels,
    and a Python op would tie them to this process."""
    from torch._inductor import config
    from torch._inductor.virtualized import V

    return not (config.cpp_wrapper or getattr(V, "aot_compilation", False))


def descriptors_traceable() -> bool:
    """Does Inductor take host-side TMA descriptors here? (It maps a descriptor argument to its
    expanded Triton IR parameters only where torch says the device has host-side TMA; elsewhere
    its write analysis would mis-assign them.)"""
    from torch.utils._triton import has_triton_tensor_descriptor_host_tma

    return has_triton_tensor_descriptor_host_tma()


def aligned16(t: torch.Tensor) -> bool:
    """Is t's first element 16-byte aligned? Traced: from the storage offset (Inductor allocates
    16-byte aligned storage and copies graph inputs found misaligned at run time)."""
    if is_tracing():
        return t.storage_offset() * t.element_size() % 16 == 0
    return t.data_ptr() % 16 == 0


def tma_strides_ok(t: torch.Tensor) -> bool:
    """Can a TMA descriptor address t (leading strides 16-byte multiples)? Eager descriptors
    replace the strides of size-1 dims; traced ones (``TensorDescriptor.from_tensor``) keep
    every stride, so all of them must be multiples then."""
    e, traced = t.element_size(), is_tracing()
    return all(st > 0 and st * e % 16 == 0 for n, st in zip(t.shape[:-1], t.stride()[:-1])
               if n > 1 or traced)


def descriptor(t: torch.Tensor, block) -> Any:
    """The eager host-side TMA descriptor of a 4-D tensor (size-1 dims' strides normalised)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    strides = [st if n > 1 else 16 // t.element_size() for n, st in zip(t.shape[:3], t.stride()[:3])]
    return TensorDescriptor(t, list(t.shape), strides + [1], list(block))


def launch(kernel, grid, *args, writes: tuple = (), num_warps: int = 4,
           num_stages: Optional[int] = None, address_reads: tuple = (), **constexprs):
    """Launch ``kernel`` on ``grid`` (a tuple of up to 3 ints) now, or record the launch for
    Inductor while ``tracing()``; ``writes``: the names of the parameters it writes;
    ``address_reads``: those it only reads, whose values Inductor's analysis may count as writes
    (see the module docstring)."""
    if is_tracing():
        _record(kernel, tuple(grid), args, constexprs, tuple(writes), num_warps, num_stages,
                tuple(address_reads))
        return None
    args = [descriptor(*a) if isinstance(a, Desc) else a for a in args]
    options = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    return kernel[grid](*args, **constexprs, **options)


# --------------------------------------------------------------------------------------------
# Traced launches
# --------------------------------------------------------------------------------------------

_WITH_CONFIG: dict = {}


def _with_config(kernel, num_warps: int, num_stages: Optional[int]):
    """The kernel wrapped in a one-config autotuner carrying num_warps / num_stages: the form in
    which Inductor takes launch options of a user kernel (as wrap_triton makes it). One object per
    (kernel, options), so that the kernel side table does not grow with every trace."""
    key = (kernel, num_warps, num_stages)
    wrapped = _WITH_CONFIG.get(key)
    if wrapped is None:
        import triton

        options = {"num_warps": num_warps}
        if num_stages is not None:
            options["num_stages"] = num_stages
        wrapped = _WITH_CONFIG[key] = triton.autotune(configs=[triton.Config({}, **options)],
                                                       key=[])(kernel)
    return wrapped


def _graphable(v) -> bool:
    from torch import fx

    return isinstance(v, (fx.node.base_types, fx.Node))


def bind(kernel, args: tuple, constexprs: dict) -> dict:
    """Every parameter of ``kernel`` by name: the positional ``args``, the keyword ``constexprs``
    and the defaults of parameters left out (Inductor takes a user kernel's arguments by name)."""
    names = list(kernel.arg_names)
    if len(args) > len(names):
        raise TypeError(f"{kernel.__name__} takes {len(names)} arguments, got {len(args)}")
    bound = dict(zip(names, args))
    for name, value in constexprs.items():
        if name in bound or name not in names:
            raise TypeError(f"{kernel.__name__}: unexpected or repeated argument {name!r}")
        bound[name] = value
    for p in kernel.params:
        if p.name not in bound:
            if not p.has_default:
                raise TypeError(f"{kernel.__name__}: missing argument {p.name!r}")
            bound[p.name] = p.default
    return bound


_CHECKED_WRITES: dict = {}


def _specialisation(kernel, bound: dict, tma: dict) -> tuple:
    """What of a launch the write analysis can depend on: the constexpr values, which arguments
    are tensors (and of which dtype) or descriptors, and which ints are 1 (specialised away)."""
    parts = []
    for p in kernel.params:
        v = bound[p.name]
        if p.is_constexpr:
            parts.append(repr(v))
        elif isinstance(v, torch.Tensor):
            parts.append(("desc" if p.name in tma else "tensor", v.dtype))
        else:
            parts.append((type(v).__name__, v == 1 if isinstance(v, int) else None))
    return tuple(parts)


def _check_writes(kernel, kernel_idx: int, constants_idx: int, graphable: dict, bound: dict,
                  tma: dict, writes: tuple, address_reads: tuple = ()) -> None:
    """Raise ``Untraceable`` unless Inductor's analysis of the kernel finds exactly ``writes``,
    plus at most ``address_reads`` (once per specialisation: the analysis compiles the kernel to
    Triton IR)."""
    from torch._higher_order_ops.triton_kernel_wrap import get_mutated_tensors

    key = (kernel, _specialisation(kernel, bound, tma), writes)
    found = _CHECKED_WRITES.get(key)
    if found is None:
        # The analysis reads only each tensor's dtype: small real stand-ins for the functional
        # tensors of the trace (it cannot read their addresses).
        with torch._C._DisableTorchDispatch():
            stand_ins = {k: torch.empty(16, dtype=v.dtype) if isinstance(v, torch.Tensor) else v
                         for k, v in graphable.items()}
        found = _CHECKED_WRITES[key] = frozenset(
            get_mutated_tensors(kernel_idx, constants_idx, stand_ins, tma))
    if not frozenset(writes) <= found <= frozenset(writes) | frozenset(address_reads):
        raise Untraceable(
            f"Inductor's analysis of {kernel.__name__} finds it writes {sorted(found)}, "
            f"not {sorted(writes)}")


def _fresh_view(t: torch.Tensor) -> torch.Tensor:
    """A no-op view of a tensor a launch reads through a TMA descriptor: its own IR node.

    Inductor makes one descriptor per (IR node, block) and reuses it for every launch that asks
    again (``ir.TMADescriptor._CACHE``, torch 2.11 and 2.13), and the descriptor node depends on
    the buffer as it was when the descriptor was first made. A launch reading, through a
    descriptor, a buffer that an earlier launch of the graph wrote through a descriptor of the
    same block (one attention's output fed as the next one's q; a KV cache written in place
    after an earlier read) would then get the earlier descriptor, with no dependency on the
    write: Inductor dropped such writers as dead code (H100, torch 2.11: 10 of 11 chained
    forwards, silently). A fresh view is a new IR node (a ``ReinterpretView``: no copy, no
    kernel), so its descriptor is made after, and depends on, the write.

    It carries the strides of the trace. A saved activation whose strides Inductor padded when it
    compiled the forward (comprehensive padding: strides over 1024 elements rounded up to 128
    bytes; the backward's placeholder then has the padded ones) would be reinterpreted with the
    unpadded strides. That cannot happen to what a descriptor reads here: the TMA families take
    16-bit q/k/v/dout/out with D 64, 128 or 256 (attention_hopper.TMA_HEAD_DIMS,
    TMA_PAIR_HEAD_DIMS), so every stride over 1024 of theirs is already a multiple of 64
    elements. A family that widens those must revisit this (stop 48)."""
    return t.as_strided(t.shape, t.stride(), t.storage_offset())


STATIC_LAUNCH_OPTION = "static_launch_user_defined_triton_kernels"  # Inductor's (torch 2.8 and later)


def _static_launch() -> bool:
    """Will Inductor launch the user kernels of the graph being compiled statically? (Its option,
    set for the whole compile by the named backend under FUSE_PLUGIN_STATIC_LAUNCH, or by the
    user; its static launcher on, and no C++ wrapper, which launches every kernel itself.)"""
    from torch._inductor import config

    return (bool(getattr(config, STATIC_LAUNCH_OPTION, False))
            and bool(getattr(config, "use_static_cuda_launcher", True)) and not config.cpp_wrapper)


# The modules that define this package's Triton kernels (``ours``).
KERNEL_MODULES = ("attention_fwd", "attention_bwd", "attention_small", "attention_decode",
                  "attention_fwd_tma", "attention_bwd_tma", "rotary")


def kernel_name(autotuner) -> str:
    """The Triton function name of Inductor's ``autotuner`` (a compiled user kernel): Inductor
    re-emits a user kernel's source under the name it had, and names its variable that name and
    "_<n>"."""
    name = getattr(getattr(autotuner, "fn", None), "__name__", None)
    if name is None:
        name = str((getattr(autotuner, "inductor_meta", None) or {}).get("kernel_name", "")).rpartition("_")[0]
    return name


def ours(autotuner) -> bool:
    """Is Inductor's ``autotuner`` one of this package's kernels (by ``kernel_name``)? static_launch.py."""
    return kernel_name(autotuner) in _kernel_names()


@functools.lru_cache(maxsize=None)
def _kernel_names() -> frozenset:
    import importlib

    names = set()
    for m in KERNEL_MODULES:
        module = importlib.import_module(f"{__name__.rpartition('.')[0]}.{m}")
        names.update(k for k, v in vars(module).items() if hasattr(v, "arg_names") and hasattr(v, "fn"))
    return frozenset(names)


def _record(kernel, grid: tuple, args: tuple, constexprs: dict, writes: tuple, num_warps,
            num_stages, address_reads: tuple = ()) -> None:
    from torch._higher_order_ops.triton_kernel_wrap import (
        kernel_side_table,
        triton_kernel_wrapper_mutation,
    )

    bound = bind(kernel, args, constexprs)
    missing = [w for w in writes if w not in bound]
    if missing:
        raise TypeError(f"{kernel.__name__}: writes names unknown parameters {missing}")
    for name in writes:  # a gradient written through its view: the buffer itself (host.gradient_buffer)
        buf = getattr(bound[name], GRADIENT_BUFFER, None)
        if buf is not None:
            bound[name] = buf
    tma = {}
    if any(isinstance(v, Desc) for v in bound.values()) and _static_launch():
        # Inductor's static launcher has no tensor-descriptor argument type (torch 2.13's raises a
        # KeyError inside the compile): such a call stays an opaque op, launched by Triton's own
        raise Untraceable("Inductor's static launcher (static_launch_user_defined_triton_kernels) "
                          "takes no TMA descriptors")
    for name, value in bound.items():
        if isinstance(value, Desc):
            t = value.tensor
            if name not in writes:
                t = _fresh_view(t)
            bound[name] = t
            tma[name] = ("stable", (list(value.block),))
    graphable = {k: v for k, v in bound.items() if _graphable(v)}
    constants = {k: v for k, v in bound.items() if not _graphable(v)}
    kernel_idx = kernel_side_table.add_kernel(_with_config(kernel, num_warps, num_stages))
    constants_idx = kernel_side_table.add_constant_args(constants)
    _check_writes(kernel, kernel_idx, constants_idx, graphable, bound, tma, writes, address_reads)
    grid3 = tuple(grid) + (1,) * (3 - len(grid))
    triton_kernel_wrapper_mutation(
        kernel_idx=kernel_idx,
        constant_args_idx=constants_idx,
        grid=[grid3],
        tma_descriptor_metadata=tma,
        kwargs=graphable,
    )
