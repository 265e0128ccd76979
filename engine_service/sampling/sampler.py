"""The sampler: one call per engine step on the logits of every request that samples.

Pipeline (vLLM v1's order), each stage vectorised over the batch and skipped when no row uses it:

1. logprobs of the raw logits (``log_softmax`` in float32, as ``x - logsumexp(x)`` for the chosen
   and top-N tokens) for the rows that ask for them;
2. logits processors on the rows that use them: ``min_tokens`` (EOS and stop ids to ``-inf``),
   ``logit_bias``, then the repetition, frequency and presence penalties;
3. greedy rows (temperature < 1e-5): ``argmax`` of the processed logits;
4. random rows, in probability space (weights ``exp(logit / T - max)``): ``min_p`` and ``top_k``
   as one threshold, then ``top_p`` on the distribution they leave, then one draw by inverse CDF:
   the first token whose cumulative weight (vocabulary order) exceeds ``u * total``.

Only the processed greedy rows and the random rows are copied, into a workspace reused across
steps; the input logits are never modified.

Reproducibility: the uniform ``u`` of a seeded request is a pure function of (seed, output
position) (:func:`seeded_uniform`), and every stage works row by row, so a seeded request samples
the same token alone or in any batch, after a preemption (the position is the same), and in a
fresh process. Unseeded rows take their ``u`` from the sampler's own generator, one batched draw.
One uniform per row (instead of a vocabulary-sized noise vector for the Gumbel trick) keeps the
seeded path cheap: no per-request generator, no per-request kernel.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from engine_service.core.request import Logprob, Request
from engine_service.sampling.logprobs import compute_logprobs, logprob_dicts
from engine_service.sampling.metadata import SamplingMetadata, seeded_uniform
from engine_service.sampling.penalties import TokenIdCache, apply_penalties

__all__ = [
    "Sampler",
    "SamplerOutput",
    "apply_logits_processors",
    "apply_sampling_transforms",
    "benchmark_sampler",
    "compute_logprobs",
    "draw_from_weights",
    "sample_from_logits",
    "sampling_weights",
]

# Candidate counts top_p tries (most likely tokens) before a full sort of the row.
_TOP_P_CANDIDATES = (512, 4096)


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per request, in order
    # Per request: the chosen token and the top N (N = params.logprobs) when asked, else None.
    logprobs: list[dict[int, Logprob] | None]


def _apply_processors(x: torch.Tensor, meta: SamplingMetadata, lut: torch.Tensor | None) -> None:
    """min_tokens mask, logit_bias, penalties, in place on ``x``. ``lut`` maps a batch row to its
    row in ``x`` (None: ``x`` is the whole batch)."""

    def local(rows: torch.Tensor) -> torch.Tensor:
        return rows if lut is None else lut[rows]

    if meta.mask_rows is not None:
        x[local(meta.mask_rows), meta.mask_tokens] = float("-inf")
    if meta.bias_rows is not None:
        x.index_put_((local(meta.bias_rows), meta.bias_tokens), meta.bias_values, accumulate=True)
    if meta.penalties is not None:
        apply_penalties(x, meta.penalties, local(meta.penalties.rows))


def apply_logits_processors(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Stage 2 on the whole batch: min_tokens mask, logit_bias, then penalties. Returns a new
    float32 tensor (the input is not modified)."""
    x = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
    _apply_processors(x, meta, None)
    return x


def _rows(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def sampling_weights(logits: torch.Tensor, meta: SamplingMetadata, *, inplace: bool = False) -> torch.Tensor:
    """Stage 4 before the draw, on the random rows only (``logits``: [R, V] float32, the processed
    logits of ``meta.random_rows`` in order): temperature, min_p, top_k, top_p, all in probability
    space. Returns unnormalised weights ``exp(logit / T - max)`` (the most likely token weighs
    exactly 1) with the filtered tokens at 0; ``logits`` itself when ``inplace``.

    Working on the weights needs one ``exp`` and one ``max`` for every filter and the draw."""
    device = logits.device
    w = logits.div_(meta.temperature.unsqueeze(1)) if inplace else logits / meta.temperature.unsqueeze(1)
    w.sub_(w.max(dim=1, keepdim=True).values).exp_()
    if meta.min_p is not None or meta.top_k is not None:
        # One threshold per row for both (they commute): min_p keeps p >= min_p * p_max, i.e.
        # w >= min_p (p_max weighs 1); top_k keeps w >= the k-th largest weight. 0 keeps all.
        threshold = torch.zeros(w.shape[0], 1, device=device)
        if meta.min_p is not None:
            threshold[_rows(meta.min_p_rows, device), 0] = meta.min_p
        if meta.top_k is not None:
            rows = _rows(meta.top_k_rows, device)
            sub = w if len(meta.top_k_rows) == w.shape[0] else w.index_select(0, rows)
            kth = sub.topk(int(meta.top_k.max()), dim=1).values.gather(1, (meta.top_k - 1).unsqueeze(1))
            threshold[rows] = torch.maximum(threshold[rows], kth)
        w.masked_fill_(w < threshold, 0.0)
    if meta.top_p is not None:
        if len(meta.top_p_rows) == w.shape[0]:
            _top_p(w, meta.top_p)
        else:
            rows = _rows(meta.top_p_rows, device)
            w.index_copy_(0, rows, _top_p(w.index_select(0, rows), meta.top_p))
    return w


def apply_sampling_transforms(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """:func:`sampling_weights` as logits: ``log(weights)``, i.e. the temperature-scaled logits
    minus the row's maximum, filtered tokens at ``-inf`` (for tests and debugging)."""
    return torch.log(sampling_weights(logits, meta))


def _top_p_threshold(sorted_w: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The smallest kept weight per row, from the row's largest weights in descending order: the
    smallest prefix whose mass reaches ``target`` (= top_p x the row's total) is kept, i.e. a token
    stays while the mass strictly above it is below the target (the most likely one always stays)."""
    keep = (torch.cumsum(sorted_w, dim=1) - sorted_w) < target.unsqueeze(1)
    last = keep.sum(dim=1, keepdim=True).clamp_(min=1) - 1
    return sorted_w.gather(1, last).squeeze(1)


def _top_p(w: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p on every row of the weights ``w`` (in place; returns it), on the distribution as
    renormalised by the earlier filters. The threshold comes from the 512, then 4096 largest
    weights, and from a full sort only for rows whose candidates hold less than top_p: a sort of
    the vocabulary is the most expensive operation of the sampler. Tokens tied with the last kept
    one are kept too (as top_k does)."""
    vocab = w.shape[1]
    target = top_p * w.sum(dim=1)
    threshold = torch.empty(w.shape[0], dtype=w.dtype, device=w.device)
    pending = None  # None: every row
    for k in _TOP_P_CANDIDATES:
        if k >= vocab:
            break
        p_w = w if pending is None else w.index_select(0, pending)
        p_target = target if pending is None else target.index_select(0, pending)
        cand = p_w.topk(k, dim=1).values  # sorted, descending
        covered = cand.sum(dim=1) >= p_target
        idx = torch.arange(w.shape[0], device=w.device) if pending is None else pending
        threshold[idx[covered]] = _top_p_threshold(cand[covered], p_target[covered])
        pending = idx[~covered]
        if pending.numel() == 0:
            break
    if pending is None or pending.numel():
        p_w = w if pending is None else w.index_select(0, pending)
        p_target = target if pending is None else target.index_select(0, pending)
        full = _top_p_threshold(p_w.sort(dim=1, descending=True).values, p_target)
        if pending is None:
            threshold = full
        else:
            threshold[pending] = full
    return w.masked_fill_(w < threshold.unsqueeze(1), 0.0)


def draw_from_weights(w: torch.Tensor, uniforms: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
    """Inverse-CDF draw per row: ``w`` [R, V] non-negative weights, ``uniforms`` [R] in [0, 1).
    Returns the first token whose cumulative weight (vocabulary order) exceeds ``u * total``; a
    token of zero weight is never returned. ``inplace`` lets it overwrite ``w``."""
    cdf = w.cumsum_(dim=1) if inplace else torch.cumsum(w, dim=1)
    total = cdf[:, -1:]
    target = (uniforms.to(device=w.device, dtype=torch.float64).unsqueeze(1) * total.double()).to(cdf.dtype)
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=w.shape[1] - 1)


def sample_from_logits(x: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from logits (``-inf`` = excluded): see :func:`draw_from_weights`."""
    return draw_from_weights(torch.exp(x - x.max(dim=1, keepdim=True).values), uniforms, inplace=True)


class Sampler:
    """Samples one token per request from the step's logits; see the module docstring."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", seed: int = 0):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(seed)
        self._token_cache = TokenIdCache()
        self._workspace: torch.Tensor | None = None  # reused [rows, vocab] float32 buffer

    def _work_buffer(self, rows: int, device: torch.device) -> torch.Tensor:
        ws = self._workspace
        if ws is None or ws.shape[0] < rows or ws.device != device:
            ws = self._workspace = torch.empty(
                max(rows, 8), self.vocab_size, dtype=torch.float32, device=device
            )
        return ws[:rows]

    def metadata(self, requests: list[Request], device: torch.device | None = None) -> SamplingMetadata:
        return SamplingMetadata.from_requests(
            requests, self.vocab_size, device or self.device, self._token_cache
        )

    def _uniforms(self, meta: SamplingMetadata) -> torch.Tensor:
        """One uniform per random row: seeded rows from (seed, position), the others from the
        sampler's generator in one draw."""
        seeds = meta.seeds
        unseeded = [i for i, s in enumerate(seeds) if s is None]
        if len(unseeded) == len(seeds):
            u = torch.rand(len(seeds), dtype=torch.float64, generator=self.generator)
        else:
            u = torch.tensor(
                [
                    0.0 if s is None else seeded_uniform(s, p)
                    for s, p in zip(seeds, meta.positions, strict=True)
                ],
                dtype=torch.float64,
            )
            if unseeded:
                u[unseeded] = torch.rand(len(unseeded), dtype=torch.float64, generator=self.generator)
        return u

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        num = len(requests)
        if logits.dim() != 2 or logits.shape[0] != num or logits.shape[1] != self.vocab_size:
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} for {num} requests and a vocabulary of {self.vocab_size}"
            )
        if not requests:
            return SamplerOutput(token_ids=[], logprobs=[])
        raw = logits if logits.dtype == torch.float32 else logits.float()
        device = raw.device
        meta = self.metadata(requests, device)

        # 1. logprobs of the model's distribution, before anything below changes it
        lp_rows = [i for i, n in enumerate(meta.num_logprobs) if n is not None]
        raw_lp = None  # the raw logits of the rows that want logprobs (read-only)
        if lp_rows:
            raw_lp = raw if len(lp_rows) == num else raw.index_select(0, _rows(lp_rows, device))

        processed = set(meta.processed_rows)
        greedy_plain = [i for i in meta.greedy_rows if i not in processed]
        greedy_proc = [i for i in meta.greedy_rows if i in processed]
        if len(greedy_plain) == num:  # the all-greedy fast path: argmax, nothing else
            tokens = raw.argmax(dim=1)
        else:
            tokens = torch.empty(num, dtype=torch.long, device=device)
            if greedy_plain:
                g = _rows(greedy_plain, device)
                if 4 * len(greedy_plain) >= num:  # reading every row beats copying a few
                    tokens[g] = raw.argmax(dim=1)[g]
                else:
                    tokens[g] = raw.index_select(0, g).argmax(dim=1)
            # Rows that need a working copy: processed greedy rows, then the random rows.
            work = greedy_proc + meta.random_rows
            x = self._work_buffer(len(work), device)
            if work == list(range(num)):
                x.copy_(raw)
                lut = None
            else:
                work_t = _rows(work, device)
                torch.index_select(raw, 0, work_t, out=x)
                lut = torch.full((num,), -1, dtype=torch.long, device=device)
                lut[work_t] = torch.arange(len(work), device=device)
            # 2. processors
            if meta.needs_processing:
                _apply_processors(x, meta, lut)
            # 3. greedy rows with processors
            n_gp = len(greedy_proc)
            if n_gp:
                tokens[_rows(greedy_proc, device)] = x[:n_gp].argmax(dim=1)
            # 4. random rows
            if meta.random_rows:
                w = sampling_weights(x[n_gp:], meta, inplace=True)
                tokens[_rows(meta.random_rows, device)] = draw_from_weights(
                    w, self._uniforms(meta), inplace=True
                )

        token_list = tokens.tolist()
        logprobs: list[dict[int, Logprob] | None] = [None] * num
        if raw_lp is not None:
            chosen = tokens if len(lp_rows) == num else tokens[_rows(lp_rows, device)]
            dicts = logprob_dicts(raw_lp, chosen, [meta.num_logprobs[i] for i in lp_rows])
            for i, d in zip(lp_rows, dicts, strict=True):
                logprobs[i] = d
        return SamplerOutput(token_ids=token_list, logprobs=logprobs)


def benchmark_sampler(
    batch_size: int = 256,
    vocab: int = 49152,
    steps: int = 20,
    warmup: int = 3,
    device: torch.device | str = "cpu",
    prompt_len: int = 256,
    output_len: int = 128,
    logprobs: int | None = None,
    num_threads: int | None = None,
    clock: str = "wall",
    vocab_size: int | None = None,
) -> float:
    """Median wall time in ms of one ``Sampler`` call on a mixed batch: a quarter each greedy,
    top-p (0.9, temperature 0.8), penalties (presence 0.5, frequency 0.5, repetition 1.1, top_k 50)
    and seeded (temperature 1.0, top_k 40, min_p 0.05), with ``prompt_len`` prompt and
    ``output_len`` generated tokens per request (penalties look at them). ``num_threads`` sets
    torch's CPU threads for the measurement (restored after). ``clock="cpu"`` measures the process's
    CPU time instead of wall time (with one thread, the cost on an idle core of a shared machine).
    ``vocab_size`` is an alias of ``vocab`` (it wins when given)."""
    if vocab_size is not None:
        vocab = vocab_size
    from engine_service.sampling.params import SamplingParams

    gen = torch.Generator().manual_seed(1234)
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=None),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=None),
        SamplingParams(
            temperature=1.0,
            top_k=50,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            repetition_penalty=1.1,
            max_tokens=None,
        ),
        None,  # seeded, built per request
    ]
    requests = []
    for i in range(batch_size):
        params = kinds[i % 4] or SamplingParams(
            temperature=1.0, top_k=40, min_p=0.05, seed=i, max_tokens=None
        )
        if logprobs is not None:
            params = params.replace(logprobs=logprobs)
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        output = torch.randint(0, vocab, (output_len,), generator=gen).tolist()
        requests.append(Request(f"bench-{i}", prompt, params, output_token_ids=output))
    sampler = Sampler(vocab, device=device, seed=0)
    # Logits shaped like a language model's: Zipf-like (exponent 1.2) over a random order per row,
    # plus noise; top-p 0.9 then needs a few hundred to a few thousand candidates, not a full sort.
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    zipf = -1.2 * torch.log(ranks)
    perm = torch.argsort(torch.rand(batch_size, vocab, generator=gen), dim=1)
    logits = (zipf[perm] + 0.1 * torch.randn(batch_size, vocab, generator=gen)).to(device)
    times = []
    previous_threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        timer = time.process_time if clock == "cpu" else time.perf_counter
        _run_benchmark(sampler, logits, requests, device, warmup, steps, times, timer)
    finally:
        torch.set_num_threads(previous_threads)
    times.sort()
    return times[len(times) // 2] if times else math.nan


def _run_benchmark(sampler, logits, requests, device, warmup, steps, times, timer) -> None:
    for step in range(warmup + steps):
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        t0 = timer()
        out = sampler(logits, requests)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        if step >= warmup:
            times.append((timer() - t0) * 1e3)
        for req, tok in zip(requests, out.token_ids, strict=True):
            req.append_output_token(tok)
