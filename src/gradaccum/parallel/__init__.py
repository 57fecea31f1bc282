"""How the engine meets devices and other ranks.

- `devices`: the one place that knows device kinds (cuda, npu through torch_npu, xpu, mps, cpu):
  availability, autocast, memory, synchronisation;
- `sync`: the model's data-parallel wrapper found once (DDP, FSDP2, either inside
  torch.compile), its no-sync context, the small collectives of a window and the counting of
  gradient traffic;
- `process_group`: joining the process group under torchrun (backend from the device, timeouts,
  ranks' shares of a window) and leaving it.
"""
