"""Wide-ResNet configurations as numbers, without torch: the config, the zoo (its sources:
planner/models/wresnet.py, which builds the module) and the closed-form parameter count."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

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
