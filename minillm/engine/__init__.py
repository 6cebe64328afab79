"""Serving many requests with one model: a paged KV pool with prefix caching, a scheduler with a per-step
token budget (chunked prefill), the model runner, the engine (online and whole runs)."""
from .block_manager import BlockManager, block_key, blocks_for
from .config import EngineConfig
from .engine import Engine, EngineLoad, Rejection, RunResult, StepRecord, StepResult
from .model_runner import ModelRunner
from .paged_cache import MixedStepView, PagedCacheView, PagedKVPool
from .request import Request, RequestRecord, Sequence, Status, StepOutput, TokenLogprob
from .scheduler import Scheduler

__all__ = ["BlockManager", "Engine", "EngineConfig", "EngineLoad", "MixedStepView", "ModelRunner", "PagedCacheView",
           "PagedKVPool", "Rejection", "Request", "RequestRecord", "RunResult", "Scheduler", "Sequence", "Status",
           "StepOutput", "StepRecord", "StepResult", "TokenLogprob", "block_key", "blocks_for"]
