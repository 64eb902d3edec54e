"""Wide-ResNet (bottleneck) as in Alpa's benchmark suite, 224x224 images, 1000 classes.

Alpa widens only the 3x3 convolution of each bottleneck: 1x1 conv to f, 3x3 conv to f*W,
1x1 conv to 4f, with f = C * 2**stage. With that the parameter counts match the suite's
names (wresnet-250m: 249M, wresnet-6.8b: 6.7B, wresnet-13b: 12.6B).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from planner.models.configs.wresnet import STAGE_BLOCKS, ZOO, WResNetConfig, param_count  # noqa: F401 (re-exported)


class Bottleneck(nn.Module):
    def __init__(self, cin: int, f: int, width: int, stride: int):
        super().__init__()
        mid, out = f * width, 4 * f
        self.conv1 = nn.Conv2d(cin, f, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(f)
        self.conv2 = nn.Conv2d(f, mid, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.conv3 = nn.Conv2d(mid, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.shortcut = None
        if stride != 1 or cin != out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        skip = x if self.shortcut is None else self.shortcut(x)
        return F.relu(y + skip)


class WResNet(nn.Module):
    def __init__(self, cfg: WResNetConfig):
        super().__init__()
        self.config = cfg
        c = cfg.channels
        self.stem = nn.Sequential(
            nn.Conv2d(3, c, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(c), nn.ReLU()
        )
        blocks = []
        cin = c
        for stage, count in enumerate(STAGE_BLOCKS[cfg.layers]):
            f = c * 2**stage
            for i in range(count):
                stride = 2 if (i == 0 and stage > 0) else 1
                blocks.append(Bottleneck(cin, f, cfg.width, stride))
                cin = 4 * f
        self.blocks = nn.ModuleList(blocks)
        self.fc = nn.Linear(cin, cfg.classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(self.stem(images), 3, stride=2, padding=1)
        for block in self.blocks:
            x = block(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
