"""Token sampling (module M7): logits -> tokens, batched on the device, with counter-based noise.

Greedy, temperature, top-k, top-p and min_p per row, after vLLM's logits adjustments
(min_tokens, logit_bias, repetition / frequency / presence penalties; `logits_processing`).
The random stream of a request is a pure function of (seed, output index), so the sampler
keeps no state and preemption never reseeds a request.
"""

from rlt_sampling.batch import MIN_TEMPERATURE, SamplingBatch
from rlt_sampling.filtering import mask_min_p, mask_top_k_top_p
from rlt_sampling.logits_processing import adjust_logits
from rlt_sampling.noise import counter_gumbel, counter_uniform, lowbias32
from rlt_sampling.output import HostSample, SamplerOutput
from rlt_sampling.sampler import Sampler
from rlt_sampling.speculative import Proposal, Verification

__all__ = [
    "MIN_TEMPERATURE",
    "HostSample",
    "Proposal",
    "Sampler",
    "Verification",
    "SamplerOutput",
    "SamplingBatch",
    "adjust_logits",
    "counter_gumbel",
    "counter_uniform",
    "lowbias32",
    "mask_min_p",
    "mask_top_k_top_p",
]
