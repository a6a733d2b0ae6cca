"""Test shorthands: accounting and calibration by method name, through the mechanism objects.

The library parses a method name once (`userdp.privacy.mechanism.get`) and
then works with `Mechanism` objects; tests that sweep methods by name use
these two functions instead of building the object at every call site.
"""

from __future__ import annotations

from userdp.privacy import mechanism
from userdp.privacy.calibration import calibrate


def mech(method: str, sampling_rate: float, steps: int, group_size: int = 1) -> mechanism.Mechanism:
    """The mechanism of `method` ('els', 'uls' or the comparison baseline 'group')."""
    return mechanism.get(method, comparison=True)(sampling_rate, steps, group_size)


def epsilon_of(method: str, noise_multiplier: float, sampling_rate: float, steps: int, delta: float,
               group_size: int = 1, **kwargs) -> float:
    """Epsilon of `steps` steps of `method` at noise multiplier sigma (kwargs: discretization, extra_events)."""
    return mech(method, sampling_rate, steps, group_size).epsilon(noise_multiplier, delta, **kwargs)


def calibrate_method(method: str, epsilon: float, delta: float, sampling_rate: float, steps: int,
                     group_size: int = 1, **kwargs):
    """`calibrate` of the mechanism of `method` (kwargs: tolerance, max_noise_multiplier, cell, extra_events, ...)."""
    return calibrate(mech(method, sampling_rate, steps, group_size), epsilon, delta, **kwargs)
