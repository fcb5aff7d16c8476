"""Every switch of the plugin, read and parsed here and nowhere else.

Environment switches. Each is read when it is used (at compile time unless said), so a change takes
effect at the next compile; Inductor's caches key compiled graphs on ``key()`` below.

| switch | values (default first) | what it does | read by |
|---|---|---|---|
| FUSE_PLUGIN_AUTOPATCH | on, off | plain ``torch.compile`` rewrites once ``fuse_plugin`` is imported (read once, at the import) | autopatch.install_from_env |
| FUSE_PLUGIN_INDUCTOR_LAUNCH | on, off | off: every op stays one opaque call in compiled graphs (for comparisons and debugging) | ops/inductor.py |
| FUSE_PLUGIN_ROPE_ATTENTION | off, on | on: rotary q+k pairs feeding only an attention fold into it (``rope_attention``; slower on an H100, benchmarks/RESULTS.md) | patterns/__init__.py |
| FUSE_PLUGIN_CPU_KERNELS | reference, triton | CPU tensors run the plain-torch reference, or the Triton kernels in Triton's interpreter (needs ``TRITON_INTERPRET=1``; CI) | ops/_dispatch.py (at run time) |
| FUSE_PLUGIN_ATTENTION_TABLE | (shipped), a path, off | the launch-config (tiles) table: the shipped one, another JSON file, or none (heuristic tiles) | kernels/tuning.py |
| FUSE_PLUGIN_CHOICE_TABLE | (shipped), a path, off | the measured times the kernel families and the site choice read: shipped, another file, or none | kernels/choice_table.py |
| FUSE_PLUGIN_ATTENTION_FAMILY | auto, a family name | every attention call runs this kernel family (kernels/registry.py names them); auto: chosen per problem | kernels/registry.py |
| FUSE_PLUGIN_SITE_CHOICE | auto, ours, inductor, sdpa, sdpa_repeat | a matched site: the fastest measured of our op, the site as it is (Inductor's for a hand-written one, SDPA itself for an SDPA call) and, for a hand-written one, an SDPA call in its place (auto); always our op; never (left as written); or an SDPA call wherever the site can be one (sdpa; else our op; sdpa_repeat: a GQA site's k/v repeated for it, not enable_gqa) | patterns/choice.py |
| FUSE_PLUGIN_ROTARY_SITES | auto, ours, off | a matched rotary embedding: left as written where a graph is compiled for CUDA with static shapes, the rotary rotates halves (rotate_half; interleaved pairs stay our op where nothing needs a gradient) and is not folded into an attention (auto: Inductor fuses that eager spelling into its neighbours, measured faster than our op's decomposition); always our op (ours); never (off) | patterns/choice.py |
| FUSE_PLUGIN_CPU_SITES | auto, ours | a matched site (hand-written attention, rotary, nn.MultiheadAttention, an SDPA call) whose tensors are not on CUDA: left as stock compile has it (auto: there our ops run their plain-torch reference, measured 0.53-0.95x stock compile on the CPU, benchmarks/cpu_sites.py); rewritten as on CUDA (ours: the CPU test suite, the demo on the CPU). FUSE_PLUGIN_SITE_CHOICE=ours / sdpa and FUSE_PLUGIN_ROTARY_SITES=ours take precedence | patterns/choice.py |
| FUSE_PLUGIN_SDPA_SITES | on, off | off: `F.scaled_dot_product_attention` calls are not read (else each one goes to our op where measured faster, patterns/sdpa.py) | patterns/sdpa.py |
| FUSE_PLUGIN_KEY_PADDING_SKIP | auto, on, off | the general kernels skip the key blocks a per-key padding mask hides (kernels/key_range.py): auto where measured faster (at least 1024 keys and the work of a 32 x 12 x 1024 x 1024 problem), on from 256 keys, off: every key block visited and the padded ones masked | kernels/key_range.py |
| FUSE_PLUGIN_STATIC_LAUNCH | on, off | graphs compiled by ``backend="fuse_plugin"`` launch our traced kernels through Inductor's static CUDA launcher, as Inductor launches its own (its ``static_launch_user_defined_triton_kernels``; paired 0.996-1.10x against Triton's launcher on six host-bound timm rows, benchmarks/RESULTS.md stop 43), except under CUDA graphs (no host launches to save) and where the graph holds a Triton kernel of the user's (that launcher takes no TMA descriptor, and may fail on theirs); a launch of ours with TMA descriptors leaves its op opaque; a torch without the option: no change | backend.py, kernels/launch.py |
| FUSE_PLUGIN_STATIC_LAUNCH_WORKERS | on, off | on: where the static-launch option is on (STATIC_LAUNCH, or a user's), the kernels of ours that Inductor's compile workers built (whose config lacks the option, so they came back for Triton's launcher: twins_svt_s training, H100, stop 45) are compiled again in the parent for it (H100, stop 47: all 16 of twins_svt_s's then static) | kernels/static_launch.py |

Booleans take ``1 true on yes`` and ``0 false off no``, in any case; choices take their listed
values in any case; surrounding blanks are ignored and an unset or blank switch has its default.
Any other value raises a ValueError that names the switch and its values.

Switches of the tests and the tuner (never read by a compile or an op; booleans and choices parsed
as above where they go through ``boolean`` / ``choice``):

| switch | values | what it does |
|---|---|---|
| FUSE_PLUGIN_STOCK_CASES | off, on | tests/test_stock_attention_cases.py: also re-derive which cases stock Inductor fuses (slow) |
| FUSE_PLUGIN_FUZZ | an int (80 in tests/test_fuzz.py, 500 in tests/fuzz_attention.py) | how many differential fuzz cases |
| FUSE_PLUGIN_FUZZ_SEED | an int (0) | the first fuzz seed |
| FUSE_PLUGIN_FUZZ_BACKEND | aot_eager, inductor | the backend the fuzz cases compile with |
| FUSE_PLUGIN_SPELLING_FUZZ | an int (16) | tests/test_spellings.py: how many random spellings |
| FUSE_PLUGIN_DIST_BACKEND | rewrite_aot_eager, fuse_plugin | tests/test_distributed.py: the rewrite + AOTAutograd, or the real backend |
| FUSE_PLUGIN_CP_INDUCTOR | 1, 0 | tests/test_context_parallel.py: 0 skips the Inductor scenarios (the real backend and plain torch.compile under context_parallel) |
| FUSE_TUNE_DEVICE | cuda, cpu | ``python -m fuse_plugin.tune``: cpu is an interpreter dry run (tests) |

Per thread, not in the environment: ``fuse_plugin.disabled()`` (no rewrite while it is active).
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Optional

_state = threading.local()

AUTOPATCH = "FUSE_PLUGIN_AUTOPATCH"
INDUCTOR_LAUNCH = "FUSE_PLUGIN_INDUCTOR_LAUNCH"
ROPE_ATTENTION = "FUSE_PLUGIN_ROPE_ATTENTION"
CPU_KERNELS = "FUSE_PLUGIN_CPU_KERNELS"
ATTENTION_TABLE = "FUSE_PLUGIN_ATTENTION_TABLE"
CHOICE_TABLE = "FUSE_PLUGIN_CHOICE_TABLE"
ATTENTION_FAMILY = "FUSE_PLUGIN_ATTENTION_FAMILY"
SITE_CHOICE = "FUSE_PLUGIN_SITE_CHOICE"
SDPA_SITES = "FUSE_PLUGIN_SDPA_SITES"
ROTARY_SITES = "FUSE_PLUGIN_ROTARY_SITES"
CPU_SITES = "FUSE_PLUGIN_CPU_SITES"
KEY_PADDING_SKIP = "FUSE_PLUGIN_KEY_PADDING_SKIP"
STATIC_LAUNCH = "FUSE_PLUGIN_STATIC_LAUNCH"
STATIC_LAUNCH_WORKERS = "FUSE_PLUGIN_STATIC_LAUNCH_WORKERS"

TRUE = ("1", "true", "on", "yes")
FALSE = ("0", "false", "off", "no")


# ------------------------------------------------------------------------------------------------
# Parsers: one way for every switch
# ------------------------------------------------------------------------------------------------


def _raw(env: str) -> Optional[str]:
    """The switch's value without surrounding blanks; None when unset or blank."""
    value = os.environ.get(env)
    if value is None or not value.strip():
        return None
    return value.strip()


def boolean(env: str, default: bool) -> bool:
    """The boolean switch ``env`` (module docstring: spellings); ``default`` when unset or blank."""
    value = _raw(env)
    if value is None:
        return default
    if value.lower() in TRUE:
        return True
    if value.lower() in FALSE:
        return False
    raise ValueError(f"{env} must be one of {', '.join(TRUE + FALSE)} (any case), got {value!r}")


def choice(env: str, allowed: tuple, default: str) -> str:
    """The value of switch ``env`` (case ignored), one of ``allowed``; ``default`` when unset or
    blank. Anything else is an error that names the switch and its values."""
    value = _raw(env)
    if value is None:
        return default
    if value.lower() not in allowed:
        raise ValueError(f"{env} must be one of {', '.join(allowed)}, got {value!r}")
    return value.lower()


def _table(env: str) -> Optional[str]:
    """A table switch: None for the shipped table (unset or blank), "off" (any case) for none,
    else the path as given."""
    value = _raw(env)
    if value is not None and value.lower() == "off":
        return "off"
    return value


# ------------------------------------------------------------------------------------------------
# The switches
# ------------------------------------------------------------------------------------------------


def autopatch() -> bool:
    """Install the automatic patch at ``import fuse_plugin``? (``FUSE_PLUGIN_AUTOPATCH``, default on.)"""
    return boolean(AUTOPATCH, True)


def inductor_launch() -> bool:
    """Do the ops decompose into their kernel launches in compiled graphs (ops/inductor.py)?
    (``FUSE_PLUGIN_INDUCTOR_LAUNCH``, default on.)"""
    return boolean(INDUCTOR_LAUNCH, True)


def rope_attention_enabled() -> bool:
    """Fold rotary q+k pairs into their attention (`rope_attention`)? Off unless
    `FUSE_PLUGIN_ROPE_ATTENTION` is on: on the H100 the folded kernels are slower than rotary_qk +
    attention (benchmarks/RESULTS.md, "Rope folded into attention"), so the unfused pair is the
    default."""
    return boolean(ROPE_ATTENTION, False)


def cpu_kernels() -> str:
    """What CPU tensors run (``FUSE_PLUGIN_CPU_KERNELS``): "reference" (default, plain torch) or
    "triton" (the kernels in Triton's interpreter; ops/_dispatch.py checks TRITON_INTERPRET)."""
    return choice(CPU_KERNELS, ("reference", "triton"), "reference")


def attention_table() -> Optional[str]:
    """The launch-config table (``FUSE_PLUGIN_ATTENTION_TABLE``): None for the shipped one, "off"
    for none (heuristic tiles), else a JSON path (kernels/tuning.py)."""
    return _table(ATTENTION_TABLE)


def choice_table() -> Optional[str]:
    """The measured-choice table (``FUSE_PLUGIN_CHOICE_TABLE``): None for the shipped one, "off"
    for none, else a JSON path (kernels/choice_table.py)."""
    return _table(CHOICE_TABLE)


def attention_family() -> Optional[str]:
    """A kernel family every attention call runs (`FUSE_PLUGIN_ATTENTION_FAMILY`: one of
    kernels.registry.NAMES, e.g. "general", checked there; "auto", the default: chosen per
    problem). A call the family cannot run raises an error that lists every family's reason."""
    value = _raw(ATTENTION_FAMILY)
    value = "auto" if value is None else value.lower()
    return None if value == "auto" else value


def site_choice() -> str:
    """What the rewrite does with a matched attention site (`FUSE_PLUGIN_SITE_CHOICE`): "auto"
    (the default: the fastest measured way, patterns/choice.py), "ours" (always our op),
    "inductor" (never: every site left as it is, reported) or "sdpa" (a hand-written site becomes
    an SDPA call where it can be one, else our op; SDPA call sites stay as they are); "sdpa_repeat"
    as "sdpa", a GQA site's k/v repeated to the query heads for the call instead of enable_gqa."""
    return choice(SITE_CHOICE, ("auto", "ours", "inductor", "sdpa", "sdpa_repeat"), "auto")


def rotary_sites() -> str:
    """What the rewrite does with a matched rotary embedding (`FUSE_PLUGIN_ROTARY_SITES`): "auto"
    (patterns/choice.decide_rotary), "ours" (always our op) or "off" (never: left as written)."""
    return choice(ROTARY_SITES, ("auto", "ours", "off"), "auto")


def cpu_sites() -> str:
    """What the rewrite does with a matched site whose tensors are not on CUDA
    (`FUSE_PLUGIN_CPU_SITES`): "auto" (the default: left as written, patterns/choice.off_cuda) or
    "ours" (rewritten as on CUDA, by the rest of the choice)."""
    return choice(CPU_SITES, ("auto", "ours"), "auto")


def sdpa_sites() -> bool:
    """Read `F.scaled_dot_product_attention` calls as attention sites (`FUSE_PLUGIN_SDPA_SITES`,
    default on; patterns/sdpa.py)? Off: they stay as they are and are not reported."""
    return boolean(SDPA_SITES, True)


def key_padding_skip() -> str:
    """Where do the general attention kernels skip the key blocks a per-key padding mask hides
    (`FUSE_PLUGIN_KEY_PADDING_SKIP`, kernels/key_range.py)? "auto" (the default): where measured
    faster (key_range.AUTO_MIN_KEYS, AUTO_MIN_WORK); "on" (or a true spelling): wherever a block
    can be skipped; "off" (or a false spelling): never, every key block visited and the padded
    ones masked (a benchmark's "dense padding vector" side). Read per call, so traced graphs key
    on it (``key``)."""
    value = _raw(KEY_PADDING_SKIP)
    if value is None or value.lower() == "auto":
        return "auto"
    if value.lower() not in TRUE + FALSE:
        raise ValueError(f"{KEY_PADDING_SKIP} must be auto or one of {', '.join(TRUE + FALSE)} (any case), "
                         f"got {value!r}")
    return "on" if value.lower() in TRUE else "off"


def static_launch() -> bool:
    """Do graphs compiled by the named backend launch our traced kernels through Inductor's static
    CUDA launcher (`FUSE_PLUGIN_STATIC_LAUNCH`, default on)? Inductor launches its own kernels
    through it and user kernels (ours) through Triton's launcher unless told otherwise; with it,
    six host-bound timm rows ran 0.996-1.10x as fast (paired, H200, stop 43: twins_svt_s
    inference 1.10, swin_t training 1.05, swin_t inference 0.996)."""
    return boolean(STATIC_LAUNCH, True)


def static_launch_workers() -> bool:
    """Are our kernels that Inductor's compile workers built compiled again in the parent for its
    static launcher (`FUSE_PLUGIN_STATIC_LAUNCH_WORKERS`, default on: kernels/static_launch.py)?
    The workers' config lacks the option a compile sets, so without it those kernels launch through
    Triton's launcher (36 launches a step of twins_svt_s training, stop 45; with it all 16 kernels
    of ours there static, H100, stop 47). Read when Inductor finishes a kernel in the parent."""
    return boolean(STATIC_LAUNCH_WORKERS, True)


# ------------------------------------------------------------------------------------------------
# Per thread
# ------------------------------------------------------------------------------------------------


def rewrite_enabled() -> bool:
    return getattr(_state, "disabled", 0) == 0


@contextlib.contextmanager
def disabled():
    """No rewrite while this is active: `with fuse_plugin.disabled(): compiled(x)` around the first
    call of a compiled model (the call that compiles) leaves its graphs as the user wrote them."""
    _state.disabled = getattr(_state, "disabled", 0) + 1
    try:
        yield
    finally:
        _state.disabled -= 1


def key() -> str:
    """What of the settings changes the compiled graph (part of the FX-graph-cache key, see
    autopatch.FusePluginPass.uuid): the rewrite's switches, whether the ops decompose into their
    launches (ops/inductor.py), the launch-config and choice tables they read and the kernel
    family they are held to, whether the kernels skip padded key blocks, whether their launches may
    go through Inductor's static launcher. Not here: AUTOPATCH (read once, at import) and
    CPU_KERNELS (run time; a CPU op stays one opaque call in the graph)."""
    return (f"enabled={rewrite_enabled()},rope_attention={rope_attention_enabled()},"
            f"inductor_launch={inductor_launch()},table={attention_table()},"
            f"choices={choice_table()},family={attention_family()},site={site_choice()},"
            f"sdpa={sdpa_sites()},rotary={rotary_sites()},cpu_sites={cpu_sites()},"
            f"key_padding_skip={key_padding_skip()},"
            f"static_launch={static_launch()},static_launch_workers={static_launch_workers()}")
