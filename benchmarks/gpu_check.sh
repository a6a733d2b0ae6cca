#!/usr/bin/env bash
# GPU check: DP step-cost benchmark and a short real ELS/ULS fine-tuning, on one GPU, in bf16.
#
# Not a test: never run by pytest or CI (CI has no GPU). A session that is lent
# a GPU machine (e.g. an H200) runs it ONCE:
#
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=500)
#
# then calls give_back (unless it reruns at once), and records the figures it
# prints (the "== ..." tables at the end of $OUT/gpu_check.log, or
# $OUT/gpu_check.json) in the closing note and in docs/gpu-hours.md.
# Expected wall time about 4 minutes (machine start not counted); the stages
# have their own timeouts (200 s + 150 s + 230 s), so the script ends within ~10 min
# even when both run out; what finished is still written under $OUT.
#
# What it runs (the library comes from the working tree: PYTHONPATH=workflow):
#   (a) benchmarks/bench_dp_step.py --device cuda --bf16 on gpt2-medium and
#       gpt2-34m; gpt2-medium (24 layers, 1024 wide, 16 heads, vocab 50257, seq 128,
#       physical batch 64): ELS and ULS vs non-private step time and peak memory;
#   (a2) bench_dp_step --lora 16 --compare-full on a ~1B-parameter Llama shape (llama-1b: 16 layers, 2048
#       wide, seq 256), bf16: DP-LoRA (ELS, ULS) vs non-private LoRA, and the full-fine-tuning DP steps;
#       needs the peft and accelerate wheels in .whl too (pip download --no-deps peft==0.21.2
#       accelerate==1.15.0 -d .whl; both are pure Python);
#   (b) benchmarks/gpu_finetune_smoke.py: ~20 steps each of ELS, ULS, ULS with adaptive clipping, ULS as
#       4-banded DP-FTRL (privacy.correlated_noise) and a non-private run through userdp.training.engine.train on a
#       gpt2-medium-sized model (random init), bf16: steps/s, examples/s, peak
#       GPU memory, and the ledger (epsilon from the real accountant).
# Outputs under $OUT (they come back to the calling machine): gpu_check.log
# (everything printed), gpu_check.json (summary), bench_dp_step.json, bench_dp_step_lora.json,
# gpu_finetune_smoke.json, env.json.
#
# The device image has torch, transformers, pyarrow, pandas, numpy, scipy,
# absl-py, attrs and mpmath but not dp-accounting, and cannot download. Its
# wheel travels in the git-ignored folder .whl (carry: [".whl"]). Only
# dp-accounting itself is needed: of its Requires-Dist, absl-py, attrs,
# mpmath, numpy and scipy are in the image, and dm-tree is imported only by
# dp-accounting's own tests (dp_event_test.py), never by `import dp_accounting`.
# Fetch it (here, in the repository root; ~130 KB):
#
#   grep -qx '/.whl/' .git/info/exclude || echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl dp-accounting==0.6.0
#
# Without the wheel the step benchmarks still run; the smoke run fails (a
# plan records its dp-accounting event, so even a fixed sigma needs it).
#
# CPU dry run of the same code path (tiny model, cpu, 2 steps, fp32), here:
#
#   bash benchmarks/gpu_check.sh --cpu-dry-run      # outputs in benchmarks/out/gpu_check_dry/
#
# Environment overrides: PYTHON (interpreter), OUT (output folder), SITE
# (where carried wheels are installed).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

MODE=gpu
case "${1:-}" in
  --cpu-dry-run) MODE=cpu ;;
  "") ;;
  *) echo "usage: bash benchmarks/gpu_check.sh [--cpu-dry-run]" >&2; exit 2 ;;
esac

if [[ $MODE == cpu ]]; then
  PY=${PYTHON:-.venv/bin/python}
  OUT_DIR=${OUT:-benchmarks/out/gpu_check_dry}
  if [[ -z ${SITE:-} ]]; then
    SITE=$(mktemp -d /tmp/gpu_check_site.XXXXXX) || exit 2
    trap 'rm -rf "$SITE"' EXIT  # a scratch install, only for this dry run
  fi
  BENCH_ARGS=(--device cpu --configs tiny --warmup 1 --steps 2 --steps-mem 1 --threads 1)
  SMOKE_ARGS=(--size tiny --device cpu --steps 2 --warmup-steps 0 --threads 1)
  LORA_ARGS=(--device cpu --configs llama-tiny --lora 8 --compare-full --warmup 1 --steps 2 --steps-mem 1 --threads 1)
  BENCH_TIMEOUT=300 SMOKE_TIMEOUT=300 LORA_TIMEOUT=300
else
  PY=${PYTHON:-python3}
  OUT_DIR=${OUT:-benchmarks/out/gpu_check}
  SITE=${SITE:-/tmp/site}
  BENCH_ARGS=(--device cuda --bf16 --configs gpt2-medium,gpt2-34m --warmup 2 --steps 5 --steps-mem 2 --threads 8)
  SMOKE_ARGS=(--size gpt2-medium --device cuda --bf16 --steps 20 --warmup-steps 3 --threads 8)
  LORA_ARGS=(--device cuda --bf16 --configs llama-1b --lora 16 --compare-full --warmup 2 --steps 5 --steps-mem 2
             --threads 8)
  BENCH_TIMEOUT=200 SMOKE_TIMEOUT=230 LORA_TIMEOUT=150
fi
mkdir -p "$OUT_DIR" || exit 2
LOG=$OUT_DIR/gpu_check.log
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1
T_START=$(date +%s)
echo "== gpu_check mode=$MODE python=$PY out=$OUT_DIR $(date -u +%FT%TZ)"

# Carried wheels (dp-accounting) into $SITE, ahead of the image's packages.
WHEEL_RC=none
if compgen -G ".whl/*.whl" >/dev/null; then
  ls -l .whl/*.whl
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  WHEEL_RC=$?
  [[ $WHEEL_RC == 0 ]] || echo "WARNING: installing the carried wheels failed (rc $WHEEL_RC); continuing without"
else
  echo "no .whl/*.whl carried: the smoke run will use a fixed sigma (no accountant)"
fi
export PYTHONPATH="workflow:$SITE${PYTHONPATH:+:$PYTHONPATH}"

if [[ $MODE == gpu ]]; then
  nvidia-smi || echo "WARNING: nvidia-smi failed"
fi
"$PY" - "$OUT_DIR/env.json" <<'EOF'
import json, platform, sys
env = {"python": platform.python_version(), "executable": sys.executable}
try:
    import torch
    env.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_mem_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count,
                   bf16=torch.cuda.is_bf16_supported())
except Exception as exc:
    env["torch_error"] = repr(exc)
for name in ("transformers", "numpy", "scipy", "pyarrow", "pandas", "attr", "absl", "dp_accounting", "userdp"):
    try:
        mod = __import__(name)
        env[name] = f"{getattr(mod, '__version__', '?')} ({mod.__file__})"
    except Exception as exc:
        env[name] = f"MISSING: {exc!r}"
for k, v in env.items():
    print(f"  {k}: {v}")
json.dump(env, open(sys.argv[1], "w"), indent=2)
EOF

echo; echo "== (a) bench_dp_step ${BENCH_ARGS[*]}"
t0=$(date +%s)
timeout -k 10 "$BENCH_TIMEOUT" "$PY" benchmarks/bench_dp_step.py "${BENCH_ARGS[@]}" --json-out "$OUT_DIR/bench_dp_step.json"
BENCH_RC=$? BENCH_S=$(( $(date +%s) - t0 ))
echo "bench_dp_step: rc=$BENCH_RC in ${BENCH_S}s"

echo; echo "== (a2) bench_dp_step LoRA ${LORA_ARGS[*]}"
t0=$(date +%s)
timeout -k 10 "$LORA_TIMEOUT" "$PY" benchmarks/bench_dp_step.py "${LORA_ARGS[@]}" --json-out "$OUT_DIR/bench_dp_step_lora.json"
LORA_RC=$? LORA_S=$(( $(date +%s) - t0 ))
echo "bench_dp_step LoRA: rc=$LORA_RC in ${LORA_S}s"

echo; echo "== (b) gpu_finetune_smoke ${SMOKE_ARGS[*]}"
t0=$(date +%s)
timeout -k 10 "$SMOKE_TIMEOUT" "$PY" benchmarks/gpu_finetune_smoke.py "${SMOKE_ARGS[@]}" \
  --json-out "$OUT_DIR/gpu_finetune_smoke.json"
SMOKE_RC=$? SMOKE_S=$(( $(date +%s) - t0 ))
echo "gpu_finetune_smoke: rc=$SMOKE_RC in ${SMOKE_S}s"

if [[ $MODE == gpu ]]; then
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
    --format=csv || true
fi

# One summary: the headline figures, the stages' exit codes and wall times, and the full results.
"$PY" - "$OUT_DIR" "$MODE" "$WHEEL_RC" "$BENCH_RC" "$BENCH_S" "$SMOKE_RC" "$SMOKE_S" "$T_START" "$LORA_RC" "$LORA_S" <<'EOF'
import json, os, sys, time
out, mode, wheel_rc, bench_rc, bench_s, smoke_rc, smoke_s, t_start, lora_rc, lora_s = sys.argv[1:]

def load(name):
    try:
        with open(os.path.join(out, name)) as fh:
            return json.load(fh)
    except (OSError, ValueError) as exc:
        return {"missing": repr(exc)}

bench, smoke, env = load("bench_dp_step.json"), load("gpu_finetune_smoke.json"), load("env.json")
head = {"bench_ratios": {c: r.get("ratios") for c, r in bench.get("results", {}).items()},
        "bench_step_ms": {c: {m: 1e3 * t["step_s"] for m, t in r["time"].items()}
                          for c, r in bench.get("results", {}).items()},
        "bench_peak_mem_mb": {c: {m: v["peak_mb"] for m, v in r.get("memory", {}).items()}
                              for c, r in bench.get("results", {}).items()},
        "smoke": {m: {k: r.get(k) for k in ("median_step_s", "steps_per_s", "examples_per_s", "peak_gpu_mem_mb",
                                            "mean_realised_examples", "error")}
                  | {"epsilon": r.get("ledger", {}).get("epsilon"), "checks": r.get("checks")}
                  for m, r in smoke.get("runs", {}).items()},
        "smoke_ratios_vs_nonprivate": smoke.get("ratios_vs_nonprivate"),
        "lora_bench_ratios": {c: r.get("ratios") for c, r in load("bench_dp_step_lora.json").get("results", {}).items()}}
ok = bench_rc == "0" and smoke_rc == "0"
summary = {"mode": mode, "ok": ok, "wall_s": time.time() - float(t_start),
           "stages": {"wheels": wheel_rc, "bench_dp_step": {"rc": int(bench_rc), "s": int(bench_s)},
                      "gpu_finetune_smoke": {"rc": int(smoke_rc), "s": int(smoke_s)},
                      "bench_dp_step_lora": {"rc": int(lora_rc), "s": int(lora_s)}},
           "headline": head, "env": env, "bench_dp_step": bench, "gpu_finetune_smoke": smoke}
tmp = os.path.join(out, ".gpu_check.json.tmp")
with open(tmp, "w") as fh:
    json.dump(summary, fh, indent=2)
os.replace(tmp, os.path.join(out, "gpu_check.json"))
print("\n== headline (gpu_check.json)")
print(json.dumps(head, indent=1))
print(f"GPU CHECK {'OK' if ok else 'FAILED'} (mode {mode}, {summary['wall_s']:.0f}s)")
EOF
[[ $BENCH_RC == 0 && $SMOKE_RC == 0 ]]
