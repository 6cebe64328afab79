"""Serving many requests with one model: requests, a paged KV pool with prefix caching, a scheduler
with a per-step token budget (chunked prefill), the model runner, the engine (online and whole runs)."""
from .block_manager import BlockManager, block_key, blocks_for
from .config import EngineConfig
from .engine import Engine, EngineLoad, RunResult, StepRecord
from .model_runner import ModelRunner
from .paged_cache import MixedStepView, PagedCacheView, PagedKVPool
from .request import Request, RequestRecord, Sequence, Status, StepOutput, TokenLogprob
from .scheduler import POLICIES, Scheduler

__all__ = ["BlockManager", "Engine", "EngineConfig", "EngineLoad", "MixedStepView", "ModelRunner", "POLICIES",
           "PagedCacheView", "PagedKVPool", "Request", "RequestRecord", "RunResult", "Scheduler", "Sequence",
           "Status", "StepOutput", "StepRecord", "TokenLogprob", "block_key", "blocks_for"]
