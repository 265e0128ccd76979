"""The batch's sampling parameters gathered once per step into tensors (the only per-request
Python loop of the sampler), with flags that let the sampler skip every stage nobody uses."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_service.core.sampling_params import SAMPLING_EPS
from engine_service.sampling.penalties import PenaltyBatch, TokenIdCache

_M64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """SplitMix64's finaliser: a bijective 64-bit mixer with good avalanche."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """The uniform draw in [0, 1) of a seeded request at output ``position``: a pure function of
    (seed, position), so it does not depend on the batch, on preemption or on the process."""
    h = _mix64((_mix64((seed ^ 0x5851F42D4C957F2D) & _M64) + (position + 1) * 0x9E3779B97F4A7C15) & _M64)
    return (h >> 11) * (1.0 / (1 << 53))


@dataclass
class SamplingMetadata:
    num_rows: int
    vocab_size: int
    device: torch.device
    # Which rows are sampled how.
    greedy_rows: list[int]
    random_rows: list[int]
    # Random rows only, aligned with ``random_rows``.
    temperature: torch.Tensor | None  # [R] float32
    min_p_rows: list[int]  # positions (into the random rows) that use min_p
    min_p: torch.Tensor | None  # [len(min_p_rows)] float32
    top_k_rows: list[int]  # positions (into the random rows) that use top_k
    top_k: torch.Tensor | None  # [len(top_k_rows)] long
    top_p_rows: list[int]  # positions (into the random rows) that use top_p
    top_p: torch.Tensor | None  # [len(top_p_rows)] float32
    seeds: list[int | None]  # per random row
    positions: list[int]  # per random row: the output position it samples
    # Logits processors (all rows).
    bias_rows: torch.Tensor | None
    bias_tokens: torch.Tensor | None
    bias_values: torch.Tensor | None
    mask_rows: torch.Tensor | None  # (row, token) pairs set to -inf (min_tokens)
    mask_tokens: torch.Tensor | None
    penalties: PenaltyBatch | None
    # Logprobs: per row the number of alternatives, or None when not asked.
    num_logprobs: list[int | None]
    # Rows touched by a logits processor (sorted).
    processed_rows: list[int]

    @property
    def needs_processing(self) -> bool:
        return bool(self.processed_rows)

    @classmethod
    def from_requests(
        cls,
        requests: list,
        vocab_size: int,
        device: torch.device | str = "cpu",
        token_cache: TokenIdCache | None = None,
    ) -> SamplingMetadata:
        device = torch.device(device)
        cache = token_cache if token_cache is not None else TokenIdCache()
        greedy_rows: list[int] = []
        random_rows: list[int] = []
        temps: list[float] = []
        min_p_rows: list[int] = []
        min_ps: list[float] = []
        top_k_rows: list[int] = []
        top_ks: list[int] = []
        top_p_rows: list[int] = []
        top_ps: list[float] = []
        seeds: list[int | None] = []
        positions: list[int] = []
        b_rows: list[int] = []
        b_toks: list[int] = []
        b_vals: list[float] = []
        m_rows: list[int] = []
        m_toks: list[int] = []
        p_rows: list[int] = []
        p_pres: list[float] = []
        p_freq: list[float] = []
        p_rep: list[float] = []
        p_out: list[torch.Tensor] = []
        p_prompt: list[torch.Tensor | None] = []
        num_logprobs: list[int | None] = []
        processed: set[int] = set()

        for i, req in enumerate(requests):
            sp = req.sampling_params
            pos = req.num_output_tokens
            num_logprobs.append(sp.logprobs)
            if sp.temperature < SAMPLING_EPS:
                greedy_rows.append(i)
            else:
                r = len(random_rows)
                random_rows.append(i)
                temps.append(sp.temperature)
                if sp.min_p > 0.0:
                    min_p_rows.append(r)
                    min_ps.append(sp.min_p)
                if 0 < sp.top_k < vocab_size:
                    top_k_rows.append(r)
                    top_ks.append(sp.top_k)
                if sp.top_p < 1.0:
                    top_p_rows.append(r)
                    top_ps.append(sp.top_p)
                seeds.append(sp.seed)
                positions.append(pos)
            if sp.logit_bias:
                for tok, val in sp.logit_bias.items():
                    if not 0 <= tok < vocab_size:  # refused by SamplingParams.verify
                        continue
                    processed.add(i)
                    b_rows.append(i)
                    b_toks.append(tok)
                    b_vals.append(val)
            if pos < sp.min_tokens:
                stop_ids = set(sp.stop_token_ids or ())
                if not sp.ignore_eos:
                    stop_ids.update(req.eos_token_ids)
                for tok in stop_ids:
                    if 0 <= tok < vocab_size:
                        processed.add(i)
                        m_rows.append(i)
                        m_toks.append(tok)
            if sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0 or sp.repetition_penalty != 1.0:
                processed.add(i)
                p_rows.append(i)
                p_pres.append(sp.presence_penalty)
                p_freq.append(sp.frequency_penalty)
                p_rep.append(sp.repetition_penalty)
                p_out.append(cache.output(req))
                p_prompt.append(cache.prompt(req) if sp.repetition_penalty != 1.0 else None)

        def longs(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        return cls(
            num_rows=len(requests),
            vocab_size=vocab_size,
            device=device,
            greedy_rows=greedy_rows,
            random_rows=random_rows,
            temperature=floats(temps) if random_rows else None,
            min_p_rows=min_p_rows,
            min_p=floats(min_ps) if min_p_rows else None,
            top_k_rows=top_k_rows,
            top_k=longs(top_ks) if top_k_rows else None,
            top_p_rows=top_p_rows,
            top_p=floats(top_ps) if top_p_rows else None,
            seeds=seeds,
            positions=positions,
            bias_rows=longs(b_rows) if b_rows else None,
            bias_tokens=longs(b_toks) if b_rows else None,
            bias_values=floats(b_vals) if b_rows else None,
            mask_rows=longs(m_rows) if m_rows else None,
            mask_tokens=longs(m_toks) if m_rows else None,
            penalties=(
                PenaltyBatch.build(p_rows, p_pres, p_freq, p_rep, p_out, p_prompt, device) if p_rows else None
            ),
            num_logprobs=num_logprobs,
            processed_rows=sorted(processed),
        )
