"""Counter-based random noise: a pure function of (seed, counter, token id); no generator state.

The uniform for row n and token v is

    key[n]     = lowbias32(lowbias32(lowbias32(seed_lo ^ SEED_DOMAIN) ^ (seed_hi ^ counter_hi))
                           ^ counter_lo)                                   ([N], 32-bit)
    word[v]    = lowbias32(v ^ TOKEN_DOMAIN)                               ([V])
    bits[n, v] = lowbias32(key[n] ^ word[v])                               ([N, V], 32-bit)
    u[n, v]    = ((bits >> 8) | 1) / 2**24                (fp32, odd multiples of 2**-24 in (0, 1))

with x_lo / x_hi the low / high 32 bits of x. lowbias32 is Chris Wellons' 32-bit avalanche hash,
a bijection of [0, 2**32). The last key round is a bijection of counter_lo, so one seed never maps
two counters below 2**32 to the same key: a request's successive tokens always get distinct noise.
(counter_hi shares a word with seed_hi, where it is 0 for any realistic output length.)

Why no signed overflow: all words live in int64 tensors with values in [0, 2**32). A 32x32-bit
multiply modulo 2**32 is split on the constant (c = c_hi * 2**16 + c_lo), so every partial product
is below 2**48 and the high part is masked to 16 bits before it is shifted up by 16.

Why (0, 1) strictly: (bits >> 8) | 1 is an odd integer below 2**24, which fp32 holds exactly
(24-bit significand), so u ranges over 2**-24 .. 1 - 2**-24 in steps of 2**-23 (2**23 equally
likely values): log(u) and log(-log(u)) stay finite.

Cost: the [N, V] part is ~25 elementwise int64/fp32 kernels (the first xorshift of the last
lowbias32 is applied to key and word separately, since x >> 16 distributes over XOR).
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
SEED_DOMAIN = 0x9E3779B9  # separates the key chain from the token words (golden-ratio constant)
TOKEN_DOMAIN = 0x85EBCA6B
STATE_DOMAIN = 0xC2B2AE35  # a family's random initial state: words apart from token noise
_LOWBIAS32_MUL1 = 0x7FEB352D
_LOWBIAS32_MUL2 = 0x846CA68B
_UNIFORM_BITS = 24


def lowbias32(words: torch.Tensor) -> torch.Tensor:
    """lowbias32 of each element; `words` is int64 with values in [0, 2**32) on any device.

    Returns a new int64 tensor of the same shape/device with values in [0, 2**32); the input is
    not modified.
    """
    return _lowbias32_after_first_xorshift_(_xorshift16(words))


def _xorshift16(words: torch.Tensor) -> torch.Tensor:
    return words ^ (words >> 16)


def _lowbias32_after_first_xorshift_(hashed: torch.Tensor) -> torch.Tensor:
    """In place: the rest of lowbias32 on words that already had `x ^= x >> 16` applied."""
    _mul_mod32_(hashed, _LOWBIAS32_MUL1)
    hashed ^= hashed >> 15
    _mul_mod32_(hashed, _LOWBIAS32_MUL2)
    hashed ^= hashed >> 16
    return hashed


def _mul_mod32_(words: torch.Tensor, constant: int) -> torch.Tensor:
    """In place: words = (words * constant) mod 2**32, without any int64 product reaching 2**63."""
    constant_hi, constant_lo = constant >> 16, constant & 0xFFFF
    high_part = (words * constant_hi).bitwise_and_(0xFFFF).bitwise_left_shift_(16)  # < 2**32
    return words.mul_(constant_lo).add_(high_part).bitwise_and_(MASK32)


def row_keys(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """32-bit stream key of each row: int64 [N] from seed int64 [N] (>= 0) and counter int64 [N]
    (>= 0). Same device as the inputs."""
    key = lowbias32((seed & MASK32) ^ SEED_DOMAIN)
    key = lowbias32(key ^ (((seed >> 32) ^ (counter >> 32)) & MASK32))
    return lowbias32(key ^ (counter & MASK32))


def counter_uniform(
    seed: torch.Tensor, counter: torch.Tensor, vocab_size: int, *, domain: int = TOKEN_DOMAIN
) -> torch.Tensor:
    """Uniforms fp32 [N, vocab_size] strictly inside (0, 1), on the device of `seed`.

    Element [n, v] depends only on (seed[n], counter[n], v): never on N, on other rows or on any
    generator state. `domain` separates streams of one (seed, counter): token noise
    (TOKEN_DOMAIN), a family's initial state (STATE_DOMAIN, counter = the token's position).
    """
    token_words = lowbias32(
        torch.arange(vocab_size, dtype=torch.int64, device=seed.device) ^ domain
    )
    keys = row_keys(seed, counter)
    # lowbias32(key ^ word), its first xorshift split over the XOR: (a ^ b) >> 16 == a>>16 ^ b>>16.
    bits = _lowbias32_after_first_xorshift_(
        _xorshift16(keys)[:, None] ^ _xorshift16(token_words)[None, :]
    )
    odd_numerators = bits.bitwise_right_shift_(32 - _UNIFORM_BITS).bitwise_or_(1)
    return odd_numerators.to(torch.float32).mul_(2.0**-_UNIFORM_BITS)


def counter_gumbel(seed: torch.Tensor, counter: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise fp32 [N, vocab_size]: -log(-log(u)) of `counter_uniform`. Finite,
    within about [-2.8, 16.6]."""
    return counter_uniform(seed, counter, vocab_size).log_().neg_().log_().neg_()
