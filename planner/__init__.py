"""autopar planner: everything that decides how to split training (no torch.distributed, no web)."""

__version__ = "0.1.0"
