"""What a rewrite did: replaced sites and near misses, with their source lines."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import fx


def source_of(node: fx.Node) -> str:
    """`file.py:LINE  code` of the user frame that created the node (from Dynamo's stack trace)."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)', trace)
    if not frames:
        return f"<{node.name}>"
    path, line, code = frames[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line}  {code.strip()}"


@dataclass
class Site:
    """A subgraph replaced by one of our ops."""

    kind: str  # "attention" | "sdpa" (an SDPA call) | "rotary" | "rope_attention" (a rotary q+k pair folded into an attention)
    source: str
    detail: str = ""
    graph: str = ""  # "" at top level, else the subgraph's path, e.g. "wrap_body_0 (tag_activation_checkpoint)"


@dataclass
class Miss:
    """A candidate (a softmax, a cat that looked like a rotary) left as it was, and why."""

    kind: str
    source: str
    reason: str
    graph: str = ""


@dataclass
class Report:
    graphs: int = 0
    sites: list[Site] = field(default_factory=list)
    misses: list[Miss] = field(default_factory=list)
    left: list[Miss] = field(default_factory=list)  # matched, left as they are by the measured choice
    walked_subgraphs: int = 0  # higher-order ops' subgraphs rewritten (each once)
    where: str = ""  # the (sub)graph being rewritten: what replaced()/missed() record as Site.graph

    def replaced(self, kind: str, node: fx.Node, detail: str = "") -> None:
        self.sites.append(Site(kind, source_of(node), detail, self.where))

    def missed(self, kind: str, node: fx.Node, reason: str) -> None:
        self.misses.append(Miss(kind, source_of(node), reason, self.where))

    def left_as_is(self, kind: str, node: fx.Node, reason: str) -> None:
        """A matched site the measured choice leaves as it is (patterns/choice.py): to Inductor
        (a hand-written attention) or as SDPA (an SDPA call)."""
        self.left.append(Miss(kind, source_of(node), reason, self.where))

    def subgraphs(self) -> dict[str, int]:
        """Fused sites per subgraph path (top level left out): what a higher-order op held."""
        out: dict[str, int] = {}
        for s in self.sites:
            if s.graph:
                out[s.graph] = out.get(s.graph, 0) + 1
        return out

    def count(self, kind: str) -> int:
        return sum(s.kind == kind for s in self.sites)

    def extend(self, other: "Report") -> None:
        self.graphs += other.graphs
        self.walked_subgraphs += other.walked_subgraphs
        self.sites += other.sites
        self.misses += other.misses
        self.left += other.left

    def __str__(self) -> str:
        # A site inside a higher-order op's subgraph (checkpoint, invoke_subgraph, cond, ...) names it.
        rows = [("fused", s.kind, s.source + (f"  [in {s.graph}]" if s.graph else ""), s.detail) for s in self.sites]
        rows += [("left", m.kind, m.source + (f"  [in {m.graph}]" if m.graph else ""), m.reason) for m in self.left]
        rows += [("not fused", m.kind, m.source + (f"  [in {m.graph}]" if m.graph else ""), m.reason) for m in self.misses]
        folded = self.count("rope_attention")
        head = (
            f"fuse_plugin: {len(self.sites) - folded} site(s) fused "
            f"({self.count('attention')} attention, "
            + (f"{self.count('sdpa')} SDPA call(s), " if self.count("sdpa") else "")
            + f"{self.count('rotary')} rotary"
            + (f"; {folded} rotary q+k pair(s) folded into their attention" if folded else "")
            + ")" + (f", {len(self.left)} left as they are by measurement" if self.left else "")
            + f", {len(self.misses)} near miss(es), in {self.graphs} graph(s)"
            + (f" and {self.walked_subgraphs} subgraph(s) of higher-order ops" if self.walked_subgraphs else "")
        )
        if not rows:
            return head
        widths = [max(len(r[i]) for r in rows + [("result", "kind", "source", "detail")]) for i in range(3)]
        lines = [head, "  ".join(h.ljust(w) for h, w in zip(("result", "kind", "source"), widths)) + "  detail / reason"]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows]
        return "\n".join(lines)

    __repr__ = __str__
