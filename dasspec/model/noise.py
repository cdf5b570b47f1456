"""Counter-based noise: pure functions of (seed, absolute position, index), identical on every device and for
every way a position is computed (alone in an AR step or inside a wide verifier block), so AR and every
speculative method draw the same value for the same position.

* ``position_noise``: the initial state of a position (truncated standard normal per channel);
* ``gumbel_noise``: the Gumbel perturbation that samples the token after a position (per vocabulary entry).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF
_TRUNC = 3.0                                   # initial states are truncated at +-3 std, as in Huginn's like-init
_PHI_LO = 0.5 * math.erfc(_TRUNC / math.sqrt(2))  # Phi(-3)


def _hash32(x: Tensor) -> Tensor:
    """A 32-bit integer mix (int64 arithmetic, masked so no product overflows) - identical on every device."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def seed_key(seed: int, stream: int = 0) -> int:
    """The 32-bit key of a seed of any width: its low word (xor ``stream``) mixed as it always was - a seed in
    [0, 2^32) keeps its noise - then every higher word folded in, and the sign, so seeds that differ only above
    bit 31 (or in sign) draw different noise."""
    key = _hash32((seed ^ stream) & _MASK32)
    rest = (seed if seed >= 0 else ~seed) >> 32
    while rest:
        key = _hash32(key ^ (rest & _MASK32))
        rest >>= 32
    return _hash32(key ^ _NEGATIVE) if seed < 0 else key


_NEGATIVE = 0x7F4A7C15


def position_noise(positions: Tensor, dim: int, seed: int) -> Tensor:
    """Standard normal truncated to [-3, 3], a pure function of (seed, absolute position, channel): AR and every
    speculative decoder draw the same initial state for the same position."""
    s = torch.tensor(seed_key(seed), dtype=torch.int64, device=positions.device)
    ctr = (positions.to(torch.int64)[:, None] * dim + torch.arange(dim, device=positions.device)) & _MASK32
    bits = _hash32(_hash32(ctr ^ s) + 0x9E3779B9 & _MASK32)
    u = ((bits >> 8).to(torch.float64) + 0.5) / float(1 << 24)          # uniform in (0, 1)
    p = _PHI_LO + u * (1.0 - 2.0 * _PHI_LO)
    return (math.sqrt(2.0) * torch.erfinv(2.0 * p - 1.0)).to(torch.float32)


_GUMBEL_STREAM = 0x5DEECE66D                   # keeps the sampling noise independent of the initial-state noise
_NOISE_BLOCK = 1 << 17          # int64 values per block of rows (1 MB): a row at a time for a large vocabulary


def gumbel_noise(positions: Tensor, vocab: int, seed: int) -> Tensor:
    """Standard Gumbel noise [len(positions), vocab] (float32), a pure function of (seed, position, token id).

    Rows of one position (a tree's siblings) share their noise, so each distinct position is drawn once; the draw
    runs a block of rows at a time, in place, so its int64 intermediates stay in cache (a 166,144-id vocabulary's
    row is 1.3 MB of them): the bits are the formula's, op for op."""
    positions = positions.to(torch.int64)
    if positions.numel() > 1:
        uniq, inv = torch.unique(positions, return_inverse=True)
        if uniq.numel() < positions.numel():
            return gumbel_noise(uniq, vocab, seed)[inv]
    s = torch.tensor(seed_key(seed, _GUMBEL_STREAM), dtype=torch.int64, device=positions.device)
    row = _hash32((positions ^ s) & _MASK32)                                  # one key per position
    ids = torch.arange(vocab, device=positions.device)
    out = torch.empty(len(positions), vocab, dtype=torch.float32, device=positions.device)
    step = max(1, _NOISE_BLOCK // max(vocab, 1))
    for i in range(0, len(positions), step):
        bits = _hash32_(row[i: i + step, None] ^ ids)
        bits = _hash32_(bits.add_(0x9E3779B9).bitwise_and_(_MASK32))
        u = bits.to(torch.float64).add_(0.5).div_(float(1 << 32))            # uniform in (0, 1)
        out[i: i + step] = u.log_().neg_().log_().neg_()                      # -log(-log u), rounded once
    return out


def _hash32_(x: Tensor) -> Tensor:
    """``_hash32`` in place (x is consumed): the same integer mix, without a fresh tensor per operation."""
    for _ in range(2):
        x.bitwise_xor_(x >> 16).mul_(0x45D9F3B).bitwise_and_(_MASK32)
    return x.bitwise_xor_(x >> 16)
