"""How the engine meets devices and other ranks.

- `backends`: the model's data-parallel backend, found once from its wrapper
  (`data_parallel`): `SingleDevice`, `DDP`, or `FSDP2`, one small interface (`Backend`):
  the no-sync context, whether it averages over ranks, its group and world size, its
  accumulation dtype, traffic counting, unused parameters and unreduced gradients;
- `fsdp2`: the FSDP2 backend, the one module that reads FSDP2's internals;
- `collectives`: the small collectives of a window (its size agreed, loss and tokens summed,
  the largest of a flag) and the device they run on;
- `traffic`: counting the gradient collectives a wrapper launches (`GradTraffic`);
- `devices`: the one place that knows device kinds (cuda, npu through torch_npu, xpu, mps, cpu):
  availability, autocast, memory, synchronisation;
- `process_group`: joining the process group under torchrun (backend from the device, timeouts,
  ranks' shares of a window) and leaving it.
"""
