"""Benchmark: a cell's learning-rate sweep in one process per stage, vs a process per run.

Rule `finetune` trains every learning rate of a cell in one process
(userdp.training.finetune_job.launch_sweep) and then evaluates every run in
the same process (userdp.evaluation.metrics.evaluate_runs). Before
training.sweep_jobs, each rate was its own training job and its own
evaluation job, and each paid Python's, torch's and transformers' start-up and
the input loading again. This script times the sweep both ways on the same
cell, in the same run, keeping training and evaluation in separate processes
in both forms (so it measures what the sweep in one process saves, not what
evaluating in the training process saves on top: docs/performance.md, "Issue
37"); a fresh Python process per step:

* per run: for each rate, one process trains it and one evaluates it;
* per cell: one process trains every rate, one evaluates every model.

It prints the seconds of each form, the ratio per run / per cell, and
whether both forms trained bit-identical models (each rate has its own seeds,
so they must). The inputs (data, tokenizer, pretrained model, the cell's plan)
come from the pipeline: the script runs `snakemake` for them in --workdir
(default: a new temporary folder, with the embedded default config).

    .venv/bin/python benchmarks/bench_sweep_jobs.py [--workdir DIR] [--rates 0.001,0.003] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CELL = {"dataset": "synth", "method": "els", "eps": "1", "budget": "8000", "seed": 0}

TRAIN = """
import json, sys, torch
from userdp.training import finetune_job
torch.set_num_threads(1)
jobs = [finetune_job.FinetuneJob(**j) for j in json.load(open(sys.argv[1]))]
finetune_job.launch_sweep(jobs, processes=0)
"""
EVALUATE = """
import json, sys, torch
from userdp.evaluation.metrics import evaluate_models
torch.set_num_threads(1)
spec = json.load(open(sys.argv[1]))
evaluate_models(spec["models"], spec["tokens"], dataset=spec["dataset"], root_seed=0, max_users=spec["max_users"],
                batch_size=64, device="cpu")
"""


def _inputs(workdir: Path, config: dict) -> dict[str, str]:
    from userdp import layout

    paths = {
        "plan": layout.PLAN.format(**CELL),
        "tokens": layout.TOKENS.format(dataset=CELL["dataset"]),
        "tokenizer": layout.TOKENIZER,
        "model": layout.PRETRAINED,
    }
    targets = [paths["plan"], paths["tokens"], paths["tokenizer"], f"{layout.PRETRAINED}/{layout.MODEL_WEIGHTS}"]
    if not all((workdir / t).exists() for t in targets):
        print("building the inputs with snakemake ...", flush=True)
        subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory",
                        str(workdir), "--cores", "2", *targets, "--configfile", str(REPO / "config" / "config.yaml"),
                        "--quiet", "all"], check=True)
    return {k: str(workdir / v) for k, v in paths.items()}


def _run(code: str, spec: object, cwd: Path) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(spec, fh)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, fh.name], check=True, cwd=cwd,
                   env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"))
    elapsed = time.perf_counter() - t
    os.unlink(fh.name)
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, default=None, help="pipeline working folder (default: a new temp folder)")
    ap.add_argument("--rates", default="0.001,0.003", help="learning rates of the sweep (comma-separated)")
    ap.add_argument("--repeats", type=int, default=2, help="alternating repetitions of both forms")
    args = ap.parse_args()
    from userdp.config import load_config
    from userdp.layout import fmt_num

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_sweep_"))
    workdir.mkdir(parents=True, exist_ok=True)
    config = load_config(REPO / "config" / "config.yaml")
    rates = [float(r) for r in args.rates.split(",")]
    inputs = _inputs(workdir, config)
    max_users = int(config["evaluation"]["max_users"])

    def jobs(root: Path) -> list[dict]:
        return [dict(config=config, **inputs, run_dir=str(root / f"lr~{fmt_num(lr)}"), learning_rate=lr,
                     dataset=CELL["dataset"], method=CELL["method"], eps=CELL["eps"], budget=CELL["budget"],
                     seed=CELL["seed"], threads=1) for lr in rates]

    def evaluation(js: list[dict]) -> dict:
        return {"models": [f"{j['run_dir']}/model" for j in js], "tokens": inputs["tokens"],
                "dataset": CELL["dataset"], "max_users": max_users}

    times: dict[str, list[float]] = {"per run": [], "per cell": []}
    models: dict[str, list[bytes]] = {}
    for _ in range(args.repeats):
        for form in times:
            root = workdir / "bench_sweep" / form.replace(" ", "_")
            shutil.rmtree(root, ignore_errors=True)  # nothing restored from an earlier repetition
            js = jobs(root)
            if form == "per run":
                t = sum(_run(TRAIN, [j], workdir) + _run(EVALUATE, evaluation([j]), workdir) for j in js)
            else:
                t = _run(TRAIN, js, workdir) + _run(EVALUATE, evaluation(js), workdir)
            times[form].append(t)
            models[form] = [(Path(j["run_dir"]) / "model" / "model.safetensors").read_bytes() for j in js]
    best = {form: min(ts) for form, ts in times.items()}
    print(f"{len(rates)} learning rates, cell {CELL['method']} eps {CELL['eps']} K {CELL['budget']}, "
          f"{args.repeats} repetitions (best of each)")
    for form, t in best.items():
        print(f"  {form:9s} {t:7.1f} s   (all: {', '.join(f'{x:.1f}' for x in times[form])})")
    print(f"  ratio per run / per cell: {best['per run'] / best['per cell']:.2f}")
    print(f"  models bit-identical: {models['per run'] == models['per cell']}")


if __name__ == "__main__":
    main()
