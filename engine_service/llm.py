"""The offline API, shaped like vLLM's: ``LLM(model=...)``, ``SamplingParams``, ``generate``, ``chat``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine_service.config import EngineConfig
from engine_service.core.outputs import CompletionOutput, RequestOutput
from engine_service.core.sampling_params import SamplingParams
from engine_service.engine import LLMEngine
from sluice.text.stream import TextStream
from sluice.text.tokenizer import Tokenizer

PromptInput = str | list[int] | dict


class LLM:
    """Run a model in this process. Engine knobs are keywords, as in vLLM (the names and defaults
    of ``engine_service.config.EngineConfig``, the same as ``sluice engine``'s flags)::

        llm = LLM()  # the embedded SmolLM2-135M-Instruct
        out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
        print(out[0].outputs[0].text)
    """

    def __init__(self, model: str | Path | None = None, **engine_args: Any) -> None:
        """``engine_args`` are ``EngineConfig``'s fields (``block_size``, ``kv_cache_memory``,
        ``max_num_seqs``, ``dtype``, ``enable_prefix_caching``, ...), with its defaults."""
        self.engine = LLMEngine(EngineConfig.from_kwargs(
            model=str(model) if model is not None else None, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    # ------------------------------------------------------------------ generate
    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in order. Prompts are strings, token-id lists, or
        ``{"prompt": str}`` / ``{"prompt_token_ids": [...]}`` dicts."""
        prompt_list = self._as_prompt_list(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompt_list)} prompts"
                )
        tokenizer = self.engine.tokenizer
        outputs: dict[str, RequestOutput] = {}
        order: list[str] = []
        try:
            for prompt, params in zip(prompt_list, params_list, strict=True):
                text, token_ids = self._tokenize(prompt)
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, token_ids, params)
                outputs[request_id] = RequestOutput(
                    request_id=request_id,
                    prompt=text,
                    prompt_token_ids=token_ids,
                    outputs=[CompletionOutput(index=i, text="", token_ids=[]) for i in range(params.n)],
                )
                order.append(request_id)
        except Exception:
            self.engine.abort_request(order)  # all or nothing: a refused prompt runs none of the batch
            raise
        params_by_id = dict(zip(order, params_list, strict=True))

        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(order), desc="generate", unit="req")
        streams = {
            (request_id, completion.index): _CompletionCollector(
                completion, outputs[request_id], params_by_id[request_id], tokenizer
            )
            for request_id in order
            for completion in outputs[request_id].outputs
        }
        while self.engine.has_unfinished_requests():
            deltas = self.engine.step()
            for delta in deltas:
                stream = streams[delta.request_id, delta.index]
                if stream.add(delta):
                    # A stop string matched: end that completion in the engine too.
                    deltas.extend(self.engine.abort_completion(delta.request_id, delta.index))
                result = outputs[delta.request_id]
                if not result.finished and all(c.finish_reason for c in result.outputs):
                    result.finished = True
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()
        for stream in streams.values():
            stream.close()
        return [outputs[i] for i in order]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = False) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        prompts = [
            {"prompt": tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
        if isinstance(prompts, str | dict):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]  # a single token-id list
        return prompts

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        tokenizer = self.engine.tokenizer
        if isinstance(prompt, str):
            return prompt, tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], tokenizer.encode(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise TypeError(f"a prompt is a string, a list of token ids or a dict, not {type(prompt).__name__}")


class _CompletionCollector:
    """Collects one completion's deltas; applies stop strings on its text as it grows (with
    ``sluice.text.stream.TextStream``, the gateway's detokenize + stop component)."""

    def __init__(self, completion: CompletionOutput, result: RequestOutput, params: SamplingParams,
                 tokenizer: Tokenizer) -> None:
        self.completion = completion
        self.result = result
        self.params = params
        self.tokenizer = tokenizer
        # Without stop strings the text is decoded once, at the end (close).
        self.stream: TextStream | None = None
        if params.stop:
            self.stream = TextStream(tokenizer, result.prompt_token_ids, stop=params.stop,
                                     include_stop_str_in_output=params.include_stop_str_in_output,
                                     skip_special_tokens=params.skip_special_tokens)

    def add(self, delta) -> bool:
        """Record an engine delta; return True when a stop string just ended this completion."""
        completion = self.completion
        if delta.metrics is not None and completion.index == 0:
            self.result.metrics = delta.metrics  # the first completion's timings stand for the request
        if completion.finish_reason is not None:
            return False  # already ended by a stop string; this is the engine's confirmation
        tokens, logprobs = delta.new_token_ids, delta.new_logprobs
        found = None
        if self.stream is not None:
            if len(tokens) > 1:
                # several tokens in one step (accepted speculative drafts): a stop string ends the
                # completion at the token that completes it, as when they come one by one
                for i, token in enumerate(tokens):
                    found = self.stream.add(token)
                    if found.stopped:
                        tokens, logprobs = tokens[: i + 1], logprobs[: i + 1] if logprobs else logprobs
                        break
            else:
                found = self.stream.add_many(tokens)
        completion.token_ids.extend(tokens)
        if logprobs:
            completion.logprobs = (completion.logprobs or []) + logprobs
        if delta.prompt_logprobs is not None:
            self.result.prompt_logprobs = delta.prompt_logprobs
        self.result.num_cached_tokens = max(self.result.num_cached_tokens, delta.num_cached_tokens)
        if found is not None:
            if not found.stopped and delta.finished:
                found = self.stream.finish()
            completion.text = self.stream.text
            if found.stopped:
                completion.finish_reason, completion.stop_reason = "stop", found.stop
                return not delta.finished  # still running in the engine: end it there too
        if delta.finished:
            completion.finish_reason = delta.finish_reason.value
            completion.stop_reason = delta.stop_reason
        return False

    def close(self) -> None:
        completion = self.completion
        if self.stream is None:
            completion.text = self.tokenizer.decode(
                completion.token_ids, skip_special_tokens=self.params.skip_special_tokens
            )
        if completion.logprobs is not None:
            completion.cumulative_logprob = sum(
                lp[tok].logprob for tok, lp in zip(completion.token_ids, completion.logprobs, strict=False)
            )
