"""Every use of dp-accounting's private internals, in one place, behind a version guard.

userdp's accountant is dp-accounting's: its PLD and RDP accountants, its
events, its PMFs. To be fast on the mixture-of-Gaussians events of ELS it
does a few of dp-accounting's steps on numpy arrays (userdp.privacy.pld_arrays,
accounting._self_compose_pmf) and so reads what dp-accounting keeps private:
a PLD's remove/add PMFs, a dense PMF's probabilities and grid, two of its
thresholds, the connect-the-dots PMF builder, and two RDP helpers. Those
names can change in any release, so they are read here only, and only for a
dp-accounting version whose results tests/test_pld_arrays.py and
tests/test_privacy_accounting.py have compared bit for bit: importing this
module with another version is an error that says what to install
(`TESTED_VERSIONS`; tests/test_structure.py checks that no other module of
the library reaches into dp-accounting's private names).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from ..errors import UserError

#: dp-accounting releases whose internals below were checked (pyproject.toml pins the first).
TESTED_VERSIONS = ("0.6.0",)


def check_version(installed: str | None = None) -> str:
    """The installed dp-accounting version; an UserError naming it and the fix when it is not tested."""
    version = installed if installed is not None else metadata.version("dp-accounting")
    if version not in TESTED_VERSIONS:
        raise UserError(
            f"dp-accounting {version} is installed, but userdp's accountant reads internals of dp-accounting "
            f"that were checked only for {', '.join(TESTED_VERSIONS)} (userdp/privacy/_dp_accounting_compat.py): "
            f"install the pinned version (pip install dp-accounting=={TESTED_VERSIONS[0]}), or check the new "
            "version with tests/test_pld_arrays.py and add it to TESTED_VERSIONS.")
    return version


VERSION = check_version()

#: Dictionaries of at most this many losses become sparse PMFs (dp-accounting's threshold).
MAX_PMF_SPARSE_SIZE: int = pld_pmf._MAX_PMF_SPARSE_SIZE
#: Deltas may rise by this much between neighbouring grid points before connect-the-dots refuses them.
DELTA_DIFF_TOLERANCE: float = pld_pmf._DELTA_DIFF_TOLERANCE


def pld_pmfs(pld: pld_lib.PrivacyLossDistribution) -> list[pld_pmf.PLDPmf]:
    """The PMFs of a PLD: [remove] when it is symmetric, else [remove, add]."""
    return [pld._pmf_remove] if pld._symmetric else [pld._pmf_remove, pld._pmf_add]


@dataclass(frozen=True)
class DenseParts:
    """The fields of a `DensePLDPmf`: probabilities on the grid lower_loss, lower_loss + 1, ... (times
    discretization), the mass at infinity and whether the estimate is pessimistic."""

    probs: np.ndarray
    discretization: float
    lower_loss: int
    infinity_mass: float
    pessimistic_estimate: bool


def dense_parts(pmf: pld_pmf.DensePLDPmf) -> DenseParts:
    return DenseParts(pmf._probs, pmf._discretization, pmf._lower_loss, pmf._infinity_mass,
                      pmf._pessimistic_estimate)


def dense_probs(pmf: pld_pmf.PLDPmf) -> np.ndarray | None:
    """A dense PMF's probability array, None for a sparse one."""
    return getattr(pmf, "_probs", None) if isinstance(pmf, pld_pmf.DensePLDPmf) else None


def library_connect_dots_pmf(loss, discretization: float) -> pld_pmf.PLDPmf:
    """dp-accounting's own pessimistic connect-the-dots PMF of a monotone privacy loss."""
    return pld_lib._create_pld_pmf_from_monotone_privacy_loss(
        loss, pessimistic_estimate=True, value_discretization_interval=discretization, use_connect_dots=True)


def rdp_repeat_and_select(orders: list[float], rdp: list[float], mean: float, shape: float) -> np.ndarray:
    """The RDP of a RepeatAndSelectDpEvent from its inner RDP (dp-accounting's own formula)."""
    return np.asarray(rdp_lib._compute_rdp_repeat_and_select(orders, rdp, mean, shape))


def gamma_truncated_negative_binomial(shape: float, mean: float) -> float:
    """The truncated negative binomial's gamma for `mean` and `shape`, as dp-accounting's RDP accountant
    derives it for a RepeatAndSelectDpEvent."""
    return float(rdp_lib._gamma_truncated_negative_binomial(shape, mean))
