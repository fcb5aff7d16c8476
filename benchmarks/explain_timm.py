"""Print explain's report and the kernel families chosen for one timm model (its hand-written attention).

    python benchmarks/explain_timm.py levit_128s [--train] [--batch 64]

The model as zoo.py builds it (bf16, fused attention off, eval unless --train); the report names every
site's decision and reason; then one compiled call, where TORCH_LOGS=+fuse_plugin logs the family
each attention call runs.
"""
import argparse
import torch

import fuse_plugin
import zoo


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--train", action="store_true")
    p.add_argument("--batch", type=int, default=64)
    a = p.parse_args()
    model = zoo.create(a.model)
    zoo.set_fused_attn(model, False)
    model = model.to(device="cuda", dtype=torch.bfloat16).train(a.train)
    x = torch.randn(a.batch, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        model(x)  # (LeViT fills its attention-bias cache on the first eval call)
    with torch.set_grad_enabled(a.train):
        print(fuse_plugin.explain(model, x))
        torch._dynamo.reset()
        torch.compile(model, backend="fuse_plugin")(x)  # (TORCH_LOGS=+fuse_plugin: each call's family)


if __name__ == "__main__":
    main()
