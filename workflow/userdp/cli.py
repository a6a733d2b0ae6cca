"""`python -m userdp` (or `userdp`): the library's one-off tools.

    userdp epsilon   --method els --noise-multiplier 1.1 --sampling-rate 0.01 --steps 1000 --group-size 8 --delta 1e-6
    userdp calibrate --method els --epsilon 4 --delta 1e-6 --sampling-rate 0.01 --steps 1000 --group-size 8
    userdp calibrate --method uls --epsilon 4 --delta 1e-6 --sampling-rate 0.01 --steps 1000 --selection composed --runs 3
    userdp export-merged RUN_FOLDER/model merged/   (a LoRA run's adapter merged into its base model)
    userdp check-config my.yaml [more.yaml ...]
    userdp audit-mechanism --configfile my.yaml [--method els|uls] [--epsilon E] [--json]
    userdp run --cores 2 --configfile my.yaml results/data/mine/contributions.json   (snakemake, targets first)

--selection says what the epsilon is of: one run (default), the released
model chosen among --runs learning-rate runs composed (the pipeline's
default), or private selection by random stopping (--mean-runs, --shape).

`--json` prints one JSON object with the plan's field names (docs/artifacts.md, "Command line").
Invalid arguments exit with status 2 and a message naming the argument.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Sequence

from .errors import UserError
from .io import json_text


def _number(ok, not_a_number: str, out_of_range: str, convert=float):
    """An argparse type: the number (`convert`) of the text when ok(value), else the error that says which of the
    two failed."""
    def parse(text: str) -> float:
        try:
            v = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{not_a_number}, got {text!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"{out_of_range}, got {text!r}")
        return v

    return parse


def _positive_float(name: str, allow_inf: bool = False):
    return _number(lambda v: v > 0 and (allow_inf or math.isfinite(v)), f"{name} must be a number",
                  f"{name} must be a number > 0{' (or inf)' if allow_inf else ''}")


_rate = _number(lambda v: 0 < v <= 1, "sampling rate must be a number in (0, 1]", "sampling rate must be in (0, 1]")
_delta = _number(lambda v: 0 < v < 1, "delta must be a number in (0, 1)", "delta must be in (0, 1), e.g. 1e-6")
_noise = _number(lambda v: v >= 0 and math.isfinite(v), "noise multiplier must be a number >= 0",
                "noise multiplier must be a finite number >= 0")


def _int_at_least(name: str, minimum: int):
    wanted = f"{name} must be a whole number >= {minimum}"
    return _number(lambda v: v >= minimum, wanted, wanted, convert=int)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="userdp", description="User-level DP tools: accounting and calibration, "
                                "config checks, running the workflow (run).")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--method", required=True, choices=["els", "uls", "group", "group_rdp"],
            help="els: tight user-level accountant of DP-SGD-ELS; uls: DP-SGD-ULS; "
            "group / group_rdp: ELS by group privacy from the example-level PLD / RDP guarantee (comparison only)",
        )
        sp.add_argument("--sampling-rate", required=True, type=_rate, help="q (ELS, examples) or q_u (ULS, users), in (0, 1]")
        sp.add_argument("--steps", required=True, type=_int_at_least("steps", 1), help="T, the number of noisy steps")
        sp.add_argument("--group-size", type=_int_at_least("group size", 1), default=1, help="G, examples per user (default 1)")
        sp.add_argument("--delta", required=True, type=_delta, help="delta in (0, 1)")
        sp.add_argument("--json", action="store_true", help="print one JSON object (plan field names)")
        sp.add_argument(
            "--stats-epsilon", type=_positive_float("stats epsilon"), default=None,
            help="compose the DP contribution statistics release (privacy.contribution_stats.epsilon: a Laplace "
            "histogram, pure epsilon-DP) with the T steps, as the pipeline's plans do",
        )
        sp.add_argument(
            "--selection", choices=["per_run", "composed", "random_stopping"], default="per_run",
            help="what the epsilon is of: one run (per_run, default); the best of --runs learning-rate runs "
            "composed (the pipeline's default, privacy.selection.accounting = composed); or private selection "
            "by random stopping (Papernot & Steinke 2022; RDP) with --mean-runs and --shape",
        )
        sp.add_argument("--runs", type=_int_at_least("runs", 1), default=1,
                        help="composed: the number k of learning-rate runs the released model is chosen from")
        sp.add_argument("--mean-runs", type=_positive_float("mean runs"), default=None,
                        help="random_stopping: the mean number of runs E[K] >= 1 (default: --runs)")
        sp.add_argument("--shape", type=float, default=1.0,
                        help="random_stopping: truncated negative binomial shape (1 geometric, 0 logarithmic)")

    e = sub.add_parser("epsilon", help="epsilon of T steps at a given noise multiplier")
    common(e)
    e.add_argument("--noise-multiplier", required=True, type=_noise, help="sigma (noise std / clip norm), >= 0")
    e.add_argument("--discretization", type=_positive_float("discretization"), default=1e-4, help="PLD discretization (default 1e-4)")

    c = sub.add_parser("calibrate", help="smallest noise multiplier meeting (epsilon, delta)")
    common(c)
    c.add_argument("--epsilon", required=True, type=_positive_float("epsilon", allow_inf=True), help="target epsilon > 0 (inf: no noise)")
    c.add_argument("--tolerance", type=_positive_float("tolerance"), default=1e-3, help="relative tolerance in sigma (default 1e-3)")
    c.add_argument("--max-noise-multiplier", type=_positive_float("max noise multiplier"), default=500.0, help="give up above this sigma (default 500)")
    k = sub.add_parser("check-config", help="check config files as snakemake would read them (over the default "
                       "config/config.yaml), naming the file, key and line of each mistake")
    k.add_argument("files", nargs="+", help="YAML config files, in --configfile order")
    k.add_argument("--default", default=None, help="the default config they override (default: the repository's "
                   "config/config.yaml; 'none': check the files alone, merged, as with --replace-workflow-config)")
    r = sub.add_parser(
        "run", help="run snakemake with these arguments, the config files checked first",
        description="Run snakemake (this Python's `-m snakemake`, in the current folder) with the arguments "
        "given, after checking the config files as check-config does (a mistake stops here, naming the file, "
        "key and line). A target written after --configfile or --config, which snakemake would read as one "
        "of their values, stops here too, saying how to write it: targets first, or --configfile=FILE "
        "(userdp.snakemake_args). Exits with snakemake's status, 2 for a bad config file or command line.",
        usage="userdp run [snakemake arguments ...]",
    )
    r.add_argument("snakemake_args", nargs="*", metavar="ARG", help="snakemake's arguments, e.g. --cores 2 "
                   "--configfile my.yaml results/data/mine/contributions.json")
    a = sub.add_parser(
        "audit-mechanism", help="white-box audit of the user-level mechanism: empirical vs claimed epsilon",
        description="Train canary users whose gradient is a known direction through the real engine, for every "
        "cell of audit.methods x audit.epsilons of the config (or the one --method / --epsilon name), score them "
        "from every privatised update and print the empirical epsilon lower bound next to the claimed epsilon "
        "(docs/audits.md, \"White-box audit of the mechanism\"). --json prints one JSON object: with both "
        "--method and --epsilon, that cell's fields (the columns of mechanism.csv); otherwise {\"cells\": [...]}, "
        "one object per cell in audit.methods x audit.epsilons order. Exits 2 for a bad config or a cell that "
        "is not audited, 1 when an empirical bound exceeds its claim.")
    a.add_argument("--configfile", nargs="+", required=True, metavar="FILE",
                   help="config files, merged over config/config.yaml as snakemake --configfile does")
    a.add_argument("--method", choices=["els", "uls"], default=None, help="audit only this method (of audit.methods)")
    a.add_argument("--epsilon", type=_positive_float("epsilon"), default=None,
                   help="audit only this target epsilon (of audit.epsilons, or grid.epsilons when that is null)")
    a.add_argument("--dataset", default="", help="the dataset name written in the rows (default: none)")
    a.add_argument("--json", action="store_true", help="print one JSON object (see above)")
    x = sub.add_parser("export-merged", help="merge a run's LoRA adapter (model.lora) into its base model and save it")
    x.add_argument("adapter", help="a run's model/ folder holding peft's adapter_config.json")
    x.add_argument("out", help="the folder to write the merged model to (must not exist yet)")
    return p


def _check_config(args: argparse.Namespace) -> int:
    from .config import load_config_files

    load_config_files(args.files, args.default)
    print(f"{', '.join(args.files)}: valid")
    return 0


def _run(argv: Sequence[str]) -> int:
    """`userdp run`: check the command line and the config files, run snakemake and return its status."""
    from .snakemake_args import INFO_ARGS, parse, run_snakemake, swallowed_targets

    if not INFO_ARGS & set(argv):
        try:
            call = parse(argv)
        except SystemExit as exc:  # snakemake's parser printed its message
            return int(exc.code or 0)
        try:
            from snakemake.cli import parse_config

            from .config import load_config_files

            swallowed_targets(call)
            try:
                overrides = parse_config(call.config or [])
            except ValueError as exc:
                raise UserError(f"--config {' '.join(call.config)}: {exc}") from None
            default = "none" if call.replace_workflow_config else None
            load_config_files([str(f) for f in call.configfile or []], default, overrides)
        except UserError as exc:
            print(f"userdp run: error: {exc}", file=sys.stderr)
            return 2
    return run_snakemake(argv)


def _export_merged(args: argparse.Namespace) -> int:
    """Load the adapter on its base, merge, save_pretrained into a new folder."""
    from pathlib import Path

    from .training import models

    if not models.is_adapter(args.adapter):
        raise UserError(f"{args.adapter} holds no LoRA adapter (no adapter_config.json); give a run's model/ "
                        "folder trained with model.lora (a full fine-tuning run's model/ is already merged).")
    if Path(args.out).exists():
        raise UserError(f"{args.out} exists; give a new folder (nothing is overwritten).")
    models.save_model_atomic(models.load_model(args.adapter, merge=True), args.out)
    print(f"merged model written to {args.out}")
    return 0


def _audit_mechanism(args: argparse.Namespace) -> int:
    """`userdp audit-mechanism`: the white-box audit of the cells the config names (or the one asked for)."""
    from .api import audit_mechanism

    rows = audit_mechanism(args.configfile, method=args.method, epsilon=args.epsilon, dataset=args.dataset)
    if args.json:
        print(json_text(rows[0] if args.method is not None and args.epsilon is not None else {"cells": rows}))
    else:
        for r in rows:
            print(f"{r['method']} eps {r['epsilon_target']:g}: claimed {r['epsilon_claimed']:.4g}, empirical lower "
                  f"bound {r['epsilon_lower_bound']:.4g} (ceiling {r['epsilon_lower_bound_ceiling']:.4g}, "
                  f"{r['canaries']} canaries, {r['confidence']:.0%})"
                  + ("" if math.isnan(r["epsilon_lower_bound_fdp"]) else
                     f", f-DP bound {r['epsilon_lower_bound_fdp']:.4g} (ceiling {r['epsilon_lower_bound_fdp_ceiling']:.4g})")
                  + f"; noise std ratio {r['noise_std_ratio']:.3f}"
                  + ("  BOUND EXCEEDS CLAIM" if r["bound_exceeds_claim"] else "")
                  + ("  NOISE CHECK FAILED" if r["noise_check_failed"] else ""))
    return 1 if any(r["bound_exceeds_claim"] for r in rows) else 0


def _account(args: argparse.Namespace) -> int:
    """`userdp epsilon` and `userdp calibrate`."""
    from .privacy import mechanism
    from .privacy.calibration import calibrate
    from .privacy.contribution_stats import laplace_event
    from .privacy.selection import Selection

    if args.method == "uls" and args.group_size != 1:
        raise UserError(f"--group-size {args.group_size} has no effect with --method uls (a sampled user is one "
                        "clipped unit, whatever its number of examples); omit it.")
    extra = (laplace_event(args.stats_epsilon),) if args.stats_epsilon is not None else ()
    if args.selection == "per_run" and args.runs > 1:
        raise UserError(f"--runs {args.runs} with --selection per_run: per_run is one run's epsilon; for the model "
                        "released from several learning-rate runs use --selection composed (or random_stopping).")
    mean = None if args.selection != "random_stopping" else (args.mean_runs or float(args.runs))
    selection = Selection(args.selection, args.runs, mean, args.shape if mean is not None else None)
    mech = mechanism.get(args.method, comparison=True)(args.sampling_rate, args.steps, args.group_size)
    if args.selection != "per_run" and args.method not in mechanism.METHODS:
        raise UserError("--selection composed / random_stopping is for the training methods els and uls.")
    if args.command == "epsilon":
        if args.selection == "per_run":
            eps = mech.epsilon(args.noise_multiplier, args.delta, discretization=args.discretization,
                               extra_events=extra)
        else:
            eps = selection.released_epsilon(mech, args.noise_multiplier, args.delta, extra,
                                             args.discretization)
        record = {
            "method": args.method,
            "epsilon": eps,
            "delta": args.delta,
            "group_size": args.group_size,
            "sampling_rate": args.sampling_rate,
            "steps": args.steps,
            "noise_multiplier": args.noise_multiplier,
            "accountant": mech.accountant,
            "discretization": args.discretization,
            "selection": selection.record(),
        }
        text = f"epsilon = {eps:.6g} at delta = {args.delta:.3g}"
    else:
        r = calibrate(selection.calibration_mechanism(mech), args.epsilon, args.delta, tolerance=args.tolerance,
                      max_noise_multiplier=args.max_noise_multiplier, extra_events=extra)
        record = r.to_dict()
        record.update(steps=args.steps, selection=selection.record())
        if args.selection != "per_run" and r.noise_multiplier > 0:
            record["epsilon_per_run"] = mech.epsilon(r.noise_multiplier, args.delta, extra_events=extra)
        text = (f"noise multiplier = {r.noise_multiplier:.6g} (epsilon achieved {r.epsilon_achieved:.6g} <= "
                f"{r.epsilon:g} at delta = {r.delta:.3g})")
    if extra:
        record["contribution_stats_epsilon"] = args.stats_epsilon
    print(json_text(record) if args.json else text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 2 invalid arguments or infeasible target)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"] and argv[1:] not in (["-h"], ["--help"]):
        return _run(argv[1:])  # snakemake's options are not ours: argparse would refuse them
    args = build_parser().parse_args(argv)
    commands = {"export-merged": _export_merged, "check-config": _check_config, "audit-mechanism": _audit_mechanism}
    try:
        return commands.get(args.command, _account)(args)
    except UserError as exc:
        print(f"userdp {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
