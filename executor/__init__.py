"""autopar executor: runs a Plan with torch.distributed (torchrun, DeviceMesh, DTensor, FSDP2)."""
