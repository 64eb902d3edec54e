"""Wide-ResNet (bottleneck) as in Alpa's benchmark suite, 224x224 images, 1000 classes.

Alpa widens only the 3x3 convolution of each bottleneck: 1x1 conv to f, 3x3 conv to f*W,
1x1 conv to 4f, with f = C * 2**stage. With that the parameter counts match the suite's
names (wresnet-250m: 249M, wresnet-6.8b: 6.7B, wresnet-13b: 12.6B).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from planner.errors import InputError
from planner.models.config import require_positive

# ResNet-26 (two blocks a stage, as timm's resnet26) keeps tests small.
STAGE_BLOCKS = {26: (2, 2, 2, 2), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}


@dataclass(frozen=True)
class WResNetConfig:
    # The values a field may take, where only some are built (override_schema states them).
    choices: ClassVar[dict[str, tuple[int, ...]]] = {"layers": tuple(STAGE_BLOCKS)}

    layers: int
    channels: int
    width: int
    image_size: int = 224
    classes: int = 1000

    def validate(self, prefix: str = "config") -> None:
        if self.layers not in STAGE_BLOCKS:
            raise InputError(
                f"{prefix}.layers", f"{self.layers} is not supported", "one of 26, 50, 101, 152"
            )
        require_positive(prefix, channels=self.channels, width=self.width)
        require_positive(prefix, image_size=self.image_size, classes=self.classes)


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


def param_count(cfg: WResNetConfig) -> int:
    c = cfg.channels
    total = 3 * 49 * c + 2 * c  # stem conv + BN
    cin = c
    for stage, count in enumerate(STAGE_BLOCKS[cfg.layers]):
        f = c * 2**stage
        mid, out = f * cfg.width, 4 * f
        for i in range(count):
            total += cin * f + 9 * f * mid + mid * out + 2 * (f + mid + out)
            if (i == 0 and stage > 0) or cin != out:
                total += cin * out + 2 * out
            cin = out
    return total + cin * cfg.classes + cfg.classes


ZOO = {
    "wresnet-250m": WResNetConfig(layers=50, channels=160, width=2),
    "wresnet-500m": WResNetConfig(layers=50, channels=224, width=2),
    "wresnet-1b": WResNetConfig(layers=50, channels=320, width=2),
    "wresnet-2b": WResNetConfig(layers=50, channels=448, width=2),
    "wresnet-4b": WResNetConfig(layers=50, channels=640, width=2),
    "wresnet-6.8b": WResNetConfig(layers=50, channels=320, width=16),
    "wresnet-13b": WResNetConfig(layers=101, channels=320, width=16),
}
