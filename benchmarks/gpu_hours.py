"""Estimate the GPU hours of a grid config (default: config/paper.yaml), per Snakemake rule.

The estimate behind docs/gpu-hours.md. Every fine-tuning run processes its
compute budget K examples in expectation (the planner sets q so that
T * q * N = K for ELS and T * q_u * N * mbar_G = K for ULS), each padded to
the sequence length L (micro-batches have fixed shapes, so padding costs
compute too). Then

    FLOPs per training example = (6 * N_params + 12 * n_layer * n_embd * L) * L
    seconds per example        = FLOPs / (peak * utilisation) * DP overhead (method)

with the DP overhead the ratio DP step / non-private step (benchmarks/
bench_dp_step.py) and 1 for the eps = inf reference cells. Evaluation is a
forward pass (a third of the training FLOPs) over the validation and test
examples of up to evaluation.max_users users each.

With --measured (gpu_check.json or gpu_finetune_smoke.json from
benchmarks/gpu_check.sh) the seconds per example come from the measured
examples/s of the real training loop on the GPU instead (ELS, ULS and
non-private), and evaluation is scaled by the FLOP rate that the non-private
run achieved.

    .venv/bin/python benchmarks/gpu_hours.py                        # the estimate
    .venv/bin/python benchmarks/gpu_hours.py --measured gpu_check.json
    .venv/bin/python benchmarks/gpu_hours.py --config config/examples/llama-lora.yaml --model llama-3-8b \
        --lora 16 --memory                                          # DP-LoRA on an 8B Llama, one GPU per run
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict

from userdp.config import load_config
from userdp.grid import iter_cells
from userdp.training.targets import finetune_runtime, rates_per_job


# Model shapes: parameters, layers, width, attention heads, vocabulary.
MODELS = {
    "gpt2-medium": (354_823_168, 24, 1024, 16, 50257),
    "llama-3-8b": (8_030_261_248, 32, 4096, 32, 128256),
}


def flops_per_example(n_params: float, n_layer: int, n_embd: int, seq: int, backward: bool = True,
                      lora: bool = False) -> float:
    """Matmul FLOPs of one padded example: 2N per token forward (+4N backward), plus attention scores.

    lora: the frozen base computes no weight gradients, so the backward is 2N per token (activation gradients
    only; the adapters' own FLOPs are negligible at small rank).
    """
    per_token = 2 * n_params + 4 * n_layer * n_embd * seq  # forward: weights, and QK^T and AV (2 L d each)
    return per_token * seq * ((2 if lora else 3) if backward else 1)


def memory_gb(n_params: float, n_layer: int, n_embd: int, n_head: int, vocab: int, seq: int, micro_batch: int,
              lora_params: float | None) -> dict[str, float]:
    """Peak GPU memory of one fine-tuning job (GB), by part.

    Weights in fp32 (bf16 is autocast); trainable state (weights' gradient and Adam's two moments, fp32) of
    every parameter or of the adapters; activations of a bf16 micro-batch without recomputation (about
    L d (34 + 5 h L / d) bytes per layer and sequence, Korthikanti et al. 2022) times 1.5 for the clipping
    book-keeping (each hooked layer's input and output gradient); fp32 logits and their log-softmax.
    """
    trainable = n_params if lora_params is None else lora_params
    parts = {
        "weights (fp32)": 4 * n_params,
        "gradients + Adam state (fp32)": 12 * trainable,
        "activations + clipping book-keeping": 1.5 * micro_batch * seq * n_layer * (34 * n_embd + 5 * n_head * seq),
        "logits (fp32, x3)": 3 * 4 * micro_batch * seq * vocab,
    }
    return {k: v / 1e9 for k, v in parts.items()}


def lora_param_count(n_layer: int, n_embd: int, r: int, intermediate: float) -> float:
    """Adapter parameters of rank r on q, k, v, o, gate, up, down of every block (Llama shapes, full-rank k/v)."""
    attn = 4 * r * (n_embd + n_embd)
    mlp = 3 * r * (n_embd + intermediate)
    return n_layer * (attn + mlp)


def measured_rates(path: str, n_layer: int, n_embd: int, seq: int) -> dict[str, float]:
    """examples/s per method (els, uls, nonprivate) from a gpu_check.json or gpu_finetune_smoke.json.

    Refuses figures of another model shape (e.g. the CPU dry run's tiny model).
    """
    with open(path) as fh:
        data = json.load(fh)
    smoke = data.get("gpu_finetune_smoke", data)
    shape = smoke.get("shape", {})
    if (shape.get("n_layer"), shape.get("n_embd"), shape.get("seq")) != (n_layer, n_embd, seq):
        raise SystemExit(f"{path} measured a model of shape {shape}, not n_layer={n_layer} n_embd={n_embd} "
                         f"seq={seq}; use the GPU run's gpu_check.json (size gpt2-medium), not a dry run.")
    rates = {m: float(r["examples_per_s"]) for m, r in smoke["runs"].items() if "examples_per_s" in r}
    missing = {"els", "uls", "nonprivate"} - set(rates)
    if missing:
        raise SystemExit(f"{path}: no examples/s for {sorted(missing)}; rerun benchmarks/gpu_check.sh")
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="config/paper.yaml")
    ap.add_argument("--model", default="gpt2-medium", choices=sorted(MODELS),
                    help="the model's shape (parameters, layers, width, heads, vocabulary)")
    ap.add_argument("--lora", type=int, default=None,
                    help="LoRA rank (model.lora): backward without weight gradients; trainable state of the adapters")
    ap.add_argument("--memory", action="store_true", help="also print the peak memory estimate of one job")
    ap.add_argument("--intermediate", type=float, default=14336, help="MLP width, for the adapter count")
    ap.add_argument("--peak-tflops", type=float, default=790.0,
                    help="bf16 matmul rate of the GPU (790: an 8192^3 bf16 matmul measured on an H200)")
    ap.add_argument("--utilisation", type=float, default=0.35, help="sustained fraction of --peak-tflops")
    ap.add_argument("--overhead-els", type=float, default=1.25, help="ELS step / non-private step")
    ap.add_argument("--overhead-uls", type=float, default=1.20, help="ULS step / non-private step")
    ap.add_argument("--job-overhead-min", type=float, default=3.0,
                    help="per fine-tuning job: start, model load, checkpoints, final save (minutes)")
    ap.add_argument("--eval-examples-per-user", type=float, default=400.0,
                    help="held-out examples per evaluated user (Stack Overflow: ~425)")
    ap.add_argument("--measured", default=None, help="gpu_check.json: use measured examples/s instead")
    args = ap.parse_args()

    config = load_config(args.config)
    args.n_params, args.n_layer, args.n_embd, n_head, vocab = MODELS[args.model]
    seq = int(config["tokenizer"]["sequence_length"])
    lrs = config["training"]["learning_rates"]
    f_train = flops_per_example(args.n_params, args.n_layer, args.n_embd, seq, lora=bool(args.lora))
    f_eval = flops_per_example(args.n_params, args.n_layer, args.n_embd, seq, backward=False)
    if args.measured:
        rates = measured_rates(args.measured, args.n_layer, args.n_embd, seq)
        sec = {"nonprivate": 1 / rates["nonprivate"], "els": 1 / rates["els"], "uls": 1 / rates["uls"]}
        achieved = f_train * rates["nonprivate"]
        source = f"measured ({args.measured}): {achieved / 1e12:.0f} TFLOP/s achieved non-private"
    else:
        achieved = args.peak_tflops * 1e12 * args.utilisation
        base = f_train / achieved
        sec = {"nonprivate": base, "els": base * args.overhead_els, "uls": base * args.overhead_uls}
        source = (f"assumed: {args.utilisation:.0%} of {args.peak_tflops:.0f} TFLOP/s = {achieved / 1e12:.0f} TFLOP/s "
                  f"non-private; DP overhead ELS {args.overhead_els}x, ULS {args.overhead_uls}x")

    rows: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    longest = 0.0
    per_job = rates_per_job(config)  # training.sweep_jobs: runs trained (and evaluated) by one job
    n_runs = n_jobs = 0
    for cell in iter_cells(config):
        rule = "finetune_group" if cell.group_size else "finetune"
        kind = "nonprivate" if math.isinf(cell.epsilon) else cell.method
        hours = cell.compute * sec[kind] / 3600
        longest = max(longest, (hours + args.job_overhead_min / 60) * per_job)  # evaluation added below
        r = rows[(rule, kind if kind == "nonprivate" else f"{kind} (private)")]
        r["jobs"] += len(lrs) // per_job
        r["examples"] += cell.compute * len(lrs)
        r["hours"] += (hours + args.job_overhead_min / 60) * len(lrs)
        n_runs, n_jobs = n_runs + len(lrs), n_jobs + len(lrs) // per_job
    max_users = config["evaluation"]["max_users"] or 0
    from userdp.evaluation.targets import evaluated_splits

    # validation users only where a cell chooses among rates (evaluation.validation); the pretrained model: test only
    eval_examples = len(evaluated_splits(config, selects=len(lrs) > 1)) * max_users * args.eval_examples_per_user
    eval_h = eval_examples * f_eval / achieved / 3600
    n_pre = len(config["grid"]["datasets"] or config["datasets"])
    # each fine-tuning job evaluates its runs (no jobs of its own)
    rows[("finetune", "evaluation, forward only")] = {"jobs": 0, "examples": eval_examples * n_runs,
                                                      "hours": eval_h * n_runs}
    pre_examples = len(evaluated_splits(config, selects=False)) * max_users * args.eval_examples_per_user
    pre_h = pre_examples * f_eval / achieved / 3600
    rows[("evaluate_pretrained", "forward only")] = {"jobs": n_pre, "examples": pre_examples * n_pre,
                                                    "hours": pre_h * n_pre}

    print(f"config {args.config}: sequence {seq}, {args.n_params / 1e6:.1f}M parameters, "
          f"{f_train / 1e9:.0f} GFLOP per training example, {f_eval / 1e9:.0f} GFLOP per evaluated example")
    print(f"throughput {source}; per fine-tuning job +{args.job_overhead_min:g} min")
    print()
    print("| rule | runs | jobs | examples (M) | GPU hours |")
    print("| --- | --- | ---: | ---: | ---: |")
    total = 0.0
    order = ["finetune", "finetune_group", "evaluate_pretrained"]
    for (rule, kind), r in sorted(rows.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1])):
        total += r["hours"]
        print(f"| {rule} | {kind} | {int(r['jobs'])} | {r['examples'] / 1e6:,.1f} | {r['hours']:,.1f} |")
    print(f"| **total** | | | | **{total:,.0f}** |")
    print()
    longest += eval_h * per_job
    print(f"longest single fine-tuning job: {longest:.1f} h (its runtime resource: "
          f"{finetune_runtime(config) / 60:.0f} h), of it evaluation {eval_h * per_job * 60:.0f} min")
    if args.memory:
        lora_n = lora_param_count(args.n_layer, args.n_embd, args.lora, args.intermediate) if args.lora else None
        micro = int(config["training"]["physical_batch_size"])
        parts = memory_gb(args.n_params, args.n_layer, args.n_embd, n_head, vocab, seq, micro, lora_n)
        print()
        trained = f"LoRA r={args.lora}, {lora_n / 1e6:.0f}M adapter parameters" if lora_n else "every parameter"
        print(f"peak memory of one fine-tuning job ({trained}, micro-batch {micro} x {seq} tokens):")
        for k, v in parts.items():
            print(f"  {k}: {v:.1f} GB")
        print(f"  total: {sum(parts.values()):.1f} GB")


if __name__ == "__main__":
    main()
