"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's ``serving_tokenization``).

The tokenizer and chat template are the model card's, the same that generation uses, so the ids are
exactly what ``/v1/completions`` (a ``prompt``) or ``/v1/chat/completions`` (``messages``) would
enqueue; nothing reaches an engine. Shapes follow vLLM's OpenAI server (docs/api.md).
"""

from __future__ import annotations

from fastapi import Request
from redis.exceptions import RedisError

from gateway import errors, serving
from gateway.broker import Broker, LoadedCard
from gateway.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from gateway.serving_chat import request_chat_template, template_messages
from sluice.wire import limits
from sluice.wire.error_codes import Code

# /tokenize answers with a count, so it takes text longer than the model's context, but not without
# bound: tokenizing is the gateway's CPU. Past this many characters per token of the context, no
# text could be a prompt for the model, and counting it is refused before any work.
MAX_CHARS_PER_TOKEN = 16


def _check_size(text: str, card: LoadedCard, param: str) -> None:
    limit = card.max_model_len * MAX_CHARS_PER_TOKEN
    if len(text) > limit:
        raise errors.invalid(
            f"'{param}' is {len(text)} characters; /tokenize takes at most {limit} ({MAX_CHARS_PER_TOKEN} per "
            f"token of the model's {card.max_model_len}-token context): longer text could not be its prompt.",
            param=param, code=Code.INVALID_VALUE)


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
    tok = card.tokenizer
    if body.messages is not None:
        chat_template = request_chat_template(body.chat_template, serving.config_of(request))  # as chat does
        try:
            text = tok.apply_chat_template(
                template_messages(body.messages), add_generation_prompt=body.add_generation_prompt,
                tokenize=False, continue_final_message=body.continue_final_message, tools=body.tools,
                chat_template=chat_template, **(body.chat_template_kwargs or {}),
            )
        except (ValueError, TypeError) as exc:  # TypeError: chat_template_kwargs naming a parameter
            param = "chat_template" if chat_template is not None else "messages"
            raise errors.invalid(f"Invalid messages for the chat template: {exc}", param=param) from exc
        add_special = bool(body.add_special_tokens)  # default false: the template writes them
        _check_size(text, card, "messages")
    else:
        text = body.prompt or ""
        add_special = body.add_special_tokens is not False
        _check_size(text, card, "prompt")
    ids = list(await serving.encode(tok, text, add_special_tokens=add_special))
    return TokenizeResponse(count=len(ids), max_model_len=card.max_model_len, tokens=ids,
                            token_strs=tok.convert_ids_to_tokens(ids) if body.return_token_strs else None)


async def create_detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    card = await _card(serving.broker_of(request), body.model)
    serving.check(limits.check_token_ids("tokens", body.tokens, card.vocab_size))
    return DetokenizeResponse(prompt=card.tokenizer.decode(body.tokens))
