"""Chat data through the real workflow: a local JSON Lines file of conversations, the chat model's own
tokenizer (with its chat template) and model, ELS and ULS fine-tuning and evaluation.

The examples travel as the JSON of their messages with the framing in examples.parquet's metadata;
tokens.parquet carries the loss mask (assistant tokens only), the pool and the evaluation read it.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import yaml

from test_chat_data import chat_checkpoint, conversation

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration


def test_chat_rows_train_and_evaluate_on_the_assistant_tokens(tmp_path):
    model_dir = chat_checkpoint(tmp_path / "my-chat-model")
    rng = np.random.default_rng(0)
    with open(tmp_path / "chats.jsonl", "w", encoding="utf-8") as fh:
        for u in range(160):
            for _ in range(int(rng.integers(1, 5))):
                fh.write(json.dumps({"author": f"u{u:03d}", "messages": conversation(rng)}) + "\n")
    config = {
        "seed": 0,
        "datasets": {"chats": {"source": "local", "path": str(tmp_path / "chats.jsonl"), "user_column": "author",
                               "messages_column": "messages", "split": {"validation": 0.15, "test": 0.15}}},
        "tokenizer": {"name": str(model_dir), "sequence_length": 48},
        "model": {"name": str(model_dir)},
        "grid": {"datasets": ["chats"], "methods": ["els", "uls"], "epsilons": [4],
                 "budgets": [{"compute": 240, "steps": 4}], "seeds": [0], "nonprivate": False,
                 "group_size_sweep": []},
        "privacy": {"group_size": {"els": 2, "uls": 2}},
        "training": {"learning_rates": [0.01], "physical_batch_size": 32, "threads": 1, "device": "cpu"},
        "evaluation": {"max_users": 20},
    }
    cfg = tmp_path / "chat.yaml"
    cfg.write_text(yaml.safe_dump(config))
    cells = [f"results/runs/chats/method~{m}/eps~4/budget~240/seed~0/metrics.json" for m in ("els", "uls")]
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path),
         "--configfile", str(cfg), "--replace-workflow-config", "--cores", "2", *cells],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    data = tmp_path / "results" / "data" / "chats"
    assert pq.read_schema(data / "examples.parquet").metadata[b"userdp_framing"] == b"messages"
    tokens = pq.read_table(data / "tokens.parquet")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    row = tokens.slice(0, 1).to_pylist()[0]
    ids, mask = np.array(row["input_ids"]), np.array(row["loss_mask"])
    # the targets of a stored conversation are its assistant message and end-of-turn marker
    assert tok.decode(ids[mask]).endswith("<|im_end|>\n") and "<|im_start|>" not in tok.decode(ids[mask])
    answers = int(sum(np.array(m)[1:].sum() for m in tokens.column("loss_mask").to_pylist()))
    everything = int(sum(n - 1 for n in tokens.column("n_tokens").to_pylist()))
    assert 0 < answers < everything
    for target in cells:
        cell = tmp_path / Path(target).parent
        ledger = json.loads((cell / "ledger.json").read_text())
        assert ledger["complete"] and ledger["epsilon"] <= 4 + 1e-9
        metrics = json.loads((cell / "metrics.json").read_text())
        loss = next(v for k, v in metrics.items() if k.endswith("test_loss") or k == "test_loss")
        assert math.isfinite(loss)
        # the evaluation scored the answer tokens of its test users, and nothing else
        scored = pq.read_table(cell / "lr~0.01" / "eval_users.parquet").to_pandas()
        rows = tokens.filter(pc.is_in(tokens["user_id"], value_set=pa.array(scored["user_id"].tolist())))
        rows = rows.filter(pc.equal(rows["split"], "test")).to_pydict()
        want = {u: 0 for u in scored["user_id"]}
        for u, m in zip(rows["user_id"], rows["loss_mask"]):
            want[u] += int(np.array(m)[1:].sum())
        assert dict(zip(scored["user_id"], scored["n_tokens"].astype(int))) == want
        eval_json = json.loads((cell / "lr~0.01" / "eval.json").read_text())
        assert eval_json["test_n_tokens"] == sum(want.values())
