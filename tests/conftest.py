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

os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# The accountant memo (userdp.privacy.memo) is the pipeline's: tests compute every epsilon afresh, and the
# snakemake runs they start set their own (under their working directory) from the Snakefile.
os.environ.pop("USERDP_ACCOUNTING_MEMO", None)
