"""Fine-tuning runs (rule finetune): in this process, or in several under torchrun.

`run_job(job)` loads one run's inputs (bounded pool, tokenizer, base model,
plan) and calls `engine.train`. `launch(job, processes)` does that in this
process when `processes` <= 1, and otherwise writes the job to a JSON file
in the run folder and starts `processes` data-parallel workers with torchrun,
each running `python -m userdp.training.finetune_job --job FILE` (see
`userdp.training.distributed` for how they share a step). `launch_sweep`
launches the runs of a cell's learning rates one after the other: one job of
rule finetune. The Snakemake script only builds the jobs from its `snakemake`
object and calls `launch_sweep`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import Preempted, run_main
from ..layout import EVAL, RUN_MODEL
from ..privacy import seed_secrecy
from ..privacy.spec import RunSpec
from ..seeding import derive_seed
from . import distributed, engine, models, pool, run_seeds, run_state
from .model_card import CARD
from .settings import TrainSettings

log = logging.getLogger(__name__)

WORKER_MODULE = "userdp.training.finetune_job"


@dataclass
class FinetuneJob:
    """Everything one fine-tuning run needs, as plain (JSON-serialisable) values."""

    config: dict[str, Any]   # the validated config
    plan: str                # plan.json path
    tokens: str              # tokens.parquet path
    tokenizer: str           # tokenizer.json path (or its folder)
    model: str               # base model name or folder
    run_dir: str             # where ledger.json, train_log.parquet and model/ go
    learning_rate: float
    dataset: str
    method: str
    eps: str
    budget: str
    seed: int
    threads: int = 1
    log: str | None = None   # the rule's log file
    trial: int | None = None  # the run's index in a random-stopping cell (part of its seeds), else None
    option: str | None = None  # the grid.options entry of the run's cell (part of its seeds), else None
    audit: bool = False      # a run of the membership audit (rule audit_finetune): its own seeds


def clear_stale_outputs(run_dir: Path) -> None:
    """Remove what an earlier model of this run folder left: snakemake deletes only the declared outputs before
    rerunning the job, so the model folder's other files (generation_config.json, ...) and the evaluation of the
    old model (eval.json) would otherwise sit next to a run that failed or has not finished."""
    model_dir = run_dir / RUN_MODEL  # snakemake creates it (empty) for the outputs: only files in it are stale
    stale = [p for p in (model_dir, run_dir / EVAL, run_dir / CARD) if p.is_file() or (p.is_dir() and any(p.rglob("*")))]
    for p in stale:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    if stale:
        log.info("removed %s: left by an earlier model of this run", ", ".join(str(p) for p in stale))


def bounding_seed(config_seed: int, dataset: str, run_seed: int, group_size: int) -> int:
    """The seed of the bounded subset (each user's G examples): it depends on the dataset, G and the run seed
    only, so ELS and ULS runs with the same G see the same examples."""
    return derive_seed(config_seed, dataset, int(run_seed), int(group_size), "bounding")


@dataclass
class RunInputs:
    """One run's loaded inputs (the pipeline's job and userdp.fine_tune build the same): its spec, bounded pool,
    tokenizer, base model name, run folder, cell and learning rate, and where its seeds come from."""

    config: dict[str, Any]
    spec: RunSpec
    pool: pool.TrainingPool
    tokenizer: Any
    model: str
    run_dir: str
    learning_rate: float
    dataset: str
    method: str
    eps: str
    budget: int | str
    seed: int
    secret: bool
    log: str | None = None
    trial: int | None = None
    option: str | None = None  # the grid.options entry of the run's cell (part of its seeds)
    audit: bool = False  # a run of the membership audit (part of its seeds)
    lora: Any = None  # a peft LoraConfig given to userdp.fine_tune (used instead of model.lora), or None


def train_run(run: RunInputs, dist: distributed.DistContext | None = None) -> engine.TrainOutcome:
    """Fine-tune the base model on the pool with the spec's mechanism (engine.train) into the run folder."""
    config = run.config
    lora = run.lora if run.lora is not None else config["model"].get("lora")
    model = models.load_model(run.model)
    models.check_model_fits(model, run.model, run.tokenizer, config["tokenizer"]["sequence_length"])
    # LoRA adapters when `lora` is set: only they train; their init is public (lora_B = 0)
    model = models.apply_lora(model, lora, derive_seed(config["seed"], "lora_init"))
    settings = TrainSettings.from_config(config, float(run.learning_rate))
    seeds = run_seeds.run_seeds(config["seed"], int(run.seed), run.dataset, run.method, run.eps, run.budget,
                             run.spec.group_size, float(run.learning_rate), secret=run.secret, trial=run.trial,
                                option=run.option, audit=run.audit)
    pad_id = models.special_ids(run.tokenizer)["pad_token_id"]
    return engine.train(model, run.pool, run.spec, settings, run_state.RunPaths(run.run_dir, run.log), seeds, pad_id,
                        dist=dist)


def run_job(job: FinetuneJob, dist: distributed.DistContext | None = None) -> engine.TrainOutcome:
    """Load the inputs and train (one process, or this rank of a data-parallel group)."""
    config = job.config
    if dist is None or dist.is_main:
        clear_stale_outputs(Path(job.run_dir))
    spec = RunSpec.load(job.plan)
    seed = bounding_seed(config["seed"], job.dataset, job.seed, spec.group_size)
    train_pool = pool.load_train_pool(job.tokens, spec.group_size, seed)  # streamed: tokens of kept rows only
    tokenizer = models.load_tokenizer(job.tokenizer)  # tokenizer.json or its folder
    outcome = train_run(RunInputs(
        config=config, spec=spec, pool=train_pool, tokenizer=tokenizer, model=job.model, run_dir=job.run_dir,
        learning_rate=job.learning_rate, dataset=job.dataset, method=job.method, eps=job.eps, budget=job.budget,
        seed=job.seed, secret=seed_secrecy.secret_seeds(config, job.dataset), log=job.log, trial=job.trial,
        option=job.option, audit=job.audit,
    ), dist)
    if not outcome.complete:
        raise RuntimeError(f"run stopped at step {outcome.steps_completed}/{spec.steps}")
    return outcome


def launch(job: FinetuneJob, processes: int) -> None:
    """Run `job` here (processes <= 1) or in `processes` data-parallel torchrun workers.

    Each worker gets max(1, threads // processes) CPU threads, so the job never
    uses more cores than the rule's `threads` reserved.
    """
    processes = int(processes or 0)
    if processes <= 1:
        torch.set_num_threads(max(1, int(job.threads)))
        run_job(job)
        return
    per_rank = max(1, int(job.threads) // processes)
    run_dir = Path(job.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd, spec = tempfile.mkstemp(prefix=".finetune-job-", suffix=".json", dir=run_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(asdict(job) | {"threads": per_rank}, fh)
        distributed.launch_torchrun(processes, WORKER_MODULE, ["--job", spec], threads_per_process=per_rank)
    finally:
        os.unlink(spec)


def launch_sweep(jobs: list[FinetuneJob], processes: int) -> None:
    """Run the jobs of one cell (its learning rates) one after the other in this job (`launch` each).

    One process start-up (imports, the tokenizer's and transformers' code) serves every rate; each run still
    loads its own inputs and seeds itself from its own learning rate (`run_seeds.run_seeds`), so a run's model,
    ledger and log are those it would have as the only rate (tests/test_train_sweep.py). A run that finished
    before (its finished/ record) is restored instead of trained. The first failure stops the job, and so does
    a SIGTERM (SLURM's preemption and time-limit signal): a run in progress saves its checkpoint and exits 143
    (engine.train raises errors.Preempted, which the job turns into that exit code), and one that arrives while
    a run completes, or between runs, raises Preempted before the next run starts (in one process; under
    torchrun the workers handle it).
    """
    # Records a SIGTERM between runs; while a run trains, the engine's handler takes over and passes it on.
    with engine.StopOnSigterm(enabled=processes <= 1 and len(jobs) > 1) as stop:
        for i, job in enumerate(jobs, 1):
            if stop.requested:
                log.warning("SIGTERM: stopping before learning rate %d/%d (%s); the finished runs are recorded, "
                            "the rerun restores them and trains the rest", i, len(jobs), job.learning_rate)
                raise Preempted(f"SIGTERM before learning rate {i}/{len(jobs)}")
            if len(jobs) > 1:
                log.info("learning rate %d/%d: %s -> %s", i, len(jobs), job.learning_rate, job.run_dir)
            launch(job, processes)


def _worker_logging(log_path: str | None, rank: int) -> None:
    """Rank 0 appends INFO to the rule's log (the launcher already opened it); other ranks errors only.

    Every rank runs the same code on the same data, so rank 0's messages speak
    for all of them; a failure is logged by whichever rank hits it.
    """
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_path:
        handlers.append(logging.FileHandler(log_path, mode="a", encoding="utf-8"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.ERROR,
        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s",
        handlers=handlers,
        force=True,
    )


def main(argv: list[str] | None = None) -> None:
    """Worker entry under torchrun: `python -m userdp.training.finetune_job --job FILE`."""
    parser = argparse.ArgumentParser(prog=WORKER_MODULE, description="One data-parallel fine-tuning worker.")
    parser.add_argument("--job", required=True, help="JSON file written by finetune_job.launch")
    args = parser.parse_args(argv)
    with open(args.job, encoding="utf-8") as fh:
        job = FinetuneJob(**json.load(fh))
    _worker_logging(job.log, int(os.environ.get("RANK", "0")))
    torch.set_num_threads(max(1, int(job.threads)))
    ctx = distributed.init_from_env(job.config["training"]["device"])
    try:
        run_main(lambda: run_job(job, ctx), logging.getLogger("userdp"))
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    main()
