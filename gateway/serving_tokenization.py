"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's ``serving_tokenization``).

The tokenizer and chat template are the model card's, the same that generation uses, so the ids are
exactly what ``/v1/completions`` (a ``prompt``) or ``/v1/chat/completions`` (``messages``) would
enqueue; nothing reaches an engine. Shapes follow vLLM's OpenAI server (docs/api.md).
"""

from __future__ import annotations

from fastapi import Request
from redis.exceptions import RedisError

from gateway import errors, preparation, serving
from gateway.broker import Broker, LoadedCard
from gateway.prompts import tokenize_prompt
from gateway.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from gateway.serving_chat import request_chat_template
from sluice.wire import limits
from sluice.wire.error_codes import Code


async def _card(broker: Broker, model: str | None) -> LoadedCard:
    """The card of ``model`` (as for generation: 404 unknown, 503 no live engine), or of the only
    model served when none is named (400 when several are)."""
    if model is None:
        try:
            live = await broker.live_engines()
            served = [name for name in await broker.model_names() if live.get(name)]
        except (RedisError, OSError) as exc:
            raise serving.redis_down(exc) from exc
        if len(served) != 1:
            choices = f": one of {', '.join(repr(s) for s in served)}" if served else ""
            raise errors.invalid(f"'model' is required when {len(served)} models are served{choices}.",
                                 param="model", code=Code.MISSING_REQUIRED_PARAMETER)
        model = served[0]
    return await serving.card_for(broker, model)


async def create_tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    card = await _card(serving.broker_of(request), body.model)
    chat_template = None
    if body.messages is not None:
        chat_template = request_chat_template(body.chat_template, serving.config_of(request))  # as chat does
    prompt = await preparation.run(request, card, tokenize_prompt, body, chat_template,
                                   size=preparation.body_size(request))
    ids = prompt.ids
    return TokenizeResponse(count=len(ids), max_model_len=card.max_model_len, tokens=ids,
                            token_strs=card.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None)


async def create_detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    card = await _card(serving.broker_of(request), body.model)
    serving.check(limits.check_token_ids("tokens", body.tokens, card.vocab_size))
    return DetokenizeResponse(prompt=card.tokenizer.decode(body.tokens))
