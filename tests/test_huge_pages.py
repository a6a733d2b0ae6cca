"""The workflow turns on torch's huge-page allocation (THP_MEM_ALLOC_ENABLE, workflow/rules/common.smk) for
speed only: a forward and backward pass with tensors of several MB gives the same bits with it on and off."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_STEP = r"""
import hashlib, json, torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
torch.set_num_threads(1)
model = GPT2LMHeadModel(GPT2Config(vocab_size=4000, n_positions=64, n_embd=64, n_layer=2, n_head=2))
ids = torch.randint(0, 4000, (16, 64))
out = model(input_ids=ids, labels=ids)  # logits: 16 x 64 x 4000 floats, 16 MB
huge = 0
with open("/proc/self/smaps_rollup") as fh:  # while the logits are alive
    for line in fh:
        if line.startswith("AnonHugePages:"):
            huge = int(line.split()[1])
loss = out.loss
loss.backward()
h = hashlib.sha256()
for p in model.parameters():
    h.update(p.grad.numpy().tobytes())
print(json.dumps({"loss": loss.item(), "grads": h.hexdigest(), "huge_kb": huge}))
"""


def _run(flag: str) -> dict:
    env = dict(os.environ, THP_MEM_ALLOC_ENABLE=flag, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", _STEP], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text.split("[")[1].split("]")[0]


def test_workflow_turns_huge_pages_on_by_default_and_lets_the_environment_decide():
    common = (ROOT / "workflow/rules/common.smk").read_text()
    assert 'os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")' in common


@pytest.mark.helper_process  # two fresh interpreters (the allocator reads the variable once per process)
@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux /proc")
def test_same_gradients_with_and_without_huge_pages():
    on, off = _run("1"), _run("0")
    assert (on["loss"], on["grads"]) == (off["loss"], off["grads"])
    if _thp_mode() != "never":
        assert on["huge_kb"] > 0  # the setting took effect: the comparison is not between two equal runs
