"""Joining the process group under torchrun: kept here for `from gradaccum.distributed import
...` as documented; the code is in `gradaccum.parallel.process_group`."""

from gradaccum.parallel.process_group import RankInfo, aligned_windows, init_distributed, teardown

__all__ = ["RankInfo", "aligned_windows", "init_distributed", "teardown"]
