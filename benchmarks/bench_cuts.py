"""Pipeline cut points of models without (enough) repeated blocks (#14 item 4).

Builds three models in code at realistic sizes (a ResNet-50 with bottleneck blocks [3, 4, 6, 3],
a 4-level UNet on 256x256 images, a 4-layer LSTM LM with a 32k vocabulary), traces each, and
prints: nodes, how many repeated-block instances, the candidate cut points (usable / refused),
the layers the stage split works on, the measured wall time of tracing and of a pp=4 estimate on
8 H100s, and the chosen cuts with the tensors and bytes crossing each (predicted, per microbatch).

    PYTHONPATH=. python benchmarks/bench_cuts.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's meshplan, also from a worktree
from meshplan.partition.cuts import blocks_dominate, cut_candidates, layer_ranges, usable_cuts
from meshplan.planner.api import estimate_graph
from meshplan.trace import trace_model


class Bottleneck(nn.Module):
    def __init__(self, cin: int, mid: int, stride: int) -> None:
        super().__init__()
        cout = mid * 4
        self.conv1, self.bn1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv2, self.bn2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv3, self.bn3 = nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        layers, cin = [], 64
        for i, (mid, n) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)]):
            blocks = []
            for j in range(n):
                blocks.append(Bottleneck(cin, mid, 2 if j == 0 and i > 0 else 1))
                cin = mid * 4
            layers.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(2048, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer4(self.layer3(self.layer2(self.layer1(self.stem(x)))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _conv(cin: int, cout: int) -> nn.Module:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.SiLU(),
                         nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.SiLU())


class UNet4(nn.Module):
    def __init__(self, base: int = 64) -> None:
        super().__init__()
        ch = [base, base * 2, base * 4, base * 8]
        self.enc = nn.ModuleList([_conv(3 if i == 0 else ch[i - 1], c) for i, c in enumerate(ch)])
        self.mid = _conv(ch[-1], ch[-1])
        self.up = nn.ModuleList([nn.ConvTranspose2d(ch[i], ch[i - 1], 2, 2) for i in range(3, 0, -1)])
        self.dec = nn.ModuleList([_conv(ch[i - 1] * 2, ch[i - 1]) for i in range(3, 0, -1)])
        self.out = nn.Conv2d(base, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, enc in enumerate(self.enc):
            x = enc(x)
            if i < 3:
                skips.append(x)
                x = F.max_pool2d(x, 2)
        x = self.mid(x)
        for up, dec in zip(self.up, self.dec):
            x = dec(torch.cat([up(x), skips.pop()], dim=1))
        return self.out(x)


class LSTMLM(nn.Module):
    def __init__(self, vocab: int = 32000, hidden: int = 1024, layers: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.lstms = nn.ModuleList([nn.LSTM(hidden, hidden, batch_first=True) for _ in range(layers)])
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for lstm in self.lstms:
            h, _ = lstm(h)
        return self.head(h)


def main() -> None:
    cases = [
        ("resnet50", ResNet50, torch.randn(1, 3, 224, 224), 256),
        ("unet4-256px", UNet4, torch.randn(1, 3, 256, 256), 64),
        ("lstm-lm-4x1024", LSTMLM, torch.randint(0, 32000, (1, 512)), 64),
    ]
    for name, build, x, batch in cases:
        torch.manual_seed(0)
        model = build()
        t0 = time.perf_counter()
        g = trace_model(model, x, name=name)
        trace_s = time.perf_counter() - t0
        cands = cut_candidates(g)
        usable = usable_cuts(g)
        layers = layer_ranges(g)
        inst = sum(bt.count for bt in g.blocks)
        print(f"== {name}: {len(g.nodes)} nodes, {g.param_count / 1e6:.1f} M params, {inst} repeated-block instances "
              f"(block path: {blocks_dominate(g)}); {len(cands)} candidate cut points, {len(usable)} usable, "
              f"{sum(1 for c in cands if c.reason)} refused; "
              f"{len(layers)} layers; trace {trace_s:.2f} s (measured wall)")
        t0 = time.perf_counter()
        bn = "resnet" in name  # BatchNorm: one microbatch (execution_rules.microbatch_blocker), so GPipe
        plan = estimate_graph(g, 8, tp=1, pp=4, dp=2, global_batch_size=batch, num_microbatches=1 if bn else 8,
                              schedule="gpipe" if bn else "1f1b", cluster="h100")
        plan_s = time.perf_counter() - t0
        cuts = {c.after: c for c in cands}
        print(f"   pp=4 dp=2 on 8 H100 ({plan.summary()}): estimate {plan_s:.2f} s (measured wall); "
              f"predicted step {plan.predicted.step_s * 1e3:.2f} ms, pp comm {plan.predicted.pp_comm_s * 1e3:.3f} ms")
        for s in plan.stages[:-1]:
            c = cuts.get(s.node_end - 1)
            label = c.describe() if c else f"after node {s.node_end - 1}"
            print(f"   stage {s.index} ends {label}; sends {s.send_bytes / 2**20:.2f} MiB per microbatch "
                  f"in {s.send_s * 1e6:.1f} us (predicted)")


if __name__ == "__main__":
    main()
