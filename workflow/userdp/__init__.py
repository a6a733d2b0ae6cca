"""userdp: user-level differentially private fine-tuning of language models.

The public API (docs/api.md) is importable from here: `userdp.fine_tune`,
`userdp.plan`, `userdp.epsilon`, `userdp.load_released`, `userdp.read_ledger`,
`userdp.audit_mechanism`, `userdp.evaluate`,
`userdp.RunSpec`, `userdp.FineTuneResult` and the error types. They load on
first use, so `import userdp` stays light (the Snakefile imports the package
to parse its rules). Behind them: data loading and user grouping
(`userdp.data`), privacy accounting and planning (`userdp.privacy`), the DP
training engine (`userdp.training`), evaluation (`userdp.evaluation`), the
synthetic studies (`userdp.experiments`) and figures (`userdp.plotting`).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

#: Public name -> the module that defines it (docs/api.md lists each with its purpose).
_EXPORTS = {
    "audit_mechanism": "userdp.api",
    "evaluate": "userdp.api",
    "EvaluationResult": "userdp.api",
    "fine_tune": "userdp.api",
    "plan": "userdp.api",
    "epsilon": "userdp.api",
    "load_released": "userdp.api",
    "read_ledger": "userdp.api",
    "FineTuneResult": "userdp.api",
    "RunSpec": "userdp.privacy.spec",
    "UserLevelAccountant": "userdp.privacy.accounting",
    "make_private": "userdp.private_training",
    "PrivateTraining": "userdp.training.private",
    "StepStats": "userdp.training.private",
    "PrivacyArguments": "userdp.arguments",
    "TrainingOptions": "userdp.arguments",
    "UserDPTrainer": "userdp.trainer",
    "UserDPSFTTrainer": "userdp.sft_trainer",
    "UserError": "userdp.errors",
    "ConfigError": "userdp.errors",
    "DataError": "userdp.errors",
    "PrivacyError": "userdp.errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use (PEP 562)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'userdp' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
