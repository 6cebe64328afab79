"""Continuous batching on one model: requests, a paged KV pool, a scheduler, the engine loop."""
from .block_manager import BlockManager, blocks_for
from .engine import Engine, RunResult, StepRecord
from .paged_cache import PagedBatchCache, PagedKVPool
from .request import Request, RequestRecord
from .scheduler import POLICIES, Scheduler

__all__ = ["BlockManager", "Engine", "POLICIES", "PagedBatchCache", "PagedKVPool", "Request", "RequestRecord",
           "RunResult", "Scheduler", "StepRecord", "blocks_for"]
