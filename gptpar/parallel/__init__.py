"""Data-parallel gradient synchronisation: naive, bucketed (ours, overlapped) and torch DDP."""

from gptpar.parallel.base import GradSync, broadcast_state
from gptpar.parallel.bucketed import BucketedSync
from gptpar.parallel.data_parallel import DDPSync, NaiveSync, average_gradients, make_grad_sync

__all__ = ["BucketedSync", "DDPSync", "GradSync", "NaiveSync", "average_gradients", "broadcast_state",
           "make_grad_sync"]
