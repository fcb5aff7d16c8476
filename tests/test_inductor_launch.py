"""The ops decompose into their kernel launches for Inductor (ops/inductor.py, kernels/launch.py).

The graphs come from tests/inductor_trace.py, run once in a subprocess (real Triton JIT kernels,
not the interpreter; an H100 pretended to torch and Triton; nothing runs). The rotary ops,
which compiled decompose into plain torch math for Inductor to fuse, cannot be traced there
(views of fake CUDA tensors need a CUDA build); tests/test_compiled_gpu.py checks them, and the
compiled models against eager, on a GPU.
"""
import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).with_name("inductor_trace.py")


@pytest.fixture(scope="module")
def traced() -> dict:
    # The trace pretends an H100 on a machine without a GPU; on a GPU machine the real device
    # (its cuDNN, its SM count) would leak into the families' rules: hide it.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["FUSE_PLUGIN_KEY_PADDING_SKIP"] = "on"  # the padding case traces the skip (off by default for now)
    proc = subprocess.run([sys.executable, str(_SCRIPT)], capture_output=True, text=True,
                          timeout=600, env=env, cwd=_SCRIPT.parent.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            case = json.loads(line)
            cases[case.pop("case")] = case
    return cases


def kernels(case: dict) -> list[str]:
    return [name for name, _clones, _tma in case["launches"]]


def clones(case: dict) -> dict:
    return {name: clones for name, clones, _tma in case["launches"]}


def assert_fully_traced(case: dict) -> None:
    """Every op became launches; nothing copies an input; every output a kernel wrote; Inductor
    copies no output buffer before its kernel (inductor_trace.clones_inductor_keeps)."""
    assert "error" not in case, case.get("error")
    assert case["opaque"] == []
    assert case["cloned_inputs"] == []
    assert case["clones_kept"] == []
    assert case["empty_outputs"] == []
    assert case["direct_descriptor_reads"] == []


FWD = "attention_fwd_kernel"
PRE = "attention_bwd_preprocess_kernel"
ATOMIC = "attention_bwd_kernel"
DECODE_SPLIT, DECODE_COMBINE = "attention_decode_split_kernel", "attention_decode_combine_kernel"
# The atomic backward's dQ scale-and-cast is torch math when traced (Inductor fuses it into dq's
# consumer): no attention_dq_cast_kernel launch in compiled graphs.


@pytest.mark.parametrize("name, expected", [
    ("gqa_d64_n1000", [FWD, PRE, ATOMIC]),
    ("d64_n4000", ["attention_fwd_tma_kernel", PRE, ATOMIC]),
    ("d64_n2000", [FWD, PRE, ATOMIC]),
    ("d64_n2000_cudagraphs", ["attention_fwd_tma_kernel", PRE, ATOMIC]),
    ("d256_tma_pair", [FWD, PRE, "attention_bwd_dkdv_tma_kernel", "attention_bwd_dq_tma_kernel"]),
    ("chained_tma", ["attention_fwd_tma_kernel"] * 2),
    ("float_mask_dbias", [FWD, PRE, ATOMIC]),
    ("replace_mask", [FWD, PRE, ATOMIC]),
    ("dropout", [FWD, PRE, ATOMIC]),
    ("window", [FWD, PRE, ATOMIC]),
    ("chunk", [FWD, PRE, ATOMIC]),
    ("one_key_block", [FWD, ATOMIC]),  # no preprocess, dQ stored by the kernel: no cast either
    ("d80", [FWD, PRE, ATOMIC]),
    ("fp32", [FWD, PRE, ATOMIC]),
    ("deterministic", [FWD, PRE, "attention_bwd_dkdv_kernel", "attention_bwd_dq_kernel"]),
    ("rope_attention", [FWD, PRE, ATOMIC, "attention_dq_rope_cast_kernel"]),
    # decode steps: the flash-decoding forward (split + combine), the general backward
    ("decode", [DECODE_SPLIT, DECODE_COMBINE, PRE, ATOMIC]),
    ("decode_bool", [DECODE_SPLIT, DECODE_COMBINE, PRE, ATOMIC]),
])
def test_ops_become_kernel_launches(traced, name, expected):
    case = traced[name]
    assert_fully_traced(case)
    assert kernels(case) == expected


def test_documents_become_kernel_launches(traced):
    """Packed documents (issue 31): the general kernels, the span table built by torch ops beside
    them. Inductor's analysis counts the table as written by the atomic backward (its loop bounds,
    hence the dQ addresses, come from the table's values: kernels/launch.py ``address_reads``), so
    Inductor may copy it once before that launch (B·L·8 bytes); nothing else is copied."""
    case = traced["documents"]
    assert "error" not in case, case.get("error")
    assert case["opaque"] == [] and case["empty_outputs"] == [] and case["copies"] == []
    assert kernels(case) == [FWD, PRE, ATOMIC]
    assert set(case["cloned_inputs"]) <= {"attention_bwd_kernel.Docs"}


def test_padding_mask_becomes_kernel_launches(traced):
    """A (B, 1, 1, L) bool padding mask at 257 keys (issue 31, "padding"): the general kernels skip
    the key blocks it hides, the live key range built by torch ops beside them
    (kernels/key_range.py). As with the documents table, Inductor's analysis counts the range as
    written by the atomic backward (its values bound the query loop, hence the dQ addresses), so
    Inductor may copy it (B·8 bytes) before that launch; nothing else is copied."""
    case = traced["bool_mask"]
    assert "error" not in case, case.get("error")
    assert case["opaque"] == [] and case["empty_outputs"] == [] and case["copies"] == []
    assert kernels(case) == [FWD, PRE, ATOMIC]
    assert set(case["cloned_inputs"]) <= {"attention_bwd_kernel.KeyRange"}


def test_sinks_fold_into_the_forward_launch(traced):
    """gpt-oss's sinks (ops/attention_sinks.py, with a sliding window): the general forward takes
    them (no merge after it), the backward is the attention op's kernels; nothing opaque."""
    case = traced["sinks"]
    assert_fully_traced(case)
    assert kernels(case) == [FWD, PRE, ATOMIC]


def test_head_merge_is_a_view(traced):
    """The output is laid out (B, L, H, D) (ops/attention.py): a model's head merge
    (transpose + reshape) reads it in place, and the gradient arriving through that merge goes
    to the backward kernels as it is: no copy kernel on either side of the op. TMA kernels
    (large problems) write a contiguous tile layout and copy once, the copy the merge would
    have made. The atomic path's dq, from its fp32 accumulator, is cast
    and laid out in q's memory order (one copy, with the cast); dk/dv are written in place."""
    case = traced["head_merge"]
    assert_fully_traced(case)
    assert kernels(case) == [FWD, PRE, ATOMIC]
    assert len(case["copies"]) == 1
    tma = traced["head_merge_tma"]
    assert_fully_traced(tma)
    assert kernels(tma)[0] == "attention_fwd_tma_kernel"
    assert len(tma["copies"]) == 2  # the TMA output's, and dq's cast laid out as q


@pytest.mark.parametrize("name, launches, copies", [
    ("head_split_grads", [FWD, ATOMIC], 0),  # one key block: the kernel stores dq in place
    ("head_split_grads_atomic", [FWD, PRE, ATOMIC], 1),  # dq's cast, laid out as q
    # the TMA pair (D 256, 4000 tokens): each gradient written through a descriptor of its view
    ("head_split_grads_tma", [FWD, PRE, "attention_bwd_dkdv_tma_kernel", "attention_bwd_dq_tma_kernel"], 0),
])
def test_gradients_keep_the_head_split_layout(traced, name, launches, copies):
    """q/k/v as models make them (each a head-split view of its own projection): dq/dk/dv come
    out in the same (B, L, H, D) memory (host.layout_like), so merging the heads back for the
    projections' backward is a view. Before, the gradients were contiguous and each took a copy
    kernel (three per layer: BERT's backward on the H100 spent 180 us per step on them)."""
    case = traced[name]
    assert_fully_traced(case)
    assert kernels(case) == launches
    assert len(case["copies"]) == copies


def test_shipped_choice_table_is_read_when_tracing(traced):
    """BERT's attention (L 128, D 64, key padding, no dropout) with the shipped table: the general
    forward and the small family's backward, as the table measured them fastest on the H100
    (bert-nodrop, stop 39: general 11.4 us forward, small 35.1 us backward against the general
    38.2, which the rules would take); traced like any family."""
    case = traced["shipped_table"]
    assert_fully_traced(case)
    assert kernels(case) == [FWD, "attention_small_bwd_kernel"]


def test_q_is_realised_once_whatever_it_views(traced):
    """A q that Inductor cannot pass as a view (the head-split view of a bias add not yet computed:
    twins_svt_s's global attention) is realised once per kernel parameter that receives it:
    every pointer a launch never reads gets host.placeholder's own buffer, not q (before: nine
    copies of q a forward launch, H100 wrapper of stop 45)."""
    case = traced["q_view_copies"]
    assert "error" not in case, case.get("error")
    assert case["q_copies"] == 1


@pytest.mark.parametrize("name", ["small_swin", "small_dropout"])
def test_small_family_becomes_two_launches(traced, name):
    """The small family (kernels/attention_small.py) traced: one forward and one backward launch
    of its own, a window-periodic bias read as it is and its gradient written by the backward,
    nothing else (no materialised bias, no copy)."""
    case = traced[name]
    assert_fully_traced(case)
    assert kernels(case) == ["attention_small_fwd_kernel", "attention_small_bwd_kernel"]
    assert case["copies"] == []


@pytest.mark.parametrize("name", ["efficient_relpos", "efficient_shifted"])
def test_efficient_family_becomes_its_aten_ops(traced, name):
    """PyTorch's efficient kernels (kernels/attention_efficient.py) traced: its forward and backward
    ATen ops and no Triton launch or opaque op; the bias padded and the gradients reduced by plain
    torch ops, which Inductor fuses."""
    case = traced[name]
    assert "error" not in case, case.get("error")
    assert case["opaque"] == [] and case["cloned_inputs"] == [] and kernels(case) == []
    assert case["efficient"] == ["_scaled_dot_product_efficient_attention",
                                 "_scaled_dot_product_efficient_attention_backward"]


CUDNN_FWD, CUDNN_BWD = "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"


@pytest.mark.parametrize("name, launches, cudnn", [
    ("cudnn", [], [CUDNN_FWD, CUDNN_BWD]),  # 1024 tokens: cuDNN both ways
    ("cudnn_bwd", [FWD], [CUDNN_BWD]),  # 197 tokens: our forward (faster there), cuDNN's backward
    ("cudnn_refused_bias", [FWD, PRE, ATOMIC], []),
    ("cudnn_refused_dropout", [FWD, PRE, ATOMIC], []),
    ("cudnn_d256", [], [CUDNN_FWD, CUDNN_BWD]),  # D 256: cuDNN both ways (measured faster)
    ("cudnn_off", [FWD, PRE, ATOMIC], []),  # torch.backends.cuda.enable_cudnn_sdp(False)
])
def test_cudnn_family_where_it_wins(traced, name, launches, cudnn):
    """kernels/attention_cudnn.py: with cuDNN present (as on the H100), a plain problem long
    enough takes cuDNN's attention as graph nodes Inductor calls directly (nothing opaque of
    ours), the backward fed our forward's out and lse; a bias, dropout, a head dim over 128 or
    the user's switch keep our kernels."""
    case = traced[name]
    assert_fully_traced(case)
    assert kernels(case) == launches
    assert case["cudnn"] == cudnn
    # a contiguous q gives cuDNN's output that layout: one copy into the op's (B, L, H, D)
    assert len(case["copies"]) == (1 if CUDNN_FWD in cudnn else 0)
    merge = traced["head_merge_cudnn"]  # a model's q (a view of the projection): no copy at all
    assert_fully_traced(merge)
    assert merge["cudnn"] == [CUDNN_BWD] and merge["copies"] == []


def test_each_launch_writes_only_its_outputs(traced):
    """What Inductor's Triton-IR analysis finds each kernel writes (and so clones, then re-uses
    in place): the outputs and scratch buffers, never q/k/v or a mask."""
    assert clones(traced["gqa_d64_n1000"]) == {FWD: ["Lse", "Out"], PRE: ["DQA", "Delta", "RowM"],
                                               ATOMIC: ["DK", "DQA", "DV"]}
    # TMA stores are writes too, through the descriptors Inductor builds from the metadata
    name, written, descriptors = traced["d64_n4000"]["launches"][0]
    assert written == ["Lse", "o_desc"] and descriptors == ["k_desc", "o_desc", "q_desc", "v_desc"]
    # a float mask: the row statistics in natural units, and dS for the mask's gradient
    assert clones(traced["float_mask_dbias"])[PRE] == ["DQA", "Delta", "RowM", "RowR"]
    assert clones(traced["float_mask_dbias"])[ATOMIC] == ["DK", "DQA", "DS", "DV"]
    # the replace mask is read, never written
    assert clones(traced["replace_mask"]) == clones(traced["float_mask_dbias"])


def test_gluon_kernels_stay_one_opaque_op_each(traced):
    """Inductor cannot compile Gluon: where the table picks a Gluon kernel (an H100 with Triton
    3.6, pretended here) for a problem large enough, the launcher leaves one internal op per pass
    in the graph; a small problem takes the general Triton kernels (one Inductor launch each, no
    descriptors to build) instead."""
    case = traced["gluon"]
    assert case["launches"] == []
    assert case["opaque"] == ["fuse_plugin.gluon_attention_forward.default",
                              "fuse_plugin.gluon_attention_backward.default"]
    small = traced["gluon_small"]
    assert_fully_traced(small)
    assert kernels(small) == [FWD, PRE, ATOMIC]


def test_gluon_window_reaches_the_opaque_ops(traced):
    """A sliding window in the Gluon kernels' measured range (4096 keys, head dim 128; an H100
    with Triton 3.6 pretended) is passed to both opaque Gluon ops; a narrower one (512) runs the
    general kernels as Inductor launches, as before stop 35."""
    case = traced["gluon_window"]
    assert "error" not in case, case.get("error")
    assert case["launches"] == []
    assert case["opaque"] == ["fuse_plugin.gluon_attention_forward.default",
                              "fuse_plugin.gluon_attention_backward.default"]
    assert case["gluon_windows"] == [4096, 4096]
    narrow = traced["gluon_window_narrow"]
    assert_fully_traced(narrow)
    assert kernels(narrow) == [FWD, PRE, ATOMIC]


def test_an_untraceable_launch_keeps_its_op_whole(traced):
    """A launch whose writes Inductor's analysis would get wrong makes its op stay opaque in that
    graph; the launches traced before it in the same op are dropped as dead code."""
    case = traced["untraceable"]
    assert kernels(case) == [FWD]
    assert case["opaque"] == ["fuse_plugin.attention_backward.default"]


def test_static_launch_keeps_tma_launches_out(traced):
    """Under Inductor's static launcher for user kernels (FUSE_PLUGIN_STATIC_LAUNCH), which has
    no tensor-descriptor argument type: launches without descriptors trace as before; a TMA
    launch leaves its op opaque (Triton's own launcher runs it), not a compile error."""
    plain = traced["static_launch"]
    assert_fully_traced(plain)
    assert kernels(plain) == [FWD, PRE, ATOMIC]
    tma = traced["static_launch_tma"]
    assert "error" not in tma, tma.get("error")
    assert kernels(tma) == [PRE, ATOMIC]
    assert tma["opaque"] == ["fuse_plugin.attention.default"]


@pytest.mark.parametrize("name", ["cpu", "disabled", "export"])
def test_ops_stay_opaque_where_they_should(traced, name):
    """CPU tensors (the reference, CI's interpreter path), FUSE_PLUGIN_INDUCTOR_LAUNCH=0 and
    torch.export keep the ops as they were: one node each."""
    case = traced[name]
    assert case["launches"] == []
    assert case["opaque"] == ["fuse_plugin.attention.default",
                              "fuse_plugin.attention_backward.default"]


@pytest.mark.parametrize("name, expected", [
    ("symbolic_100", [FWD, ATOMIC]),  # the one-launch backward: a guard on Lk <= 128
    ("symbolic_1000", [FWD, PRE, ATOMIC]),
    ("symbolic_bert", [FWD, ATOMIC]),  # padding mask, dropout
    ("symbolic_decode", [DECODE_SPLIT, DECODE_COMBINE, PRE, ATOMIC]),  # split count by the hint
    ("symbolic_rope", [FWD, PRE, ATOMIC, "attention_dq_rope_cast_kernel"]),  # the rope fold
    ("symbolic_all", [FWD, PRE, ATOMIC]),  # dynamic=True: heads and head dims pinned
    ("symbolic_float_mask", [FWD, PRE, ATOMIC]),  # fp32, D 80, dbias, replace mask, dropout
])
def test_dynamic_shapes_become_kernel_launches(traced, name, expected):
    """Dynamic shapes (a SymInt length, as Dynamo makes it once a length changed): the ops still
    become Inductor's launches (before, they stayed opaque: ~0.2-0.45 ms of host time per call).
    Tiles are chosen by the length's hint; guards bound only the kernel families (decode,
    cuDNN, the TMA/Gluon size threshold) and what correctness needs (one key block or not, int32
    tile offsets): none pins the length to a value, so other lengths reuse the graph."""
    case = traced[name]
    assert_fully_traced(case)
    assert kernels(case) == expected
    length = case["length"]  # the length's symbol
    pinned = [g for g in case["guards"] if re.fullmatch(rf"(Eq|Ne)\({length}, -?\d+\)", g)]
    assert pinned == [], pinned
    if name == "symbolic_decode":  # the decode family's bound is a guard: no graph traced at a
        assert f"{length} >= 256" in case["guards"]  # short cache keeps the general kernel
    if name not in ("symbolic_decode", "symbolic_all"):  # (decode: identities of its split
        assert len(case["guards"]) <= 5, case["guards"]  # buffers; all: the pinned head dims)
    if name in ("symbolic_rope", "symbolic_all"):  # GQA split: dK/dV partials summed in place
        assert len(case["copies"]) == (1 if name == "symbolic_all" else 0), case["copies"]


def test_dynamic_shapes_with_tma_kernels_stay_opaque(traced):
    """Where the hint picks a TMA or Gluon kernel (long sequences), whose launches take static
    shapes, the op stays opaque: its host time is small against its device time there."""
    case = traced["symbolic_tma"]
    assert "error" not in case, case.get("error")
    assert case["launches"] == []
    assert case["opaque"] == ["fuse_plugin.attention.default",
                              "fuse_plugin.attention_backward.default"]


def test_bad_switch_value_is_named():
    from fuse_plugin.ops import inductor

    old = os.environ.get(inductor.ENV)
    os.environ[inductor.ENV] = "maybe"
    try:
        with pytest.raises(ValueError, match="FUSE_PLUGIN_INDUCTOR_LAUNCH"):
            inductor.enabled()
    finally:
        if old is None:
            os.environ.pop(inductor.ENV)
        else:
            os.environ[inductor.ENV] = old
