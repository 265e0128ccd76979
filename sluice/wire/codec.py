"""Conversions between Python values and the wire messages, with no torch (or engine) import.

The gateway and the engine both use these, so the mapping of a ``SamplingParams``-like object to
the proto (and back to keyword arguments) is written once. The engine builds its own
``engine_service.core.sampling_params.SamplingParams(**sampling_kwargs_from_proto(msg))``, which
validates the values.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from sluice.structured import StructuredOutputsParams
from sluice.wire import contract, event_log
from sluice.wire.messages_pb2 import (
    Cancel,
    ChoiceList,
    Error,
    ErrorCode,
    Event,
    EventFrame,
    Finished,
    FinishReason,
    GenerateRequest,
    PositionLogprobs,
    RequestEvents,
    SamplingParams,
    StructuredOutputs,
    TokenLogprob,
    Usage,
)

# Scalar fields copied as they are, in both directions.
_OPTIONAL_SCALARS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "max_tokens",
    "logprobs",
    "prompt_logprobs",
)
_PLAIN_SCALARS = ("min_tokens", "ignore_eos")


def _get(params: Any, name: str, default: Any = None) -> Any:
    if isinstance(params, Mapping):
        return params.get(name, default)
    return getattr(params, name, default)


def sampling_params_to_proto(params: Any) -> SamplingParams:
    """From a ``SamplingParams`` dataclass (or any object / mapping with the same field names).

    Unset (``None``) values stay unset on the wire, so the receiver applies its defaults.
    Text-level fields (``stop`` strings, ``skip_special_tokens``) do not cross: the gateway
    applies them itself.
    """
    msg = SamplingParams()
    if params is None:
        return msg
    if isinstance(params, SamplingParams):
        msg.CopyFrom(params)
        return msg
    for name in _OPTIONAL_SCALARS:
        value = _get(params, name)
        if value is not None:
            setattr(msg, name, value)
    for name in _PLAIN_SCALARS:
        value = _get(params, name)
        if value is not None:
            setattr(msg, name, value)
    for token_id, bias in (_get(params, "logit_bias") or {}).items():
        msg.logit_bias[int(token_id)] = float(bias)
    msg.stop_token_ids.extend(int(t) for t in (_get(params, "stop_token_ids") or ()))
    structured = _get(params, "structured_outputs")
    if structured is not None:
        msg.structured_outputs.CopyFrom(structured_outputs_to_proto(structured))
    return msg


def structured_outputs_to_proto(value: Any) -> StructuredOutputs:
    """From a ``StructuredOutputsParams`` (or a dict with one of its keys)."""
    params = StructuredOutputsParams.from_dict(value) if isinstance(value, Mapping) else value
    kind = params.kind
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "choice":
        return StructuredOutputs(choice=ChoiceList(choices=list(params.choice)))
    return StructuredOutputs(**{kind: params.spec})


def structured_outputs_from_proto(msg: StructuredOutputs) -> StructuredOutputsParams | None:
    """``None`` when no kind is set; raises ``StructuredOutputError`` (a ValueError) when malformed."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "choice":
        return StructuredOutputsParams(choice=list(msg.choice.choices))
    return StructuredOutputsParams(**{kind: getattr(msg, kind)})


def sampling_kwargs_from_proto(msg: SamplingParams) -> dict[str, Any]:
    """Keyword arguments for ``SamplingParams(...)``: only the fields the sender set (plus
    ``max_tokens``, whose absence means "up to the context", i.e. ``None``)."""
    kwargs: dict[str, Any] = {}
    for name in _OPTIONAL_SCALARS:
        if msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    kwargs.setdefault("max_tokens", None)
    # proto floats are float32: round to what the sender most likely wrote (0.7, not 0.699999988).
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if name in kwargs:
            kwargs[name] = float(f"{kwargs[name]:.7g}")
    kwargs["min_tokens"] = msg.min_tokens
    kwargs["ignore_eos"] = msg.ignore_eos
    if msg.logit_bias:
        kwargs["logit_bias"] = {int(k): float(f"{v:.7g}") for k, v in msg.logit_bias.items()}
    if msg.stop_token_ids:
        kwargs["stop_token_ids"] = list(msg.stop_token_ids)
    if msg.HasField("structured_outputs"):
        structured = structured_outputs_from_proto(msg.structured_outputs)
        if structured is not None:
            kwargs["structured_outputs"] = structured
    return kwargs


def make_request(
    request_id: str,
    model: str,
    prompt_token_ids: Iterable[int],
    params: Any = None,
    *,
    deadline: float = 0.0,
    enqueue_time: float | None = None,
    attempt: int = 0,
    reply_to: str,
    gateway_id: str = "",
    log_events: bool = False,
    detached: bool = False,
    log_ttl_s: int = 0,
    tenant: str = "",
    tenant_weight: int = 0,
) -> GenerateRequest:
    """THE request builder: a ``GenerateRequest`` of this contract version. ``params`` is a wire
    ``SamplingParams``, or anything ``sampling_params_to_proto`` takes (the engine's
    ``SamplingParams``, a mapping of its field names). ``reply_to``: whose channel
    (``contract.events_channel``) the events go to. ``gateway_id``: the process whose liveness
    key (``contract.gateway_key``) engines watch for this request; empty: none. ``log_events``: the
    engine also appends its events to ``contract.log_key(request_id)`` (kept ``log_ttl_s`` after the
    end); ``detached``: never aborted because its gateway is gone (``sluice.wire.event_log``).
    ``tenant`` / ``tenant_weight``: who it is for and its fair share (``sluice.wire.tenants``)."""
    if not reply_to:
        raise ValueError("a request needs reply_to: the id whose events channel its answer goes to")
    return GenerateRequest(
        version=contract.CONTRACT_VERSION,
        request_id=request_id,
        model=model,
        prompt_token_ids=list(prompt_token_ids),
        params=sampling_params_to_proto(params),
        deadline=deadline,
        enqueue_time=time.time() if enqueue_time is None else enqueue_time,
        attempt=attempt,
        gateway_id=gateway_id,
        reply_to=reply_to,
        log_events=log_events,
        detached=detached,
        log_ttl_s=log_ttl_s,
        tenant=tenant,
        tenant_weight=tenant_weight,
    )


def encode_request(request: GenerateRequest) -> dict[bytes, bytes]:
    """The stream entry's fields for XADD."""
    return {contract.REQUEST_FIELD: request.SerializeToString()}


def position_logprobs(chosen: int | None, entries: Mapping[int, Any] | None) -> PositionLogprobs:
    """One position's logprobs: the chosen (or prompt) token first, then the rest by rank.

    ``entries`` maps token id to an object with ``logprob`` and ``rank`` (engine ``Logprob``) or
    to a float.
    """
    msg = PositionLogprobs()
    if not entries:
        return msg

    def add(token_id: int, value: Any) -> None:
        if isinstance(value, int | float):
            logprob, rank = float(value), 0
        else:
            logprob, rank = float(value.logprob), int(value.rank or 0)
        msg.entries.append(TokenLogprob(token_id=int(token_id), logprob=logprob, rank=rank))

    if chosen is not None and chosen in entries:
        add(chosen, entries[chosen])

    def rank_of(item: tuple[int, Any]) -> float:
        value = item[1]
        rank = None if isinstance(value, int | float) else value.rank
        return float(rank) if rank else float("inf")

    for token_id, value in sorted(entries.items(), key=rank_of):
        if token_id != chosen:
            add(token_id, value)
    return msg


# -- enums: the short names Python code and OpenAI use <-> the proto values --------------------

_ERROR_PREFIX, _FINISH_PREFIX = "ERROR_CODE_", "FINISH_REASON_"
_ERROR_BY_NAME = {n.removeprefix(_ERROR_PREFIX).lower(): v for n, v in ErrorCode.items() if v}
_FINISH_BY_NAME = {n.removeprefix(_FINISH_PREFIX).lower(): v for n, v in FinishReason.items() if v}


def error_code(code: int | str) -> int:
    """An ``ErrorCode`` value from a value or a short name (``"deadline_exceeded"``); an unknown
    name is ``internal``."""
    if isinstance(code, str):
        return _ERROR_BY_NAME.get(code, ErrorCode.ERROR_CODE_INTERNAL)
    return int(code)


def error_code_name(code: int) -> str:
    """``"deadline_exceeded"`` for ``ERROR_CODE_DEADLINE_EXCEEDED``; ``"unknown"`` for a value
    this side does not know."""
    try:
        return ErrorCode.Name(code).removeprefix(_ERROR_PREFIX).lower()
    except ValueError:
        return "unknown"


def finish_reason(reason: int | str) -> int:
    if isinstance(reason, str):
        try:
            return _FINISH_BY_NAME[reason]
        except KeyError:
            raise ValueError(f"unknown finish reason {reason!r}; known: {sorted(_FINISH_BY_NAME)}") from None
    return int(reason)


def finish_reason_name(reason: int) -> str | None:
    """``"stop"`` / ``"length"`` / ``"abort"``; None when unset or unknown."""
    try:
        return FinishReason.Name(reason).removeprefix(_FINISH_PREFIX).lower() if reason else None
    except ValueError:
        return None


# -- events ------------------------------------------------------------------------------------


def error_event(request_id: str, code: int | str, message: str, engine_id: str = "") -> Event:
    return Event(request_id=request_id, error=Error(code=error_code(code), message=message), engine_id=engine_id)


def finished_event(
    request_id: str,
    index: int,
    finish_reason_: int | str,
    *,
    stop_token_id: int | None = None,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    cached_tokens: int = 0,
    engine_id: str = "",
) -> Event:
    finished = Finished(
        finish_reason=finish_reason(finish_reason_),
        usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, cached_tokens=cached_tokens),
    )
    if stop_token_id is not None:
        finished.stop_token_id = stop_token_id
    return Event(request_id=request_id, index=index, finished=finished, engine_id=engine_id)


def is_terminal(event: Event) -> bool:
    return event.WhichOneof("terminal") is not None


def encode_cancel(request_ids: Iterable[str]) -> bytes:
    return Cancel(request_ids=list(request_ids)).SerializeToString()


def cancel_script_call(reply_to: str, request_ids: Iterable[str]) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of ``contract.CANCEL_SCRIPT`` for these requests of ``reply_to``."""
    keys: list[str] = []
    for request_id in request_ids:
        keys += [contract.cancelled_key(reply_to, request_id), contract.owner_key(reply_to, request_id)]
    return keys, [contract.CANCEL_MARKER_TTL_S]


def cancel_messages(request_ids: Iterable[str], owners: Iterable[Any]) -> dict[str, bytes]:
    """The Cancel to publish on each owner's channel (``contract.cancel_channel``), from the owners
    CANCEL_SCRIPT returned in the order of ``request_ids`` (an empty one: nobody holds it)."""
    by_owner: dict[str, list[str]] = {}
    for request_id, owner in zip(request_ids, owners, strict=True):
        owner = owner.decode() if isinstance(owner, bytes) else str(owner or "")
        if owner:
            by_owner.setdefault(owner, []).append(request_id)
    return {contract.cancel_channel(owner): encode_cancel(ids) for owner, ids in by_owner.items()}


def cancel(client: Any, reply_to: str, request_ids: Iterable[str]) -> dict[str, bytes]:
    """THE cancel (a sync client, standalone or cluster): ``contract.CANCEL_SCRIPT`` (the markers, in
    the reply_to's slot; a request still queued is dropped by whichever engine takes it), then one
    Cancel to each engine that holds some of them. Idempotent. Returns what was published."""
    ids = list(request_ids)
    if not ids:
        return {}
    keys, args = cancel_script_call(reply_to, ids)
    messages = cancel_messages(ids, client.register_script(contract.CANCEL_SCRIPT)(keys=keys, args=args))
    if messages:
        pipe = client.pipeline(transaction=False)
        for channel, payload in messages.items():
            pipe.spublish(channel, payload)
        pipe.execute()
    return messages


async def cancel_async(client: Any, reply_to: str, request_ids: Iterable[str], script: Any = None) -> dict[str, bytes]:
    """:func:`cancel` for an asyncio client (``script``: its registered CANCEL_SCRIPT, if kept)."""
    ids = list(request_ids)
    if not ids:
        return {}
    keys, args = cancel_script_call(reply_to, ids)
    script = script or client.register_script(contract.CANCEL_SCRIPT)
    messages = cancel_messages(ids, await script(keys=keys, args=args))
    if messages:
        pipe = client.pipeline(transaction=False)
        for channel, payload in messages.items():
            pipe.spublish(channel, payload)
        await pipe.execute()
    return messages


def encode_frame(engine_id: str, parts: Iterable[tuple[str, bytes]]) -> bytes:
    """One reply channel message (``EventFrame``): per request, its events of this publish as the
    bytes ``event_log.encode_entry`` made of them (the same bytes its log gets, when logged)."""
    frame = EventFrame(engine_id=engine_id)
    for request_id, events in parts:
        frame.requests.add(request_id=request_id, events=events)
    return frame.SerializeToString()


def encode_events(events: Iterable[Event], engine_id: str = "") -> bytes:
    """One reply channel message from events (each request's in order): :func:`encode_frame` of
    each request's ``event_log.encode_entry``."""
    by_request: dict[str, list[Event]] = {}
    for event in events:
        by_request.setdefault(event.request_id, []).append(event)
    return encode_frame(engine_id, ((rid, event_log.encode_entry(evs)) for rid, evs in by_request.items()))


def decode_frame(data: bytes) -> EventFrame:
    """A reply channel message (raises ``google.protobuf.message.DecodeError``); its parts decode
    with :func:`decode_part` (a reader decodes only the requests it waits for)."""
    return EventFrame.FromString(data)


def decode_part(part: RequestEvents, engine_id: str = "") -> list[Event]:
    """One request's events of a frame, their request (and engine) ids put back."""
    events = event_log.decode_entry(part.events, part.request_id)
    if engine_id:
        for event in events:
            event.engine_id = engine_id
    return events


def decode_events(data: bytes) -> list[Event]:
    """Every event of one reply channel message, request by request (raises
    ``google.protobuf.message.DecodeError``)."""
    frame = decode_frame(data)
    return [event for part in frame.requests for event in decode_part(part, frame.engine_id)]
