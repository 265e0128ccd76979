"""LLMEngine: one step loop over the scheduler, the model runner and the sampler.

The engine speaks token ids. ``add_request`` takes a prompt and sampling parameters (n > 1 is
expanded into n sequences that share the prompt's KV blocks through the prefix cache);
``step`` runs one scheduled batch and returns each request's news as ``EngineOutput``s. The
offline ``LLM`` and the Redis service both drive it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine_service.config import (
    ATTENTION_BACKENDS,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
    check_num_scheduler_steps,
)
from engine_service.core.fair_share import FairView
from engine_service.core.outputs import EngineOutput, RequestMetrics
from engine_service.core.request import Request
from engine_service.core.sampling_params import SamplingParams
from engine_service.core.scheduler import RequestRejected, Scheduler
from engine_service.model.config import ModelConfig
from engine_service.model.decode_paths import choose_decode_path
from engine_service.model.determinism import determinism_costly, determinism_unavailable, make_deterministic
from engine_service.model.dtype import resolve_auto_dtype
from engine_service.model.gguf_model import gguf_source
from engine_service.model.kv_cache import allocate_kv_cache, kv_cache_dtype, num_blocks_for_budget
from engine_service.model.loader import load_model, parse_dtype
from engine_service.model.native import load_paged_decode_attention, paged_decode_attention_kernel
from engine_service.model.quantization import parse_quantization
from engine_service.model.runner import ModelRunner
from engine_service.sampling.grammar import GrammarManager
from engine_service.sampling.sampler import Sampler, compute_logprobs
from engine_service.sampling.speculative import expand_rows, num_accepted
from sluice.text.tokenizer import Tokenizer
from sluice.wire import limits
from sluice.wire.card import sampling_defaults
from sluice.wire.error_codes import Code
from sluice.wire.stats import EngineStats

logger = logging.getLogger(__name__)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_model_dir(model: str | Path | None) -> Path:
    """``None`` means the embedded default model, prepared on first use."""
    if model is None:
        from engine_service.model.prepare import prepare_default_model

        return prepare_default_model(progress=False)
    path = Path(model).expanduser()
    if path.is_file():
        from engine_service.model.gguf_model import is_gguf, metadata_dir

        if not is_gguf(path):
            raise FileNotFoundError(f"--model {model!r} is a file but not a GGUF file (no GGUF magic)")
        return metadata_dir(path)  # the file's configuration and tokenizer; the weights stay in it
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"--model {model!r} is neither a GGUF file nor a local Hugging Face directory (no config.json); "
            "Sluice loads models from disk only"
        )
    return path


@dataclass
class _Group:
    """The n sequences of one request."""

    request_id: str
    children: list[Request]
    num_live: int


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.stub_model = config.stub_model
        if self.stub_model:  # a benchmark's engine only (engine_service.model.stub)
            from engine_service.model.stub import check_bench_mode

            check_bench_mode()
        # before the model loads (its threads start there, at the thread count the engine will
        # run), undone if the engine fails
        undo = self._place_on_cpus(config.cpus)
        try:
            self._build(config)
        except BaseException:
            if undo is not None:
                try:
                    undo()
                except Exception:  # the engine's own error is the one to see
                    logger.exception("could not put the process back on its CPUs")
            raise

    @staticmethod
    def _place_on_cpus(cpus_text: str | None):
        """Every thread of this process on the CPU list, torch's compute threads one per physical
        core of it (sluice.cpu_placement); returns what puts the process back, or None."""
        if cpus_text is None:
            return None
        from sluice.cpu_placement import check_cpus, format_cpu_list, physical_cores, pin_process, usable_cpus

        cpus = check_cpus(cpus_text, "cpus")
        home, threads = usable_cpus(), torch.get_num_threads()
        pin_process(cpus)
        cores = len(physical_cores(cpus))
        torch.set_num_threads(cores)
        logger.info("pinned to CPUs %s, compute threads: %d (one a physical core)", format_cpu_list(cpus), cores)

        def undo() -> None:
            torch.set_num_threads(threads)
            pin_process(home)

        return undo

    def _build(self, config: EngineConfig) -> None:
        self.model_dir = resolve_model_dir(config.model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.model_name = config.served_model_name or self.model_dir.name + ("-stub" if self.stub_model else "")
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.device = torch.device(config.device)
        # what the start-up line says of each choice the engine made, and why (describe_choices)
        self.choices: dict[str, str] = {}
        self.quantization = parse_quantization(config.quantization)
        self.gguf = gguf = gguf_source(self.model_dir)  # the GGUF file served as it is, if that is the model
        if gguf is not None and self.quantization is not None:
            raise ValueError(f"--model {gguf.name} is a GGUF file, served with its own quantization: "
                             f"--quantization {self.quantization} cannot be combined with it")
        dtype = config.resolved_dtype()
        if dtype == "auto" and self.stub_model:
            self.dtype, why = torch.float32, "auto: the stub model has no weights"
        elif dtype == "auto":
            self.dtype, why = resolve_auto_dtype(self.device, self.model_dir, self.quantization)
            why = f"auto: {why}"
        else:
            self.dtype = parse_dtype(dtype)
            why = "asked for" if config.dtype else "$SLUICE_DTYPE"
        self.choices["dtype"] = f"{_name(self.dtype)} ({why})"
        self.kv_cache_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.choices["kv cache"] = (f"{_name(self.kv_cache_dtype)} "
                                    f"({'auto: the model dtype' if config.kv_cache_dtype == 'auto' else 'asked for'})")
        self.choices["quantization"] = self.quantization or ("the GGUF file's blocks, as they are" if gguf else "none")
        self.enforce_eager = config.resolved_enforce_eager() or self.stub_model
        if config.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"not {config.attention_backend!r}")

        context = self.model_config.context_length
        if config.max_model_len is not None and config.max_model_len > context:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context length {context}")
        self.max_model_len = config.max_model_len or context
        # refused before the model loads, naming the knob
        self.speculative_config = SpeculativeConfig.parse(config.speculative_config)
        if self.speculative_config is not None:
            self.speculative_config.check(config.max_num_batched_tokens)
            logger.info("speculative decoding: %s", self.speculative_config.as_dict())
        check_num_scheduler_steps(config.num_scheduler_steps, self.speculative_config is not None)

        started = time.perf_counter()
        num_blocks = config.num_blocks or num_blocks_for_budget(
            self.model_config, config.block_size, self.kv_cache_dtype, self.device, config.kv_cache_memory
        )
        if self.stub_model:
            from engine_service.model.stub import StubModel, stub_kv_cache

            model = StubModel.for_tokenizer(self.model_config.vocab_size, self.tokenizer)
            kv = stub_kv_cache(num_blocks + 1)
            decode_kernel = self._decode_kernel("torch")
        else:
            model = load_model(self.model_dir, self.dtype, self.device, self.quantization)
            # One block more than the scheduler hands out: the compiled step's warm-up writes there.
            kv = allocate_kv_cache(self.model_config, num_blocks + 1, config.block_size, self.kv_cache_dtype,
                                   self.device)
            decode_kernel = self._decode_kernel(config.attention_backend)
        self.deterministic = self._resolve_determinism(config, model)
        if self.deterministic:  # (the stub model never is)
            changed = make_deterministic(model)
            logger.info("deterministic: %d products compute each row as it computes it alone", changed)
            decode_kernel = self._kernel.exact_op  # no AMX scores for a chunk's rows together
        self.runner = ModelRunner(model, kv, config.block_size, self.device, decode_kernel=decode_kernel)
        self.runner.every_row_decodes = self.deterministic
        logger.info("loaded %s (%s%s, %s) with %d KV blocks of %d tokens (%s) in %.1fs", self.model_name,
                    self.dtype, f", {self.quantization}" if self.quantization else "", self.device, num_blocks,
                    config.block_size, self.kv_cache_dtype, time.perf_counter() - started)
        # the decode path, chosen once (engine_service.model.decode_paths); eager asked for is the
        # reference: no native step either (CPU's default eager keeps it)
        choice = choose_decode_path(self.runner.path_setup(
            scratch_slot=num_blocks * config.block_size, max_batch=config.max_num_seqs, max_model_len=self.max_model_len,
            attention_backend=self.attention_backend, reference=config.eager_asked() is True or self.stub_model,
            compile=not self.enforce_eager, cuda_graphs=config.cuda_graphs, native_decode=config.native_decode,
            num_scheduler_steps=config.num_scheduler_steps, deterministic=self.deterministic))
        self.runner.use(choice.path)
        self.decode_path = choice.path
        for name, why in choice.passed_over.items():
            logger.log(logging.WARNING if name in choice.asked else logging.INFO, "decode path %s: not used (%s)",
                       name, why)
        compiled = self.path_named("compiled")
        self.compile_warmup_seconds = compiled.warmup_seconds if compiled is not None else None
        self.enforce_eager = compiled is None and not self.cuda_graphs
        self.native_decode = self.path_named("native step") is not None
        self.choices["decode path"] = self.decode_path.describe()
        capabilities = self.decode_path.capabilities()
        if self.speculative_config is not None and self.speculative_config.backoff == "auto":
            self.speculative_config = self._resolve_backoff(self.speculative_config, capabilities)
        if config.num_scheduler_steps > 1:
            if capabilities.multi_step_max_rows:
                logger.info("up to %d greedy decode steps a step, in batches of up to %d rows",
                            config.num_scheduler_steps, capabilities.multi_step_max_rows - 1)
            else:
                logger.warning("--num-scheduler-steps %d runs as 1: it needs the native decode step with its output "
                               "projection (%s)", config.num_scheduler_steps,
                               "not this model's" if self.native_decode else "none here")
        self.scheduler = Scheduler(SchedulerConfig(
            num_blocks=num_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            watermark_blocks=config.watermark_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            speculative_config=self.speculative_config,
            num_scheduler_steps=config.num_scheduler_steps,
            decode=capabilities,
        ))
        self.vocab_size = self.model_config.vocab_size
        self.sampler = Sampler(self.vocab_size, self.device, seed=config.seed)
        eos = set(self.model_config.eos_token_ids) | set(self.tokenizer.eos_token_ids)
        self.eos_token_ids: list[int] = sorted(eos)
        self._eos = frozenset(eos)
        self.grammars = GrammarManager(self.tokenizer.backend.to_str(), self.vocab_size, self.eos_token_ids,
                                       max_model_len=self.max_model_len)
        self._groups: dict[str, _Group] = {}
        self._child_index: dict[str, tuple[_Group, int]] = {}
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._finished_requests = 0
        # What a request leaves unset (temperature, top_p, top_k, min_p, repetition_penalty) takes
        # the model's generation_config.json value with --generation-config auto (vLLM's default).
        self.sampling_defaults: dict[str, float | int] = (
            sampling_defaults(self.tokenizer.generation_config) if config.generation_config == "auto" else {}
        )
        if self.sampling_defaults:
            logger.info("sampling defaults from generation_config.json: %s", self.sampling_defaults)
        # the last step's batch: sequences scheduled and tokens forwarded (for the step metrics)
        self.last_batch: tuple[int, int] = (0, 0)
        self.choices["threads"] = (f"{torch.get_num_threads()} ("
                                   + ("one a physical core of --cpus" if config.cpus is not None
                                      else "torch's default for this process's CPUs") + ")")
        if self.speculative_config is not None:
            self.choices["speculative back-off"] = self.speculative_config.backoff
        logger.info("engine: %s", self.describe_choices())

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, *, tenant: str = "", tenant_weight: int = 1) -> None:
        """Admit a request past the door, or raise ``RequestRejected`` / ``ValueError`` saying why.
        ``tenant`` / ``tenant_weight``: who it is for and its fair share (``sluice.wire.tenants``,
        ``engine_service.core.fair_share``); every sequence of it counts for the tenant."""
        if request_id in self._groups:
            raise RequestRejected(Code.INVALID_REQUEST, f"request id {request_id!r} is already running")
        problem = limits.check_prompt(prompt_token_ids, self.vocab_size)
        if problem is not None:
            raise RequestRejected(problem.code, problem.message)
        params.verify(self.vocab_size)
        if params.structured_outputs is not None:
            # compiled against the vocabulary (cached) and walked to its shortest completion, which
            # must fit in max_tokens and the context: a constraint from the queue is re-checked
            budget = self.max_model_len - len(prompt_token_ids)
            if params.max_tokens is not None:
                budget = min(budget, params.max_tokens)
            try:
                self.grammars.check(params.structured_outputs, budget)
            except ValueError as exc:
                raise RequestRejected(Code.INVALID_REQUEST, str(exc)) from None
        params = params.with_model_defaults(self.sampling_defaults)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = []
        for i in range(params.n):
            if params.n == 1:
                child_id, child_params = request_id, params
            else:
                child_id, child_params = f"{request_id}#{i}", params.for_child(i)
            children.append(Request(child_id, list(prompt_token_ids), child_params, self._eos, arrival,
                                    tenant=tenant, tenant_weight=tenant_weight))
        admitted: list[Request] = []
        try:
            for child in children:
                self.scheduler.add_request(child)
                admitted.append(child)
        except RequestRejected:
            if admitted:
                self.scheduler.abort_requests([c.request_id for c in admitted])
            raise
        group = _Group(request_id, children, len(children))
        self._groups[request_id] = group
        for i, child in enumerate(children):
            self._child_index[child.request_id] = (group, i)
            self.grammars.add(child)  # one matcher per sequence

    def abort_request(self, request_ids: Iterable[str]) -> list[EngineOutput]:
        """Abort requests wherever they are; returns a terminal output per live completion."""
        outputs = []
        for request_id in request_ids:
            group = self._groups.get(request_id)
            if group is None:
                continue
            live = [c.request_id for c in group.children if not c.is_finished]
            for req in self.scheduler.abort_requests(live):
                outputs.append(self._output(req, []))
                self._release(req)
        return outputs

    def abort_completion(self, request_id: str, index: int) -> list[EngineOutput]:
        """Abort one of a request's n completions (a stop string matched in its text)."""
        group = self._groups.get(request_id)
        if group is None or not 0 <= index < len(group.children):
            return []
        child = group.children[index]
        outputs = []
        for req in self.scheduler.abort_requests([child.request_id]):
            outputs.append(self._output(req, []))
            self._release(req)
        return outputs

    def describe_choices(self) -> str:
        """One line of what the engine chose at start and why: dtype, quantization, KV cache, decode
        path, attention, threads (and the speculative back-off)."""
        return ", ".join(f"{key}={value}" for key, value in self.choices.items())

    def path_named(self, name: str):
        """The engine's decode path of that name, or the one it was built over; None if neither."""
        path = self.decode_path
        while path is not None and path.name != name:
            path = path.fallback
        return path

    @property
    def cuda_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs (``engine_service.model.cuda_graphs``)."""
        return self.path_named("cuda graphs") is not None

    @property
    def decode_mode(self) -> str:
        """How decode steps run: "cuda graphs", "native step", "compiled" or "eager" (what benches
        print): the decode path's name. A native step takes the steps of up to its row count; larger
        ones run compiled, or eagerly in an eager engine (CPU's default)."""
        return self.decode_path.name

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def fair_view(self) -> FairView:
        """The scheduler's fair share between tenants (``engine_service.core.fair_share``)."""
        return self.scheduler.fair_view()

    def admission_headroom(self) -> int:
        """How many new requests this engine could start soon: free sequence slots, but none when
        the waiting queue already holds work or the KV pool is exhausted."""
        sched = self.scheduler
        if sched.num_waiting > 0 or sched.block_pool.num_free_blocks <= sched.watermark_blocks:
            return 0
        return max(0, self.config.max_num_seqs - sched.num_running)

    # ------------------------------------------------------------------ the step
    def _decode_kernel(self, backend: str):
        """The native decode attention for ``backend`` (auto / native / torch), or None for torch's."""
        self.attention_backend = "torch"
        self._kernel = None
        if backend == "torch":
            self.choices["attention"] = "torch (asked for: the reference)"
            return None
        if backend == "native":
            if self.device.type != "cpu":
                raise ValueError(f"attention_backend native runs on CPU only, not on {self.device}")
            kernel = load_paged_decode_attention()  # raises NativeKernelError saying why it cannot
        else:
            kernel = paged_decode_attention_kernel(self.device)
        cfg = self.model_config
        if kernel is not None and not kernel.supports(self.kv_cache_dtype, cfg.num_attention_heads,
                                                      cfg.num_key_value_heads, cfg.head_dim):
            if backend == "native":
                raise ValueError(f"attention_backend native has no kernel for a {self.kv_cache_dtype} KV cache of "
                                 f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} heads of size {cfg.head_dim}")
            logger.info("the native decode attention does not run this model's cache; using the torch path")
            kernel = None
        self._kernel = kernel
        self.attention_backend = "native" if kernel is not None else "torch"
        self.choices["attention"] = (("native (asked for)" if backend == "native" else "native (auto: the kernel builds here)")
                                     if kernel is not None else
                                     "torch (auto: no native kernel for this device, build or cache)")
        logger.info("decode attention: %s", self.attention_backend)
        # the operator itself: the model was checked above, and the forward calls it once per layer
        return kernel.op if kernel is not None else None

    def _resolve_determinism(self, config: EngineConfig, model) -> bool:
        """The deterministic knob made on or off (its start-up line said why); raises ValueError
        naming the knobs where it was asked for and cannot be kept."""
        if config.deterministic is False:
            self.choices["deterministic"] = "off (asked for)"
            return False
        why = ("the stub model (a bench's)" if self.stub_model else
               determinism_unavailable(model, self.device, self.attention_backend, config.eager_asked() is False))
        if why is not None and config.deterministic:
            raise ValueError(f"deterministic: this engine cannot keep a request's tokens independent of its batch: "
                             f"{why}. Drop --deterministic, or change what it names")
        if why is not None:
            self.choices["deterministic"] = f"off ({why})"
            logger.warning("not deterministic: %s (docs/determinism.md)", why)
            return False
        costly = None if config.deterministic else determinism_costly(model)
        if costly is not None:  # left unset: on only where it costs next to nothing
            self.choices["deterministic"] = f"off (auto: {costly}; --deterministic turns it on)"
            logger.warning("not deterministic: %s; --deterministic turns it on (docs/determinism.md)", costly)
            return False
        self.choices["deterministic"] = "on" + (" (asked for)" if config.deterministic else " (auto)")
        return True

    @staticmethod
    def _resolve_backoff(spec: SpeculativeConfig, capabilities) -> SpeculativeConfig:
        """``backoff: "auto"`` made on or off from the decode path's capabilities: off where its fast
        step takes a verifying step's k + 1 rows at about one row's cost (``one_pass_rows``), on
        otherwise. A fact of the path and the CPU, the same at every start."""
        rows = spec.num_speculative_tokens + 1
        cheap = rows <= capabilities.one_pass_rows and rows < capabilities.fast_step_max_rows
        backoff = "off" if cheap else "on"
        logger.info("speculative decoding: back-off %s (auto: the %s path takes %d rows %s)", backoff,
                    capabilities.path, rows, "at about one row's cost" if cheap else
                    f"at more than one row's cost (up to {capabilities.one_pass_rows} at one row's)")
        return dataclasses.replace(spec, backoff=backoff)

    def step(self) -> list[EngineOutput]:
        scheduled = self.scheduler.schedule()
        self.last_batch = (len(scheduled.chunks), scheduled.num_batched_tokens + scheduled.num_step_tokens)
        if not scheduled.chunks:
            return []
        result = self.runner.execute(scheduled.chunks)
        for item in result.prompt_logits:
            req = item.request
            if not req.prompt_logprobs:
                req.prompt_logprobs.append(None)  # the first prompt token has no logprob
            if len(req.prompt_logprobs) == item.first_position:  # skip positions already scored
                req.prompt_logprobs.extend(
                    compute_logprobs(item.logits, item.target_ids, req.sampling_params.prompt_logprobs)
                )
        sampled: dict[str, int] = {}
        new_logprobs: dict[str, dict] = {}
        # several tokens a request this step (verified drafts, multi-step tokens): outputs before, logprobs per token
        drafted: dict[str, tuple[int, list]] = {}
        if result.step_token_ids is not None:
            for req, tokens in zip(result.sample_requests, result.step_token_ids, strict=True):
                sampled[req.request_id] = tokens
                drafted[req.request_id] = (req.num_output_tokens, [])
        elif result.sample_counts is not None:
            self._verify(scheduled, result, sampled, new_logprobs, drafted)
        elif result.sample_requests:
            # grammar bitmasks on the constrained rows only, before any sampling stage
            masked = self.grammars.apply_bitmask(result.sample_logits, result.sample_requests)
            out = self.sampler(result.sample_logits, result.sample_requests,
                               argmax=None if masked else result.greedy_token_ids)
            for row, (req, token, lp) in enumerate(zip(result.sample_requests, out.token_ids, out.logprobs,
                                                       strict=True)):
                kept = self.grammars.accept(req, token)  # the token budget may replace it
                if kept != token and lp is not None:
                    lp = compute_logprobs(result.sample_logits[row : row + 1], [kept],
                                          req.sampling_params.logprobs)[0]
                sampled[req.request_id] = kept
                if lp is not None:
                    new_logprobs[req.request_id] = lp
        self._prompt_tokens_total += sum(
            min(c.num_tokens, max(0, c.request.num_prompt_tokens - c.start)) for c in scheduled.chunks
        )
        self._generation_tokens_total += len(sampled)
        outputs = []
        for req in self.scheduler.update_from_output(scheduled, sampled):
            if drafted and req.request_id in drafted:
                before, lps = drafted[req.request_id]
                new_tokens = req.output_token_ids[before:]  # the stopping rules may end it early
                self._generation_tokens_total += len(new_tokens) - 1
                lps = lps[: len(new_tokens)] if lps else None
                if lps:
                    req.logprobs.extend(lps)
                    req.cumulative_logprob += sum(d[t].logprob for d, t in zip(lps, new_tokens, strict=True))
                outputs.append(self._output(req, new_tokens, lps))
                if req.is_finished:
                    self._release(req)
                continue
            new_tokens = [sampled[req.request_id]] if req.request_id in sampled else []
            lp = new_logprobs.get(req.request_id)
            if lp is not None:
                req.logprobs.append(lp)
                req.cumulative_logprob += lp[new_tokens[0]].logprob
            outputs.append(self._output(req, new_tokens, [lp] if lp is not None else None))
            if req.is_finished:
                self._release(req)
        return outputs

    def _verify(self, scheduled, result, sampled: dict, new_logprobs: dict, drafted: dict) -> None:
        """Sample a step with draft chunks: every row of a draft chunk as its own output position
        (``engine_service.sampling.speculative``), then keep each request's drafts while they equal
        the tokens sampled before them, plus the token sampled after the last kept one. A request
        without drafts is sampled as in ``step``."""
        drafts = {c.request.request_id: c.draft_token_ids for c in scheduled.chunks if c.draft_token_ids}
        requests, counts = result.sample_requests, result.sample_counts
        rows = expand_rows(requests, counts, drafts)
        masked = self.grammars.apply_bitmask(result.sample_logits, rows)
        # the native step's argmax of every row, as in ``step``: all-greedy rows take it
        out = self.sampler(result.sample_logits, rows, argmax=None if masked else result.greedy_token_ids)
        r = 0
        for req, count in zip(requests, counts, strict=True):
            rid = req.request_id
            if count == 1:
                token, lp = out.token_ids[r], out.logprobs[r]
                kept = self.grammars.accept(req, token)  # the token budget may replace it
                if kept != token and lp is not None:
                    lp = compute_logprobs(result.sample_logits[r : r + 1], [kept], req.sampling_params.logprobs)[0]
                sampled[rid] = kept
                if lp is not None:
                    new_logprobs[rid] = lp
            else:
                tokens = out.token_ids[r : r + count]
                keep = num_accepted(tokens, drafts[rid]) + 1
                sampled[rid] = tokens[:keep]
                lps = out.logprobs[r : r + keep]
                drafted[rid] = (req.num_output_tokens, lps if lps[0] is not None else [])
            r += count

    def _output(self, req: Request, new_tokens: list[int], new_logprobs=None) -> EngineOutput:
        group, index = self._child_index[req.request_id]
        first = len(req.output_token_ids) == len(new_tokens) and bool(new_tokens)
        return EngineOutput(
            request_id=group.request_id,
            index=index,
            new_token_ids=new_tokens,
            new_logprobs=new_logprobs,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            error=req.error,
            error_code=req.error_code,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
            prompt_logprobs=req.prompt_logprobs if first and req.sampling_params.prompt_logprobs is not None else None,
            metrics=RequestMetrics(
                arrival_time=req.arrival_time,
                first_scheduled_time=req.first_scheduled_time,
                first_token_time=req.first_token_time,
                finished_time=req.finished_time,
                num_preemptions=req.num_preemptions,
            ) if req.is_finished else None,
        )

    def _release(self, req: Request) -> None:
        self.grammars.free(req.request_id)
        group, _ = self._child_index.pop(req.request_id)
        group.num_live -= 1
        if group.num_live == 0:
            del self._groups[group.request_id]
            self._finished_requests += 1

    # ------------------------------------------------------------------ introspection
    def get_stats(self) -> EngineStats:
        sched = self.scheduler
        stats = sched.stats
        return EngineStats(
            running=sched.num_running,
            waiting=sched.num_waiting,
            preempted_waiting=sched.num_preempted_waiting,
            free_blocks=sched.block_pool.num_free_blocks,
            total_blocks=sched.block_pool.num_total_blocks,
            preemptions=stats.preemptions,
            iterations=stats.iterations,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
            finished_requests=self._finished_requests,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
        )
