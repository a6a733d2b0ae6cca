"""Deliberate bugs in a copy of the mechanism, for the white-box audit's mutation tests and power table.

Each mutation is a context manager that monkeypatches one piece of the real
mechanism (the engine, the clipping, the noise, the accounting path of
`userdp.evaluation.mechanism_audit`) for the duration of a run, so that the
audit runs exactly as on the honest mechanism and must notice the difference.
Test-only: nothing in the package imports this module.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from userdp.evaluation import mechanism_audit
from userdp.training import clipping, engine, noise, sampling, step

#: Accounting with the sampling rate divided by this (mutation "accounting_rate").
RATE_FACTOR = 4.0
#: Processes of the "noise_every_rank" mutation.
WORLD = 2


@contextlib.contextmanager
def honest() -> Iterator[None]:
    yield


@contextlib.contextmanager
def noise_halved() -> Iterator[None]:
    """(a) The noise the engine adds has half the calibrated standard deviation."""
    orig = noise.GaussianNoise.std
    with _patched(noise.GaussianNoise, "std", property(lambda self: 0.5 * orig.fget(self))):
        yield


@contextlib.contextmanager
def count_noise_dropped() -> Iterator[None]:
    """(h) Adaptive clipping releases its count without noise (the draw is made, and not added)."""
    orig = noise.GaussianNoise.draw
    with _patched(noise.GaussianNoise, "draw", lambda self, std: 0.0 * orig(self, std)):
        yield


@contextlib.contextmanager
def count_noise_halved() -> Iterator[None]:
    """(i) Adaptive clipping's count gets half its noise."""
    orig = noise.GaussianNoise.draw
    with _patched(noise.GaussianNoise, "draw", lambda self, std: orig(self, 0.5 * std)):
        yield


@contextlib.contextmanager
def clipping_skipped_for_one_unit() -> Iterator[None]:
    """(b) In every micro-batch, the first unit (lowest unit id) is not clipped: its factor is 1."""
    orig = clipping.ClippedGradients._clip_factors

    def factors(self, norms):
        f, drop = orig(self, norms)
        if f.numel():
            f = f.clone()
            f[0] = 1.0
        return f, drop

    with _patched(clipping.ClippedGradients, "_clip_factors", factors):
        yield


@contextlib.contextmanager
def accounting_rate_smaller() -> Iterator[None]:
    """(c) The accountant (and so the calibration) is given q / RATE_FACTOR while the sampler runs q."""
    orig = mechanism_audit.accounted_mechanism

    def accounted(method, sampling_rate, steps, group_size, bands=1):
        return orig(method, sampling_rate / RATE_FACTOR, steps, group_size, bands)

    with _patched(mechanism_audit, "accounted_mechanism", accounted):
        yield


@contextlib.contextmanager
def els_accounted_with_g1() -> Iterator[None]:
    """(d) ELS accounted with G = 1 while every user contributes G > 1 examples."""
    orig = mechanism_audit.accounted_mechanism

    def accounted(method, sampling_rate, steps, group_size, bands=1):
        return orig(method, sampling_rate, steps, 1 if method == "els" else group_size, bands)

    with _patched(mechanism_audit, "accounted_mechanism", accounted):
        yield


@contextlib.contextmanager
def noise_on_every_rank() -> Iterator[None]:
    """(e) Every rank adds noise, each from its own stream with std sigma C / W (as if the W draws added up
    to sigma C); the sum over ranks then has std sigma C / sqrt(W) instead of sigma C."""
    def privatize(self, sums):
        self.hook.before_noise(self.params, self.dist)
        world = self.dist.world_size if self.dist is not None and self.dist.active else 1
        rank = self.dist.rank if self.dist is not None else 0
        gen = torch.Generator().manual_seed(int(self.noise.generator.initial_seed()) + 7919 * (rank + 1)
                                            + 104729 * int(self.sampler.step))
        std = self.noise.std / world
        for p in self.params:
            p.grad.add_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.grad.dtype), alpha=std)
        if self.dist is not None and self.dist.active:
            engine.distributed.all_reduce_grads_of([p.grad for p in self.params], self.dist)
        sums = sums.summed_over_ranks(self.dist, self.ctx.device)
        for p in self.params:
            p.grad.div_(self.expected)
        return sums

    with _patched(step.DPStep, "privatize", privatize):
        yield


@contextlib.contextmanager
def divide_by_realised_size() -> Iterator[None]:
    """(f) The noisy sum is divided by the realised number of sampled units (at least 1), not by q N."""
    def call(self):
        sel = self.sample()
        sums = self.clipped_sum(sel)
        expected = self.expected
        self.expected = float(max(int(sel.n_units), 1))
        try:
            return sel, self.privatize(sums)
        finally:
            self.expected = expected

    with _patched(step.DPStep, "__call__", call):
        yield


@contextlib.contextmanager
def correlation_dropped() -> Iterator[None]:
    """(j) Banded DP-FTRL adds independent noise z_t (DP-SGD's) instead of the correlated C^-1 z."""
    with _patched(noise.BandedNoise, "add_", noise.GaussianNoise.add_):
        yield


#: The column norm the "band_coefficients_unnormalised" mutation leaves the strategy with.
UNNORMALISED = 1.25


@contextlib.contextmanager
def band_coefficients_unnormalised() -> Iterator[None]:
    """(k) Banded DP-FTRL's noise uses the strategy's coefficients scaled to column norm UNNORMALISED, not 1: the
    noise C'^-1 z is 1 / UNNORMALISED of the accounted one (a sensitivity the accountant did not assume)."""
    orig = noise.BandedNoise.__init__

    def init(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        self.coefficients = [UNNORMALISED * c for c in self.coefficients]

    with _patched(noise.BandedNoise, "__init__", init):
        yield


@contextlib.contextmanager
def cyclic_sampling_broken() -> Iterator[None]:
    """(l) Banded DP-FTRL's sampler ignores the partitions: every step samples every user at the within-partition
    rate p (PoissonSampler's draw), so a user takes part in up to b times the steps the accountant assumes."""
    with _patched(sampling.CyclicPoissonSampler, "sample", sampling.PoissonSampler.sample):
        yield


MUTATIONS = {
    "honest": honest,
    "noise_halved": noise_halved,
    "clipping_skipped_for_one_unit": clipping_skipped_for_one_unit,
    "accounting_rate_smaller": accounting_rate_smaller,
    "els_accounted_with_g1": els_accounted_with_g1,
    "noise_on_every_rank": noise_on_every_rank,
    "divide_by_realised_size": divide_by_realised_size,
    "count_noise_dropped": count_noise_dropped,
    "count_noise_halved": count_noise_halved,
    "correlation_dropped": correlation_dropped,
    "band_coefficients_unnormalised": band_coefficients_unnormalised,
    "cyclic_sampling_broken": cyclic_sampling_broken,
}


@contextlib.contextmanager
def _patched(owner, name: str, value) -> Iterator[None]:
    old = owner.__dict__[name] if name in owner.__dict__ else getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)
