"""Sampling on the batch's logits (torch): the batched ``Sampler``, its metadata, penalties and
logprobs. ``SamplingParams`` is model-free and lives in ``engine_service.core.sampling_params``;
it is re-exported here."""

from __future__ import annotations

from engine_service.core.sampling_params import SAMPLING_EPS, SamplingParams
from engine_service.sampling.logprobs import compute_logprobs
from engine_service.sampling.metadata import SamplingMetadata
from engine_service.sampling.sampler import Sampler, SamplerOutput

__all__ = ["SAMPLING_EPS", "Sampler", "SamplerOutput", "SamplingMetadata", "SamplingParams", "compute_logprobs"]
