"""``POST /v1/completions``: the OpenAI request → engine requests, engine events → the response
or its stream chunks (vLLM's ``serving_completion``)."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import Response

from gateway import preparation, serving
from gateway.broker import LoadedCard
from gateway.generation import Delta, Generation, SubRequest, TokenInfo, position_info
from gateway.prompts import Prompt, completion_prompts
from gateway.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
)
from gateway.serving import envelope, finite, usage
from gateway.stream_chunks import ChunkTemplate
from sluice.wire import limits


async def create_completion(body: CompletionRequest, request: Request) -> Response:
    broker, cfg = serving.broker_of(request), serving.config_of(request)
    if (last_event_id := request.headers.get(serving.LAST_EVENT_ID)) is not None:
        return await resume_completion(request, last_event_id)
    arrival = time.time()
    card = await serving.card_for(broker, body.model)
    tok = card.tokenizer
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts_in: list = [prompt]
    elif prompt and all(isinstance(x, int) for x in prompt):
        prompts_in = [list(prompt)]
    else:
        prompts_in = list(prompt)
    if not prompts_in:
        serving.check(limits.invalid("prompt", limits.EMPTY_PROMPT))
    serving.check(limits.PROMPTS.check(prompts_in))
    for p in prompts_in:  # a token-id prompt longer than the context is refused before its ids are read
        if not isinstance(p, str):
            serving.check(limits.check_context(len(p), body.max_tokens, card.max_model_len))
    prepared = await preparation.run(request, card, completion_prompts, prompts_in, body.max_tokens,
                                     body.response_format, body.structured_outputs,
                                     size=preparation.size_of(request, body))
    prompts: list[list[int]] = []
    for p in prepared.prompts:
        ids = p.ids if isinstance(p, Prompt) else p
        serving.check_prompt(ids, card)
        prompts.append(list(ids))
    echo = bool(body.echo)
    # echo with max_tokens 0: the prompt alone, scored (vLLM's answer): the engine runs one token,
    # which the answer leaves out
    score_only = echo and body.max_tokens == 0
    max_tokens = serving.max_tokens_for(card, [len(ids) for ids in prompts], 1 if score_only else body.max_tokens,
                                        "prompt")
    params = serving.sampling_params(body, card, max_tokens, body.logprobs)
    await serving.constrain(params, prepared.constraint, card, max_tokens, serving.constraint_param(body.response_format))
    if echo and body.logprobs is not None:
        params.prompt_logprobs = body.logprobs
    opts = {"stop": serving.stop_strings(body), "include_stop_str": body.include_stop_str_in_output,
            "skip_special_tokens": body.skip_special_tokens, "logprobs": body.logprobs}
    render = {"body": body.model_dump(mode="json", exclude_unset=True, exclude={"prompt"}), "opts": opts,
              "n": params.n or 1, "whole_prompt": echo}
    gen = Generation(broker, card, prompts, params, opts, deadline=arrival + cfg.request_timeout_s,
                     endpoint="completions", id_prefix="cmpl",
                     log_ttl_s=cfg.event_log_ttl_s if body.stream and cfg.resumable_streams else None,
                     render=render, principal=serving.principal_of(request))
    await serving.start(gen, request, body.model)
    echo_text = {s.request_id: tok.decode(s.prompt_ids, skip_special_tokens=False) for s in gen.subs} if echo else {}
    return await serving.respond(
        request, gen,
        stream=CompletionStreamFormatter(gen, card, body, echo_text) if body.stream else None,
        build=lambda: completion_response(gen, card, body, echo_text),
    )


async def resume_completion(request: Request, last_event_id: str) -> Response:
    """A client resuming a completion stream (any gateway): the chunks after its Last-Event-ID,
    rendered from the request's record and event log."""
    broker = serving.broker_of(request)
    record, after = await serving.resumable_record(broker, last_event_id, "completions",
                                                   serving.principal_of(request))
    render = record.render
    body = CompletionRequest.model_validate({**render["body"], "prompt": ""})

    def formatter(gen: Generation, card: LoadedCard) -> CompletionStreamFormatter:
        echo_text = ({s.request_id: card.tokenizer.decode(s.prompt_ids, skip_special_tokens=False)
                      for s in gen.subs} if body.echo else {})
        return CompletionStreamFormatter(gen, card, body, echo_text)

    return await serving.resume(request, broker, record, after, formatter, render["opts"], render["n"])


class LogprobsBuilder:
    """OpenAI's completions logprobs: tokens, token_logprobs, top_logprobs, text_offset; the
    offsets continue across the chunks of a stream."""

    def __init__(self, start_offset: int = 0) -> None:
        self.offset = start_offset

    def build(self, infos: list[TokenInfo], first_is_none: bool = False) -> CompletionLogProbs:
        out = CompletionLogProbs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for i, info in enumerate(infos):
            out.tokens.append(info.text)
            none = first_is_none and i == 0
            out.token_logprobs.append(None if none or info.logprob is None else finite(info.logprob))
            if none or info.logprob is None:
                out.top_logprobs.append(None)
            else:
                top = {info.text: finite(info.logprob)}
                for t, lp, _ in info.top:
                    top.setdefault(t, finite(lp))
                out.top_logprobs.append(top)
            out.text_offset.append(self.offset)
            self.offset += len(info.text)
        return out


def _prompt_infos(sub: SubRequest, card: LoadedCard, num_top: int) -> list[TokenInfo]:
    infos = []
    for i, tid in enumerate(sub.prompt_ids):
        pos = sub.prompt_logprobs[i] if i < len(sub.prompt_logprobs) else None
        infos.append(position_info(card.tokenizer, tid, pos, num_top))
    return infos


def score_only(body: CompletionRequest) -> bool:
    """``echo`` with ``max_tokens`` 0: the prompt and its logprobs, without the token the engine ran."""
    return bool(body.echo) and body.max_tokens == 0


def completion_response(gen: Generation, card: LoadedCard, body: CompletionRequest,
                        echo_text: dict) -> CompletionResponse:
    choices = []
    for c in gen.choices:
        prefix = echo_text.get(c.sub.request_id, "")
        text, generated = ("", []) if score_only(body) else (c.text, c.logprobs)
        lp = None
        if body.logprobs is not None:
            infos = _prompt_infos(c.sub, card, body.logprobs) + generated if prefix else generated
            lp = LogprobsBuilder().build(infos, first_is_none=bool(prefix))
        choices.append(CompletionResponseChoice(index=c.index, text=prefix + text, logprobs=lp,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    return envelope(CompletionResponse, gen, choices=choices, usage=usage(gen))


class CompletionStreamFormatter:
    def __init__(self, gen: Generation, card: LoadedCard, body: CompletionRequest, echo_text: dict) -> None:
        self.gen, self.card, self.body, self.echo_text = gen, card, body, echo_text
        self.score_only = score_only(body)
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.builders: dict[int, LogprobsBuilder] = {}
        self.echoed: set[int] = set()
        # the plain chunks (no logprobs) from a template: gateway.stream_chunks
        self.template = ChunkTemplate(gen.id, CompletionStreamResponse.model_fields["object"].default, gen.created,
                                      gen.card.name, self.include_usage) if body.logprobs is None else None

    def _chunk(self, choice: CompletionResponseChoice) -> CompletionStreamResponse:
        if self.include_usage:
            return envelope(CompletionStreamResponse, self.gen, choices=[choice], usage=None)
        return envelope(CompletionStreamResponse, self.gen, choices=[choice])

    def start(self) -> list[CompletionStreamResponse]:
        return []

    def on_delta(self, d: Delta) -> list[CompletionStreamResponse | str]:
        if self.score_only:  # the prompt alone: the engine's token is left out
            d = Delta(d.index, "", None, d.finish_reason, d.stop_reason)
        if self.template is not None and d.index in self.echoed:
            return self._plain(d)
        choice = self.gen.choices[d.index]
        prefix = ""
        infos: list[TokenInfo] | None = d.logprobs
        first_is_none = False
        if d.index not in self.echoed:
            self.echoed.add(d.index)
            prefix = self.echo_text.get(choice.sub.request_id, "")
            if prefix and self.body.logprobs is not None:
                infos = _prompt_infos(choice.sub, self.card, self.body.logprobs) + (infos or [])
                first_is_none = True
        lp = None
        if self.body.logprobs is not None:
            builder = self.builders.setdefault(d.index, LogprobsBuilder())
            lp = builder.build(infos or [], first_is_none=first_is_none)
        out = []
        text = prefix + d.text
        if text or lp and lp.tokens or not d.finish_reason:
            out.append(self._chunk(CompletionResponseChoice(index=d.index, text=text, logprobs=lp,
                                                            finish_reason=None, stop_reason=None)))
        if d.finish_reason:
            out.append(self._chunk(CompletionResponseChoice(index=d.index, text="", logprobs=None,
                                                            finish_reason=d.finish_reason,
                                                            stop_reason=d.stop_reason)))
        return out

    def _plain(self, d: Delta) -> list[str]:
        """``on_delta`` of a choice without logprobs, past its first delta (the echo)."""
        out = []
        if d.text or not d.finish_reason:
            out.append(self.template.completion_text(d.index, d.text))
        if d.finish_reason:
            out.append(self.template.completion_finish(d.index, d.finish_reason, d.stop_reason))
        return out

    def end(self) -> list[CompletionStreamResponse]:
        if not self.include_usage:
            return []
        return [envelope(CompletionStreamResponse, self.gen, choices=[], usage=usage(self.gen))]
