"""The README's chart: the plugin's speed-up over the best stock compile, from the recorded results.

    python benchmarks/chart.py [--json benchmarks/results/current.json] [--out docs/speedup.png]

Bars, one per row and mode of benchmarks/results/current.json (``benchmarks/current.py`` renders
the same figures as RESULTS.md's "Current results"):

* whole models (``shapes``): plugin / the better of stock compile and sdpa + compile, medians;
* long context (``e2e``, a 12-layer Llama at 8k tokens): plugin / sdpa + compile (stock compile is
  slower there, see the entry's note), the median over the recorded runs;
* the timm zoo (``zoo``, once measured): plugin / the better of stock compile and timm's fused path
  + compile.

Drawing needs matplotlib (``pip install matplotlib``; not a dependency of the package or of its
tests); ``series`` (what is drawn) is plain Python.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import current  # noqa: E402

OUT = current.ROOT / "docs" / "speedup.png"
MODES = {"default": "default mode", "reduce-overhead": "CUDA graphs (reduce-overhead)"}


def series(data: dict) -> list[dict]:
    """The bars, top to bottom: group (a heading naming the benchmark and its provenance), label,
    mode and ratio (plugin over the best stock variant)."""
    bars = []
    s = data["shapes"]
    p = s["provenance"]
    group = f"Whole models, 4 layers ({p['stop']}, {p['date']})"
    for r in s["rows"]:
        bars.append({"group": group, "label": r["row"], "mode": r["mode"], "ratio": current.shapes_ratio(r)})
    e = data["e2e"]
    p = e["provenance"]
    med = current.e2e_median(data)
    group = f"Long context: Llama, 12 layers, 8k tokens ({p['stop']}, median of {len(e['rows'])} runs)"
    for task, label in (("train", "training, 1 x 8192"), ("infer", "inference, 1 x 8192")):
        bars.append({"group": group, "label": label, "mode": "default", "ratio": med[task]})
    z = data["zoo"]
    if z.get("results"):
        p = z["provenance"]
        group = f"timm zoo, {p['gpu']} ({p['stop']}, {p['date']})"
        for r in z["results"]["rows"]:
            ratio = current.zoo_ratio(r)
            if ratio is not None:
                bars.append({"group": group, "label": f"{r['model']}-{r['task']}", "mode": r["mode"], "ratio": ratio})
    return bars


def title(data: dict) -> str:
    p = data["shapes"]["provenance"]
    return (f"fuse_plugin over the best stock torch.compile (eager or SDPA attention)\n"
            f"{p['gpu']}, bf16, torch {p['torch']}, Triton {p['triton']}, transformers {p['transformers']}")


def draw(data: dict, out: Path = OUT) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = series(data)
    # one y slot per (group, label); the modes of a label side by side within its slot
    slots, y, ticks, heads = {}, 0.0, [], []
    last_group = None
    for b in bars:
        if b["group"] != last_group:
            y += 0.6 if last_group is not None else 0.0
            heads.append((y, b["group"]))
            y += 0.9
            last_group = b["group"]
        key = (b["group"], b["label"])
        if key not in slots:
            slots[key] = y
            ticks.append((y, b["label"]))
            y += 1.0
    height, colors = 0.38, {"default": "#4C72B0", "reduce-overhead": "#DD8452"}
    fig, ax = plt.subplots(figsize=(8.5, 0.27 * y + 1.6))
    used = set()
    for b in bars:
        offset = -height / 2 if b["mode"] == "default" else height / 2
        if not any(o["label"] == b["label"] and o["group"] == b["group"] and o["mode"] != b["mode"] for o in bars):
            offset = 0.0
        pos = slots[(b["group"], b["label"])] + offset
        ax.barh(pos, b["ratio"] - 1.0, left=1.0, height=height, color=colors.get(b["mode"], "#55A868"),
                label=None if b["mode"] in used else MODES.get(b["mode"], b["mode"]))
        used.add(b["mode"])
        ax.text(max(b["ratio"], 1.0) + 0.01, pos, f"{b['ratio']:.2f}x", va="center", fontsize=7)
    for pos, text in heads:
        ax.text(0.0, pos + 0.2, text, transform=ax.get_yaxis_transform(), fontsize=8.5, fontweight="bold",
                va="center", ha="left")
    ax.set_yticks([p for p, _ in ticks], [t for _, t in ticks], fontsize=8)
    ax.axvline(1.0, color="black", linewidth=0.8)
    top, bottom = max(b["ratio"] for b in bars), min(b["ratio"] for b in bars)
    ax.set_xlim(min(0.95, bottom - 0.05), top + 0.12)
    ax.set_ylim(y, -0.5)
    ax.set_xlabel("speed-up (throughput over the best stock variant; 1.0 = equal)", fontsize=8.5)
    ax.set_title(title(data), fontsize=9)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=2, fontsize=8, frameon=False)
    ax.grid(axis="x", linewidth=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=current.JSON)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    data = current.load(args.json)
    try:
        draw(data, args.out)
    except ImportError as err:
        print(f"chart.py needs matplotlib to draw ({err}); pip install matplotlib", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
