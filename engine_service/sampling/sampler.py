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

import dataclasses
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
    "compute_logprobs",
    "draw_from_weights",
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


_SPARSE_TOP_K_MAX = 1024  # top_k above this takes the dense path


def _processor_keys(meta: SamplingMetadata, vocab: int) -> torch.Tensor:
    """Flat indices (row * vocab + token) of every entry a processor may change."""
    keys = []
    if meta.mask_rows is not None:
        keys.append(meta.mask_rows * vocab + meta.mask_tokens)
    if meta.bias_rows is not None:
        keys.append(meta.bias_rows * vocab + meta.bias_tokens)
    pen = meta.penalties
    if pen is not None:
        keys.append(pen.rows[pen.output_rows] * vocab + pen.output_tokens)
        if pen.any_repetition and pen.prompt_tokens is not None:
            keys.append(pen.rows[pen.prompt_rows] * vocab + pen.prompt_tokens)
    return torch.unique(torch.cat(keys))


def _by_row(rows: torch.Tensor, values: torch.Tensor, num_rows: int, fill: float = 0.0) -> torch.Tensor:
    """Scatter ``values`` (grouped by ``rows``, non-decreasing) into a [num_rows, longest] tensor,
    each row's values first and in order, the rest ``fill``."""
    counts = torch.bincount(rows, minlength=num_rows)
    width = max(int(counts.max()) if counts.numel() else 0, 1)
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(rows.numel(), device=rows.device) - starts[rows]
    out = torch.full((num_rows, width), fill, dtype=values.dtype, device=values.device)
    out[rows, pos] = values
    return out


# Rows are read in chunks of this many tokens: one vectorised ``amax`` per chunk gives every
# row's maximum, its argmax (the first chunk holding the maximum, then inside it) and which chunks
# can hold a candidate, so the per-token work touches only those chunks.
_CHUNK = 64


def chunk_maxima(x: torch.Tensor) -> torch.Tensor:
    """[rows, ceil(vocab / _CHUNK)]: the maximum of each chunk of each row."""
    rows, vocab = x.shape
    n = vocab // _CHUNK
    main = x[:, : n * _CHUNK].reshape(rows, n, _CHUNK).amax(dim=2)
    if vocab % _CHUNK:
        main = torch.cat([main, x[:, n * _CHUNK :].amax(dim=1, keepdim=True)], dim=1)
    return main


def _chunk_cols(chunks: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The token ids of ``chunks`` ([P] chunk numbers) as [P, _CHUNK] (clamped) and their validity."""
    cols = chunks.unsqueeze(1) * _CHUNK + torch.arange(_CHUNK, device=chunks.device)
    valid = cols < vocab
    return cols.clamp_(max=vocab - 1), valid


# Up to this many greedy rows take torch's own ``argmax``, not ``fast_argmax``. Why: a decode step
# streams every weight through the caches, so the sampler that runs after it finds its own code and
# data evicted, and then each operator costs what fetching its working set from memory costs. One
# row after a bfloat16 step of SmolLM2: one ``argmax`` cost a third of ``fast_argmax``'s ten
# operators, though it is slower once they are warm.
ARGMAX_ROWS = 4


def fast_argmax(x: torch.Tensor, cmax: torch.Tensor | None = None) -> torch.Tensor:
    """``x.argmax(dim=1)`` (the first maximal index of each row) from the chunk maxima: the first
    chunk that holds the row's maximum, then the first maximum inside it. torch's CPU ``argmax`` is
    several times slower than its ``amax``."""
    cmax = chunk_maxima(x) if cmax is None else cmax
    best = cmax.argmax(dim=1)
    cols, _ = _chunk_cols(best, x.shape[1])
    inside = x.gather(1, cols).argmax(dim=1)  # clamped duplicates come after the real last token
    return cols.gather(1, inside.unsqueeze(1)).squeeze(1)


def _candidates(x: torch.Tensor, row_idx: torch.Tensor, cmax: torch.Tensor,
                bound: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The entries of ``x[row_idx[i]]`` that are ``>= bound[i]``, read from the chunks whose
    maximum (``cmax`` [len(row_idx), chunks]) reaches the bound: (i, token id, value), grouped by
    i and in vocabulary order within it."""
    vocab = x.shape[1]
    i, chunk = (cmax >= bound.unsqueeze(1)).nonzero(as_tuple=True)
    cols, valid = _chunk_cols(chunk, vocab)
    flat = (row_idx[i] * vocab).unsqueeze(1) + cols  # one flat gather: faster than 2-D indexing
    vals = x.view(-1).index_select(0, flat.view(-1)).view(flat.shape)
    sel = ((vals >= bound[i].unsqueeze(1)) & valid).view(-1).nonzero().squeeze(1)
    return i.repeat_interleave(_CHUNK).index_select(0, sel), cols.view(-1).index_select(0, sel), \
        vals.view(-1).index_select(0, sel)


def _draw_sparse(rows: torch.Tensor, cols: torch.Tensor, w: torch.Tensor, num_rows: int,
                 uniforms: torch.Tensor) -> torch.Tensor:
    """The inverse-CDF draw of :func:`draw_from_weights` over each row's kept tokens only
    (``rows``, ``cols`` in vocabulary order, weights ``w``). The filtered tokens weigh 0 in the
    dense draw, and torch's CPU ``cumsum`` accumulates in double, so the cumulative weights, the
    total and the token found are those of the dense draw."""
    dense_w = _by_row(rows, w, num_rows)
    dense_c = _by_row(rows, cols, num_rows, fill=-1)
    pick = draw_from_weights(dense_w, uniforms, inplace=True)
    return dense_c.gather(1, pick.unsqueeze(1)).squeeze(1)


def sample_sparse(x: torch.Tensor, rows: torch.Tensor, row_max: torch.Tensor, cmax: torch.Tensor,
                  meta: SamplingMetadata, uniforms: torch.Tensor, workspace=None) -> torch.Tensor:
    """Stage 4 for the random rows (``rows`` into ``x``, the processed logits; ``row_max`` their
    maxima, ``cmax`` their :func:`chunk_maxima`): the same tokens as
    ``draw_from_weights(sampling_weights(...))`` without its vocabulary-wide passes where the kept
    set is small:

    - top_k and/or min_p (no top_p): the candidates are the logits within ``T * log(cutoff)`` of
      the row's maximum, read from the chunks that reach that bound; their weights, the k-th
      largest among them and the min_p bound give the threshold. Exact when the smallest candidate
      weighs less than the threshold (every token left out then weighs less too).
    - top_p alone: the weights of the row are computed as before (the top-p target needs their
      total), then the candidates are the weights above a cutoff, sorted; exact when the top-p
      boundary falls inside them (the last cutoff, ``(1 - top_p) * total / vocab``, guarantees it:
      the tokens below it weigh less than ``1 - top_p`` of the total).
    - anything else (temperature only, top_k with top_p, ...) and any row the candidates could
      not decide: the dense path.
    """
    device = x.device
    vocab = x.shape[1]
    n = rows.numel()
    temps = meta.temperature
    min_p = torch.zeros(n, device=device)
    if meta.min_p is not None:
        min_p[_rows(meta.min_p_rows, device)] = meta.min_p
    top_k = torch.zeros(n, dtype=torch.long, device=device)
    if meta.top_k is not None:
        top_k[_rows(meta.top_k_rows, device)] = meta.top_k
    top_p = torch.ones(n, device=device)
    if meta.top_p is not None:
        top_p[_rows(meta.top_p_rows, device)] = meta.top_p
    has_p = top_p < 1.0
    group_k = ~has_p & ((min_p > 0) | (top_k > 0)) & (top_k <= _SPARSE_TOP_K_MAX)
    group_p = has_p & (min_p == 0) & (top_k == 0)
    out = torch.full((n,), -1, dtype=torch.long, device=device)
    m_t = row_max / temps  # the maximum of x / T (division by T > 0 keeps the order)

    # top_k / min_p rows: candidates by comparison on the logits, weights for them only. The
    # bound: the (k + margin)-th largest chunk maximum (at least k + margin tokens reach it), or
    # for min_p the logit of weight min_p * factor, whichever is higher.
    pending = group_k.nonzero().squeeze(1)
    n_chunks = cmax.shape[1]
    for margin, factor in ((8, 0.5), (64, 1e-2)):
        if pending.numel() == 0:
            break
        k = top_k[pending]
        has_k = k > 0
        tp = temps[pending].double()
        bound = torch.full((pending.numel(),), float("-inf"), dtype=torch.float64, device=device)
        if bool(has_k.any()):
            depth = min(int(k.max()) + margin, n_chunks)
            kth_chunk = cmax[pending].topk(depth, dim=1).values
            pos = (k + margin).clamp(max=n_chunks) - 1
            bound = torch.where(has_k, kth_chunk.gather(1, pos.clamp(max=depth - 1).unsqueeze(1)).squeeze(1).double(),
                                bound)
        mp = min_p[pending].double()
        # w >= c  <=>  x / T - max >= log(c), up to rounding: a slightly lower bound keeps it in.
        minp_bound = row_max[pending].double() + tp * torch.log(mp * factor) - 1e-3 * tp
        bound = torch.where(mp > 0, torch.maximum(bound, minp_bound), bound).float()
        r, cols, vals = _candidates(x, rows[pending], cmax[pending], bound)
        w = (vals / temps[pending][r]).sub_(m_t[pending][r]).exp_()
        counts = torch.bincount(r, minlength=pending.numel())
        kth = torch.zeros(pending.numel(), device=device)
        if bool(has_k.any()):
            padded = _by_row(r, w, pending.numel(), fill=-1.0)
            kk = int(k.max())
            top = padded.topk(min(kk, padded.shape[1]), dim=1).values
            if top.shape[1] < kk:
                top = torch.cat([top, top.new_full((top.shape[0], kk - top.shape[1]), -1.0)], dim=1)
            kth_w = top.gather(1, (k - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
            # Fewer candidates than k (a min_p bound above the k-th): the k-th token weighs less
            # than every candidate, and the check below asks the smallest to be under min_p.
            kth = torch.where(has_k & (counts >= k), kth_w, kth)
        threshold = torch.maximum(kth, min_p[pending])
        smallest = _by_row(r, w, pending.numel(), fill=float("inf")).amin(dim=1)
        ok = ((counts == vocab) | (smallest < threshold)) & (threshold > 0)
        if bool(ok.any()):
            keep = ok[r] & (w >= threshold[r])
            local = torch.full((pending.numel(),), -1, dtype=torch.long, device=device)
            local[ok] = torch.arange(int(ok.sum()), device=device)
            done = pending[ok]
            out[done] = _draw_sparse(local[r[keep]], cols[keep], w[keep], done.numel(), uniforms[done.cpu()])
        pending = pending[~ok]
    fallback = [pending]

    # top_p rows: full weights (for the total), then the candidates above a bound, sorted. The
    # bound: the chunk maximum at which the largest chunk maxima (distinct tokens) already hold
    # the target mass, a few chunks further; else (1 - top_p) * total / vocab, below which the
    # tokens weigh less than 1 - top_p of the total together.
    pending = group_p.nonzero().squeeze(1)
    if pending.numel():
        src = rows[pending]
        if workspace is not None:
            w_full = workspace(pending.numel(), device)
            torch.index_select(x, 0, src, out=w_full)
        else:
            w_full = x.index_select(0, src)
        w_full.div_(temps[pending].unsqueeze(1)).sub_(m_t[pending].unsqueeze(1)).exp_()
        total = w_full.sum(dim=1)
        target = top_p[pending] * total
        guaranteed = ((1.0 - top_p[pending]) * total / vocab) * (1.0 - 1e-3)
        # The weights' chunk maxima from the logits' (x / T, - max, exp are all monotone): exact,
        # and no pass over the weights.
        w_cmax = (cmax[pending] / temps[pending].unsqueeze(1)).sub_(m_t[pending].unsqueeze(1)).exp_()
        sorted_cm = w_cmax.sort(dim=1, descending=True).values
        reach = (torch.cumsum(sorted_cm, dim=1) < target.unsqueeze(1)).sum(dim=1)
        by_chunks = sorted_cm.gather(1, (reach + 4).clamp(max=sorted_cm.shape[1] - 1).unsqueeze(1)).squeeze(1)
        by_chunks = torch.where(reach < sorted_cm.shape[1], by_chunks, guaranteed)
        local_idx = torch.arange(pending.numel(), device=device)
        for bounds in (by_chunks, guaranteed):
            if local_idx.numel() == 0:
                break
            r, cols, w = _candidates(w_full, local_idx, w_cmax[local_idx], bounds[local_idx])
            counts = torch.bincount(r, minlength=local_idx.numel())
            srt = _by_row(r, w, local_idx.numel()).sort(dim=1, descending=True).values
            tgt = target[local_idx]
            kept = ((torch.cumsum(srt, dim=1) - srt) < tgt.unsqueeze(1)).sum(dim=1)
            threshold = _top_p_threshold(srt, tgt)
            ok = (kept < counts) & (counts > 0)
            if bool(ok.any()):
                keep = ok[r] & (w >= threshold[r])
                local = torch.full((local_idx.numel(),), -1, dtype=torch.long, device=device)
                local[ok] = torch.arange(int(ok.sum()), device=device)
                done = pending[local_idx[ok]]
                out[done] = _draw_sparse(local[r[keep]], cols[keep], w[keep], done.numel(),
                                         uniforms[done.cpu()])
            local_idx = local_idx[~ok]
        fallback.append(pending[local_idx])

    fallback.append((~group_k & ~group_p).nonzero().squeeze(1))
    rest = torch.cat(fallback).sort().values
    if rest.numel():
        sub_meta = _select_random_rows(meta, rest.tolist())
        w = sampling_weights(x.index_select(0, rows[rest]), sub_meta, inplace=True)
        out[rest] = draw_from_weights(w, uniforms[rest.cpu()], inplace=True)
    return out


def _select_random_rows(meta: SamplingMetadata, keep: list[int]) -> SamplingMetadata:
    """The metadata of a subset of the random rows (positions into ``meta.random_rows``), for
    :func:`sampling_weights`."""
    device = meta.temperature.device
    where = {r: i for i, r in enumerate(keep)}

    def pick(rows: list[int], values: torch.Tensor | None):
        sel = [(where[r], j) for j, r in enumerate(rows) if r in where]
        if not sel or values is None:
            return [], None
        return [a for a, _ in sel], values[_rows([b for _, b in sel], device)]

    min_p_rows, min_p = pick(meta.min_p_rows, meta.min_p)
    top_k_rows, top_k = pick(meta.top_k_rows, meta.top_k)
    top_p_rows, top_p = pick(meta.top_p_rows, meta.top_p)
    return dataclasses.replace(
        meta, random_rows=[meta.random_rows[r] for r in keep], temperature=meta.temperature[_rows(keep, device)],
        min_p_rows=min_p_rows, min_p=min_p, top_k_rows=top_k_rows, top_k=top_k,
        top_p_rows=top_p_rows, top_p=top_p,
        seeds=[meta.seeds[r] for r in keep], positions=[meta.positions[r] for r in keep],
    )


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
    def __call__(self, logits: torch.Tensor, requests: list[Request], *, dense: bool = False,
                 argmax: list[int] | None = None) -> SamplerOutput:
        """``dense=True`` runs the previous all-dense pipeline (the reference the sparse paths are
        tested against: same tokens). ``argmax``: each row's ``argmax`` of ``logits`` as given, where
        the caller computed it with them (the native decode step): a batch whose rows are all greedy
        and unprocessed, without logprobs, takes those tokens instead of computing them again."""
        num = len(requests)
        if logits.dim() != 2 or logits.shape[0] != num or logits.shape[1] != self.vocab_size:
            raise ValueError(
                f"logits of shape {tuple(logits.shape)} for {num} requests and a vocabulary of {self.vocab_size}"
            )
        if argmax is not None and len(argmax) != num:
            raise ValueError(f"{len(argmax)} argmax tokens for {num} requests")
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

        if not meta.random_rows and not meta.needs_processing and argmax is not None and not lp_rows and not dense:
            return SamplerOutput(token_ids=list(argmax), logprobs=[None] * num)
        if not meta.random_rows and not meta.needs_processing:
            # the all-greedy fast path: argmax, nothing else
            tokens = raw.argmax(dim=1) if dense or num <= ARGMAX_ROWS else fast_argmax(raw)
        elif dense:
            tokens = self._dense(raw, meta)
        else:
            tokens = self._sparse(raw, meta, private=raw is not logits)

        token_list = tokens.tolist()
        logprobs: list[dict[int, Logprob] | None] = [None] * num
        if raw_lp is not None:
            chosen = tokens if len(lp_rows) == num else tokens[_rows(lp_rows, device)]
            dicts = logprob_dicts(raw_lp, chosen, [meta.num_logprobs[i] for i in lp_rows])
            for i, d in zip(lp_rows, dicts, strict=True):
                logprobs[i] = d
        return SamplerOutput(token_ids=token_list, logprobs=logprobs)

    def _sparse(self, raw: torch.Tensor, meta: SamplingMetadata, private: bool) -> torch.Tensor:
        """Stages 2-4 without copying the batch: the processors are applied in place on ``raw``
        (their few touched entries saved and restored unless ``raw`` is a private copy), one
        ``argmax`` over the batch gives the greedy tokens and every row's maximum, and the random
        rows draw from candidate lists (:func:`sample_sparse`) instead of vocabulary-wide passes."""
        device = raw.device
        saved = None
        if meta.needs_processing:
            keys = _processor_keys(meta, raw.shape[1])
            if not private:
                saved = (keys, raw.view(-1)[keys].clone())
            _apply_processors(raw, meta, None)
        try:
            cmax = chunk_maxima(raw)
            tokens = fast_argmax(raw, cmax)
            if meta.random_rows:
                rows = _rows(meta.random_rows, device)
                row_max = raw.gather(1, tokens.unsqueeze(1)).squeeze(1).index_select(0, rows)
                tokens[rows] = sample_sparse(raw, rows, row_max, cmax.index_select(0, rows), meta,
                                             self._uniforms(meta), self._work_buffer)
        finally:
            if saved is not None:
                raw.view(-1)[saved[0]] = saved[1]
        return tokens

    def _dense(self, raw: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The previous pipeline: a working copy of every processed or random row, full-vocabulary
        filters and draw."""
        num = meta.num_rows
        device = raw.device
        processed = set(meta.processed_rows)
        greedy_plain = [i for i in meta.greedy_rows if i not in processed]
        greedy_proc = [i for i in meta.greedy_rows if i in processed]
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
            tokens[_rows(meta.random_rows, device)] = draw_from_weights(w, self._uniforms(meta), inplace=True)
        return tokens
