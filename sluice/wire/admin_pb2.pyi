from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineStats(_message.Message):
    __slots__ = ("engine_id", "model", "running", "waiting", "free_blocks", "total_blocks", "preemptions", "generation_tokens_per_s", "prompt_tokens_per_s", "iterations", "finished_requests", "prefix_cache_hit_rate", "draining", "prompt_tokens_total", "generation_tokens_total", "live_requests", "preempted_waiting", "prefix_cache_queries", "prefix_cache_hits")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_WAITING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    model: str
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    preemptions: int
    generation_tokens_per_s: float
    prompt_tokens_per_s: float
    iterations: int
    finished_requests: int
    prefix_cache_hit_rate: float
    draining: bool
    prompt_tokens_total: int
    generation_tokens_total: int
    live_requests: int
    preempted_waiting: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    def __init__(self, engine_id: _Optional[str] = ..., model: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., preemptions: _Optional[int] = ..., generation_tokens_per_s: _Optional[float] = ..., prompt_tokens_per_s: _Optional[float] = ..., iterations: _Optional[int] = ..., finished_requests: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ..., draining: _Optional[bool] = ..., prompt_tokens_total: _Optional[int] = ..., generation_tokens_total: _Optional[int] = ..., live_requests: _Optional[int] = ..., preempted_waiting: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("grace_period_s",)
    GRACE_PERIOD_S_FIELD_NUMBER: _ClassVar[int]
    grace_period_s: float
    def __init__(self, grace_period_s: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("accepted", "running", "waiting")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    running: int
    waiting: int
    def __init__(self, accepted: _Optional[bool] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ...) -> None: ...
