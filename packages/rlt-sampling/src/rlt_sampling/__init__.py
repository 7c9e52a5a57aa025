"""Token sampling (module M7): logits -> tokens, batched on the device, with counter-based noise.

Greedy, temperature, top-k and top-p per row; the random stream of a request is a pure function
of (seed, output index), so the sampler keeps no state and preemption never reseeds a request.
"""

from rlt_sampling.batch import MIN_TEMPERATURE, SamplingBatch
from rlt_sampling.filtering import mask_top_k_top_p
from rlt_sampling.noise import counter_gumbel, counter_uniform, lowbias32
from rlt_sampling.output import HostSample, SamplerOutput
from rlt_sampling.sampler import Sampler

__all__ = [
    "MIN_TEMPERATURE",
    "HostSample",
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "counter_gumbel",
    "counter_uniform",
    "lowbias32",
    "mask_top_k_top_p",
]
