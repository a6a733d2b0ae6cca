"""Benchmark: DP-SGD step cost (ELS, ULS) against the non-private step, same examples.

One invocation measures, for each model config (a tiny GPT-2 and a ~34M
parameter GPT-2 by default; `gpt2-medium` is the paper's ~355M shape, for
a GPU: benchmarks/gpu_check.sh runs it there):

- time: median over several steps after warm-up, with the three modes
  interleaved step by step in one process so machine noise hits all alike;
- peak memory: each mode in a fresh subprocess; on CPU the peak resident set
  (VmHWM, reset after imports and a throwaway warm-up step, with glibc told to
  return freed blocks at once) above the resident set at that point, so it
  counts parameters, gradients, Adam state and activations; on CUDA
  torch.cuda.max_memory_allocated above the allocation before the model.

A step is: zero grads, `ClippedGradients.accumulate` on B rows, Gaussian noise
added to the gradients (DP modes only, as a DP step does), Adam step. The
non-private step uses clip_norm=None (an ordinary backward). ELS: B examples,
one unit each. ULS: B/k users with k examples each (or users of the sizes
given by --per-user in turn), weights 1/m_u.
Prints the ratios ELS/non-private and ULS/non-private for both the whole step
and the gradient part alone (accumulate). Example:

    .venv/bin/python benchmarks/bench_dp_step.py            # CPU, both configs
    .venv/bin/python benchmarks/bench_dp_step.py --configs llama-tiny,llama-60m --lora 16 --compare-full
        # DP-LoRA (els, uls) vs non-private LoRA, and the full fine-tuning DP steps (els_full, uls_full)
    .venv/bin/python benchmarks/bench_dp_step.py --device cuda --bf16 --configs gpt2-34m,gpt2-medium \
        --json-out benchmarks/out/bench_dp_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

CONFIGS = {
    # name: (n_layer, n_embd, n_head, vocab, seq_len, batch)
    "tiny": (2, 64, 4, 1024, 64, 16),
    # the shape of the pipeline's default config (config/config.yaml)
    "default": (2, 128, 4, 2048, 48, 64),
    "gpt2-34m": (8, 512, 8, 16384, 128, 16),
    # the paper's model shape (config/paper.yaml: gpt2-medium, sequence 128, physical batch 64)
    "gpt2-medium": (24, 1024, 16, 50257, 128, 64),
    # Llama-shaped (RMSNorm, RoPE, SwiGLU with intermediate 8/3 x width, untied): for the LoRA comparison
    "llama-tiny": (2, 64, 4, 1024, 64, 16),
    "llama-60m": (8, 512, 8, 32000, 128, 16),
    # a ~1B-parameter Llama shape (benchmarks/gpu_check.sh runs it with --lora on a GPU, bf16)
    "llama-1b": (16, 2048, 16, 32000, 256, 16),
}
MODES = ("nonprivate", "els", "uls")
# --lora: the three modes train LoRA adapters; with --compare-full the full fine-tuning DP steps are timed too
FULL_MODES = ("els_full", "uls_full")


def build(config: str, device: str, seed: int = 0, lora: int | None = None):
    """Model (GPT-2 with tied embeddings, or Llama-shaped untied; no dropout) and Adam, on device.

    lora: rank of LoRA adapters on every linear layer but the output one (userdp.training.models.apply_lora,
    as model.lora does); only they are trainable.
    """
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    n_layer, n_embd, n_head, vocab, seq, _ = CONFIGS[config]
    torch.manual_seed(seed)
    if config.startswith("llama"):
        cfg = LlamaConfig(num_hidden_layers=n_layer, hidden_size=n_embd, num_attention_heads=n_head,
                          num_key_value_heads=n_head, intermediate_size=(8 * n_embd) // 3, vocab_size=vocab,
                          max_position_embeddings=seq, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    else:
        cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab, n_positions=seq,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    # initialise on the device itself: a 355M-parameter init is seconds on a CPU, nothing on a GPU
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg)
    if lora:
        from userdp.training.models import apply_lora

        model = apply_lora(model, {"r": int(lora), "alpha": 2.0 * int(lora), "dropout": 0.0,
                                   "target_modules": None}, seed=seed).to(device)
    model.train()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    return model, opt


def dp_mode(mode: str) -> str:
    """The sampling level of a mode (els_full -> els)."""
    return mode.removesuffix("_full")


def modes(args) -> tuple[str, ...]:
    return MODES + (FULL_MODES if args.lora and args.compare_full else ())


def make_batch(config: str, mode: str, per_user: str, device: str, seed: int = 1):
    """Full-length rows; ELS: one unit per row; ULS: users of `per_user` rows each, weights 1/m_u."""
    _, _, _, vocab, seq, batch = CONFIGS[config]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    mask = torch.ones_like(ids)
    if mode == "uls":
        # user sizes cycle through `per_user` (e.g. "4", or "1,2,3,6" for users of unequal size)
        sizes = [int(k) for k in str(per_user).split(",")]
        units_l, weights_l, u = [], [], 0
        while len(units_l) < batch:
            m = min(sizes[u % len(sizes)], batch - len(units_l))
            units_l += [u] * m
            weights_l += [1.0 / m] * m
            u += 1
        units = torch.tensor(units_l, device=device)
        weights = torch.tensor(weights_l, device=device)
    else:
        units = torch.arange(batch, device=device)
        weights = torch.ones(batch, device=device)
    return ids, mask, units, weights


class Stepper:
    """One training step of a given mode (the thing being timed)."""

    def __init__(self, model, opt, config, mode, args):
        from userdp.training.clipping import ClippedGradients

        self.model, self.opt, self.mode, self.args = model, opt, mode, args
        self.cg = ClippedGradients(model, None if mode == "nonprivate" else args.clip)
        self.batch = make_batch(config, dp_mode(mode), args.per_user, args.device)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.gen = torch.Generator(device=args.device).manual_seed(2)

    def __call__(self) -> tuple[float, float, float]:
        """Run one step; return seconds in accumulate, for the whole step (wall), and process CPU seconds."""
        sync = torch.cuda.synchronize if self.args.device == "cuda" else (lambda: None)
        sync()
        c0 = time.process_time()
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        ctx = torch.autocast(self.args.device, dtype=torch.bfloat16) if self.args.bf16 else _null()
        with ctx:
            self.cg.accumulate(*self.batch)
        sync()
        t1 = time.perf_counter()
        if self.mode != "nonprivate":
            with torch.no_grad():
                for p in self.params:
                    p.grad.add_(torch.randn(p.shape, generator=self.gen, device=p.device, dtype=p.dtype),
                                alpha=self.args.clip * 1.0)
        self.opt.step()
        sync()
        return t1 - t0, time.perf_counter() - t0, time.process_time() - c0


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def rss_mb() -> float:
    """Current resident set of this process (MiB)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def reset_peak_rss() -> None:
    """Reset the kernel's resident-set high-water mark (VmHWM), so import-time peaks do not count."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_mb() -> float:
    """Resident-set high-water mark since the last reset (MiB)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def measure_memory(args) -> None:
    """Child process: peak memory of `args.steps_mem` steps of one mode; prints JSON."""
    import transformers  # noqa: F401 - import before the baseline so library pages are excluded

    import userdp.training.clipping  # noqa: F401

    torch.set_num_threads(args.threads)
    # warm up lazy imports and kernels on a throwaway model so they are not counted
    saved = CONFIGS["tiny"]
    CONFIGS["tiny"] = (1, 16, 2, 64, 8, 4)
    lora = None if args.mode in FULL_MODES else args.lora
    warm_model, warm_opt = build("tiny", args.device, lora=lora)
    Stepper(warm_model, warm_opt, "tiny", args.mode, args)()
    CONFIGS["tiny"] = saved
    del warm_model, warm_opt
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = rss_mb()
        reset_peak_rss()
    model, opt = build(args.config, args.device, lora=lora)
    step = Stepper(model, opt, args.config, args.mode, args)
    for _ in range(args.steps_mem):
        step()
    if args.device == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = peak_rss_mb() - base
    n_params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"peak_mb": peak, "n_params": n_params}))


def measure_time(config: str, args) -> dict[str, dict[str, float]]:
    """Interleave the modes step by step; median seconds per mode."""
    model, opt = build(config, args.device, lora=args.lora)
    steppers = {m: Stepper(model, opt, config, m, args) for m in MODES}
    if args.lora and args.compare_full:
        full_model, full_opt = build(config, args.device)
        steppers.update({m: Stepper(full_model, full_opt, config, m, args) for m in FULL_MODES})
    all_modes = modes(args)
    for _ in range(args.warmup):
        for m in all_modes:
            steppers[m]()
    acc = {m: [] for m in all_modes}
    full = {m: [] for m in all_modes}
    cpu = {m: [] for m in all_modes}
    for _ in range(args.steps):
        for m in all_modes:
            a, s, c = steppers[m]()
            acc[m].append(a)
            full[m].append(s)
            cpu[m].append(c)
    med = statistics.median
    return {m: {"acc_s": med(acc[m]), "step_s": med(full[m]), "cpu_s": med(cpu[m])} for m in all_modes}


def ratios(times: dict, mem: dict) -> dict[str, dict[str, float]]:
    """DP mode / non-private: whole step, gradient part, and peak memory (when measured)."""
    base = times["nonprivate"]
    out = {}
    for m in [k for k in times if k != "nonprivate"]:
        out[m] = {"step": times[m]["step_s"] / base["step_s"], "grad_part": times[m]["acc_s"] / base["acc_s"]}
        if mem:
            out[m]["peak_mem"] = mem[m]["peak_mb"] / mem["nonprivate"]["peak_mb"]
    return out


def write_results(args, results: dict) -> None:
    """The results so far, with the run's settings and shapes, as JSON (atomically)."""
    from userdp.io import write_json

    write_json(args.json_out, {
        "device": args.device, "bf16": args.bf16, "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
        "steps": args.steps, "warmup": args.warmup, "uls_per_user": args.per_user, "lora_rank": args.lora,
        "shapes": {c: dict(zip(("n_layer", "n_embd", "n_head", "vocab", "seq", "batch"), CONFIGS[c]))
                   for c in results},
        "results": results,
    })


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="tiny,default,gpt2-34m", help=f"comma list from {sorted(CONFIGS)}")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--bf16", action="store_true", help="run the model under torch.autocast(bfloat16)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1 makes process CPU time a fair measure on a shared machine)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per mode (median)")
    ap.add_argument("--steps-mem", type=int, default=2, help="steps per memory subprocess")
    ap.add_argument("--per-user", default="4",
                    help="ULS examples per user; a comma list cycles through user sizes (e.g. 1,2,3,6)")
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=None, help="override the configs' batch size")
    ap.add_argument("--seq", type=int, default=None, help="override the configs' sequence length")
    ap.add_argument("--lora", type=int, default=None,
                    help="LoRA rank: every mode trains adapters (model.lora) instead of every parameter")
    ap.add_argument("--compare-full", action="store_true",
                    help="with --lora: also time and measure the full fine-tuning DP steps (els_full, uls_full)")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--json-out", default=None, help="also write the results (with ratios) to this JSON file")
    ap.add_argument("--child-mode", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-config", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.batch or args.seq:
        for k, v in CONFIGS.items():
            CONFIGS[k] = v[:4] + (args.seq or v[4], args.batch or v[5])
    if args.child_mode:
        args.mode, args.config = args.child_mode, args.child_config
        measure_memory(args)
        return

    torch.set_num_threads(args.threads)
    print(f"device={args.device} bf16={args.bf16} threads={args.threads} torch={torch.__version__} "
          f"steps={args.steps} warmup={args.warmup} uls_per_user={args.per_user} lora={args.lora}")
    results = {}
    for config in args.configs.split(","):
        n_layer, n_embd, _, vocab, seq, batch = CONFIGS[config]
        times = measure_time(config, args)
        mem = {}
        if not args.skip_memory:
            for m in modes(args):
                cmd = [sys.executable, __file__, "--child-mode", m, "--child-config", config, "--device", args.device,
                       "--threads", str(args.threads), "--steps-mem", str(args.steps_mem), "--per-user",
                       str(args.per_user), "--clip", str(args.clip)]
                if args.lora:
                    cmd += ["--lora", str(args.lora)]
                if args.bf16:
                    cmd.append("--bf16")
                if args.batch:
                    cmd += ["--batch", str(args.batch)]
                if args.seq:
                    cmd += ["--seq", str(args.seq)]
                # glibc: return every freed block >= 64 KiB to the OS at once, so the
                # resident-set high-water mark tracks live tensors, not allocator caching
                env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
                out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
                mem[m] = json.loads(out.strip().splitlines()[-1])
        results[config] = {"time": times, "memory": mem, "ratios": ratios(times, mem)}
        n_params = mem["nonprivate"]["n_params"] if mem else float("nan")
        print(f"\n== {config}: n_layer={n_layer} n_embd={n_embd} vocab={vocab} seq={seq} batch={batch} "
              f"params={n_params / 1e6:.1f}M")
        base = times["nonprivate"]
        for m in modes(args):
            t = times[m]
            line = (f"{m:>10s}: step {t['step_s'] * 1e3:8.1f} ms ({t['step_s'] / base['step_s']:.2f}x)  "
                    f"cpu {t['cpu_s'] * 1e3:8.1f} ms ({t['cpu_s'] / base['cpu_s']:.2f}x)  "
                    f"grad part {t['acc_s'] * 1e3:8.1f} ms ({t['acc_s'] / base['acc_s']:.2f}x)")
            if mem:
                ratio = mem[m]["peak_mb"] / mem["nonprivate"]["peak_mb"]
                line += f"  peak mem {mem[m]['peak_mb']:8.1f} MB ({ratio:.2f}x)"
            print(line)
        if args.json_out:  # after every config, so a run stopped by a timeout keeps the finished ones
            write_results(args, results)
    print("\nJSON " + json.dumps(results))



if __name__ == "__main__":
    main()
