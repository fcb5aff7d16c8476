"""Editing a Dynamo FX graph: new nodes with the metadata the rest of the compile reads, and
erasing what a replacement left dead.

A new node gets the source lines of the node it replaces (`stack_trace`, `nn_module_stack`: the
report and TORCH_LOGS name them) and an `example_value` computed from its inputs' example values
under their fake mode (Inductor and AOTAutograd read it). `NodeBuilder` inserts such nodes and can
take them all back if building a replacement fails half way.

A matcher that must read a node it would build (a mask viewed to another shape, to prove it causal)
makes it `detached`: a node like a built one, but in no graph and among no node's users, so that
matching leaves the graph as it is; the replacement inserts a copy (`NodeBuilder.build`).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, Iterable, Optional

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .canon import example_value, writes_an_input

_SOURCE_META = ("stack_trace", "nn_module_stack")


def graph_fake_mode(gm: fx.GraphModule):
    """The fake mode of the graph's inputs' example values (None without tensor inputs)."""
    values = [example_value(n) for n in gm.graph.nodes if n.op == "placeholder"]
    values = [v for v in values if isinstance(v, torch.Tensor)]
    return detect_fake_mode(values) if values else None


def fakes(value: Any) -> list:
    """The fake tensors in `value`: the fake tensors among its leaves, and the inner tensors of a
    tensor subclass (a DTensor's local shard under tensor parallelism, whose own example value is
    no FakeTensor but wraps one)."""
    out = []
    for t in torch.utils._pytree.tree_leaves(value):
        if isinstance(t, torch._subclasses.FakeTensor):
            out.append(t)
        elif isinstance(t, torch.Tensor) and is_traceable_wrapper_subclass(t):
            attrs, _ = t.__tensor_flatten__()
            out.extend(fakes([getattr(t, a) for a in attrs]))
    return out


def fake_mode_of(value: Any):
    """The fake mode of the (first) fake tensor in `value`, or None."""
    found = fakes(value)
    return found[0].fake_mode if found else None


def evaluate(node: fx.Node, default_mode=None) -> Any:
    """`node` run on its inputs' example values, under the fake mode they belong to (`default_mode`
    when no input is a fake tensor); None when they belong to different fake modes.

    The mode is read off the inputs (inside DTensors too): a deep-copied graph (`fuse_plugin.explain`) has its own copy,
    which is not the tracing context's mode that detect_fake_mode would find first."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), example_value)
    modes = {id(t.fake_mode): t.fake_mode for t in fakes((args, kwargs))}
    if len(modes) > 1:
        return None
    mode = next(iter(modes.values()), default_mode)
    with mode if mode is not None else nullcontext():
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
    raise AssertionError(f"cannot evaluate a {node.op} node")


def set_example_value(node: fx.Node, default_mode=None) -> Any:
    """Store (and return) `evaluate(node)` as the node's example value."""
    value = evaluate(node, default_mode)
    if value is not None:
        node.meta["example_value"] = value
    return value


def copy_source_meta(new: fx.Node, old: fx.Node) -> None:
    """Give `new` the source lines of `old`."""
    for key in _SOURCE_META:
        if key in old.meta:
            new.meta[key] = old.meta[key]


class NodeBuilder:
    """Inserts nodes before `before`, each with the source lines of `meta_from` and its example
    value; `rollback()` erases every node it inserted (those still unused)."""

    def __init__(self, graph: fx.Graph, before: fx.Node, meta_from: fx.Node, fake_mode=None):
        self.graph = graph
        self.before = before
        self.meta_from = meta_from
        self.fake_mode = fake_mode
        self.created: list[fx.Node] = []

    def sibling(self, meta_from: fx.Node, before: Optional[fx.Node] = None) -> "NodeBuilder":
        """A builder whose nodes carry the source lines of `meta_from`, inserted before `before`
        (default: where this one inserts), rolled back with this one."""
        other = NodeBuilder(self.graph, self.before if before is None else before, meta_from, self.fake_mode)
        other.created = self.created
        return other

    def _finish(self, node: fx.Node, fake_mode=None) -> fx.Node:
        self.created.append(node)
        copy_source_meta(node, self.meta_from)
        set_example_value(node, fake_mode or self.fake_mode)
        return node

    def add(self, op: str, target, args: tuple, kwargs: Optional[dict] = None, fake_mode=None) -> fx.Node:
        with self.graph.inserting_before(self.before):
            node = self.graph.create_node(op, target, args, kwargs or {})
        return self._finish(node, fake_mode)

    def function(self, target, *args, **kwargs) -> fx.Node:
        return self.add("call_function", target, args, kwargs)

    def factory(self, like: fx.Node, target, *args, **kwargs) -> fx.Node:
        """A call without tensor inputs (e.g. torch.randint). Its example value is made under the
        fake mode of `like`'s example value, so that the nodes using both stay in one mode."""
        value = example_value(like)
        return self.add("call_function", target, args, kwargs, fake_mode_of(value))

    def method(self, name: str, *args) -> fx.Node:
        return self.add("call_method", name, args)

    def copy(self, node: fx.Node, arg_transform: Callable[[fx.Node], Any]) -> fx.Node:
        """A copy of `node` with its inputs mapped by `arg_transform` (fresh metadata)."""
        with self.graph.inserting_before(self.before):
            new = self.graph.node_copy(node, arg_transform)
        new.meta = {}
        return self._finish(new)

    def build(self, nodes: Iterable[fx.Node]) -> dict:
        """Insert a copy of each detached node of `nodes`, in order, reading the copies of those
        among its inputs: {detached node: its copy}."""
        built: dict = {}
        for n in nodes:
            built[n] = self.copy(n, lambda a: built.get(a, a))
        return built

    def rollback(self) -> None:
        for n in reversed(self.created):
            if not n.users:
                self.graph.erase_node(n)
        self.created.clear()


class _Detached(fx.Node):
    """A node in no graph's node list, which its inputs do not count among their users."""

    def _update_args_kwargs(self, args, kwargs) -> None:  # (fx.Node's adds the node to its inputs' users)
        self._args, self._kwargs = args, kwargs
        self._input_nodes = {}
        fx.node.map_arg((args, kwargs), self._input_nodes.setdefault)


_NOWHERE = fx.Graph()  # the graph a detached node names as its own (it is not in its node list)


def detached(op: str, target, args: tuple, meta_from: fx.Node, fake_mode=None) -> fx.Node:
    """A node reading `args` as a built one would, with the source lines of `meta_from` and its
    example value, but in no graph: no node counts it among its users, it has none and precedes
    nothing. A matcher reads it as it reads the graph (call_of, shape, the abstract value of a
    mask) and changes nothing; `NodeBuilder.build` inserts a copy."""
    node = _Detached(_NOWHERE, target if isinstance(target, str) else target.__name__, op, target, args, {})
    copy_source_meta(node, meta_from)
    set_example_value(node, fake_mode)
    return node


def precedes(a: fx.Node, b: fx.Node) -> bool:
    """Is a (still in the graph) before b?"""
    if getattr(a, "_erased", False) or a.graph is not b.graph:
        return False
    n = a
    while n.op != "root":
        if n is b:
            return True
        n = n.next
    return False


def erase_dead(graph: fx.Graph, nodes: Iterable[fx.Node], *, with_dead_inputs: bool = False) -> None:
    """Erase the nodes of `nodes` left without users (users first, so a chain of them goes). With
    `with_dead_inputs`, also the inputs that die with them, where erasing changes nothing else
    (no impure op, no in-place write). A node of `nodes` that writes in place is erased all the
    same: the caller vouches that it writes only into nodes that die with it."""
    ours = set(nodes)
    order = {n: i for i, n in enumerate(graph.nodes)}
    work = sorted((n for n in ours if n in order), key=order.get, reverse=True)
    while work:
        n = work.pop(0)
        if getattr(n, "_erased", False) or n.users or n.op not in ("call_function", "call_method", "get_attr"):
            continue
        if n not in ours and (n.is_impure() or writes_an_input(n)):
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        work.extend(i for i in inputs if with_dead_inputs or i in ours)
