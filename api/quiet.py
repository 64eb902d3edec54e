"""Third-party log lines a user of autopar's commands cannot act on, kept out of their
output: torchao warns at import about optional kernels its wheel carries for another Python
(`Failed to load ..._C_mxfp8.cpython-310...so`) and registers enums with torch's pytree in a
way torch deprecates; transformers imports torchao whenever it is installed. Errors from the
same loggers still show."""

from __future__ import annotations

import logging

NOISY = ("torchao", "torch.utils._pytree")


def quiet_third_party_logs() -> None:
    for name in NOISY:
        logging.getLogger(name).setLevel(logging.ERROR)
