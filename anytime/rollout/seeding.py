"""Placement-invariant random streams: every sampled sequence draws its randomness from its own seed,
derived from the step's seed and the request's *global* index, never from which worker, batch or
position in a batch served it. So 1 or N rollout workers, and every placement, sample the same
tokens for the same recipe and seed.

`request_seeds` gives one seed per request (a prompt, or a summary branch); engines derive one
stream per sample of a request from it. The transformers engine draws its uniforms from a
counter-based generator (SplitMix64 of seed and token position), which needs no state per row and
gives the same numbers on every machine.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def request_seeds(seed: int, indices: Sequence[int]) -> list[int]:
    """One 63-bit seed per request from (call seed, global request index)."""
    return [int(np.random.SeedSequence([seed & (2**63 - 1), int(i)]).generate_state(1, np.uint64)[0] >> 1)
            for i in indices]


def sample_seeds(seeds: Sequence[int], n: int) -> np.ndarray:
    """Seeds of the n samples of each request, request-major ([len(seeds) · n] uint64)."""
    base = np.repeat(np.asarray(seeds, dtype=np.uint64), n)
    k = np.tile(np.arange(n, dtype=np.uint64), len(seeds))
    return _splitmix64(base + (k + np.uint64(1)) * _GOLDEN)


def uniforms(seeds: np.ndarray, position: int) -> np.ndarray:
    """U[0, 1) of each stream at a token position (float64, 53 random bits)."""
    with np.errstate(over="ignore"):
        x = _splitmix64(seeds + np.uint64(position + 1) * _MIX1)
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _MIX1
        x = (x ^ (x >> np.uint64(27))) * _MIX2
        return x ^ (x >> np.uint64(31))
