"""Settings of the whole test session.

Bytecode caching. Some environments (this project's build machines among
them) set PYTHONDONTWRITEBYTECODE=1, so every Python process recompiles the
modules it imports from source: each snakemake job an integration test
starts then spends about 15 s of CPU compiling torch and transformers before
it does anything. The tests let Python cache bytecode (in `__pycache__`
folders, which git ignores), in this process and in every process it starts,
so that cost is paid once per checkout. Results do not depend on it.
"""

import os
import sys

import pytest

os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# The accountant memo (userdp.privacy.memo) is the pipeline's: tests compute every epsilon afresh, and the
# snakemake runs they start set their own (under their working directory) from the Snakefile.
os.environ.pop("USERDP_ACCOUNTING_MEMO", None)


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Every test starts with torch on one thread and leaves it so.

    The tests share 2 cores (tests/train_fixtures.py sets one thread); code under test may set more
    (userdp.training.finetune_job, the evaluate/pretrain scripts run in-process set the job's `threads`).
    Left at 2 on a busy machine, every later training test ran 10-40 times slower (test_train_engine's
    resume test: 0.9 s alone, 36 s after test_train_distributed).
    """
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    yield
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)
