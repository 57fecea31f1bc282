#!/usr/bin/env bash
# The checks that need a GPU, in one script, about 15 minutes on one H200 (the parts' time
# limits add up to 1,170 s; PARTS="train bench_sft" runs only the parts named, so the suite
# can be split over calls of a 10-minute limit, e.g. PARTS=qlora_7b alone):
#   1. equivalence on CUDA: the engine's window update against the exact float64 big batch in
#      fp32, bf16 and fp16 (autocast), and DDP / FSDP2 under torchrun (benchmarks/gpu_equivalence.py);
#   2. `gradaccum train --model gpt2-124m --precision bf16`: tokens/s and model FLOPs
#      utilisation, (6N + 12 L d T) FLOPs per token over the device's peak;
#   3. `gradaccum bench` against the Transformers Trainer on GPT-2 124M (from its config);
#   4. fit against a hand-picked sweep of micro-batches at the same tokens/step
#      (benchmarks/gpu_fit.py);
#   5. packing on CUDA: `gradaccum bench --task sft` (gradaccum's --packing modes against TRL
#      padded and padding-free, where trl is installed) on GPT-2 124M from its config, and
#      `gradaccum train --task sft --packing padding-free --compile` on the built-in GPT in
#      bf16 (one shape: compiles once), and --document-mask pretraining;
#   6. the seeds' QLoRA case scaled to one card (benchmarks/qlora_gpu.py): Llama 2 7B's shape
#      with random weights, NF4 base, LoRA rank 16, micro-batch 1 x 2048, k = 128, 2 optimizer
#      steps timed after a warm-up, checkpointing off and on: time per micro-step, tokens/s,
#      peak memory against the plan's figure (not run on a GPU yet);
#   7. the gradient-sync policies (benchmarks/sync_policies.py): FSDP2 on a 1-rank mesh, window
#      and micro with bf16 parameters, step time and peak memory (not run on a GPU yet).
# Results: $RESULTS/gpu_suite.json and $RESULTS/gpu_suite.md (RESULTS defaults to
# benchmarks/results). Each part has its own time limit; one that fails or times out is
# recorded as such and the others still run.
#
#   bash benchmarks/gpu_suite.sh              # PEAK_TFLOPS=989 (H200 dense bf16) by default
#   PEAK_TFLOPS=312 bash benchmarks/gpu_suite.sh   # A100
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
PEAK_TFLOPS=${PEAK_TFLOPS:-989}
RESULTS=${RESULTS:-benchmarks/results}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$RESULTS"
started=$(date +%s)

part() {  # part NAME SECONDS COMMAND...: run, keep its output, record its exit code
  local name=$1 limit=$2
  shift 2
  if [ -n "${PARTS:-}" ] && [[ " $PARTS " != *" $name "* ]]; then
    echo "skipped (not in PARTS)" >"$WORK/$name.err"; echo 125 >"$WORK/$name.rc"
    : >"$WORK/$name.out"; return
  fi
  echo "== $name (at most ${limit}s)" >&2
  timeout "$limit" "$@" >"$WORK/$name.out" 2>"$WORK/$name.err"
  echo $? >"$WORK/$name.rc"
  tail -n 3 "$WORK/$name.err" >&2
}

# 1. equivalence on CUDA ------------------------------------------------------------------
part precision 60 "$PY" - "$WORK/precision.json" <<'PYEOF'
import copy, json, sys
import torch
from gradaccum import Accumulator
from gradaccum.bench.pretrain.data import big_batch_gradient, make_windows, snapshot, update_error
from gradaccum.models.build import build_model
from gradaccum.models.loss import causal_lm_loss

dev = torch.device("cuda")
torch.manual_seed(0)
model, _ = build_model(preset="small", vocab_size=256, seq_len=256)
model = model.to(dev)
window = [{k: v.to(dev) for k, v in b.items()} for b in make_windows(1, 8, 8, 256, 256, 0)[0]]
grad = big_batch_gradient(model, window)
limits = {"fp32": 1e-5, "bf16": 3e-2, "fp16": 5e-3}
cases = {}
for precision, limit in limits.items():
    m = copy.deepcopy(model)
    acc = Accumulator(m, torch.optim.SGD(m.parameters(), lr=1.0), precision=precision)
    before = snapshot(m)
    for attempt in range(1, 6):  # fp16: the loss scale comes down on an overflow
        if not acc.step(window, causal_lm_loss).skipped:
            break
    err = update_error(before, snapshot(m), grad)
    cases[precision] = {"update_rel_err": err, "limit": limit, "windows": attempt,
                        "passed": err <= limit}
    print(precision, f"{err:.2e}", "ok" if err <= limit else "FAILED", file=sys.stderr)
json.dump(cases, open(sys.argv[1], "w"), indent=2)
sys.exit(0 if all(c["passed"] for c in cases.values()) else 1)
PYEOF
part ddp_fsdp2 60 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
  benchmarks/gpu_equivalence.py --device cuda --out "$WORK/ddp_fsdp2.json"

# 2. train GPT-2 124M in bf16 ------------------------------------------------------------
part train 100 "$PY" -m gradaccum train --model gpt2-124m --precision bf16 --seq-len 1024 \
  --micro-batch 16 --tokens-per-step 262144 --max-steps 12 --eval-every 0 --save-every 0 \
  --device cuda --out "$WORK/train-run" --json

# 3. bench against the Trainer on GPT-2 124M ----------------------------------------------
"$PY" -c "from transformers import GPT2Config; GPT2Config().save_pretrained('$WORK/gpt2')"
part bench 100 "$PY" -m gradaccum bench --model-config "$WORK/gpt2/config.json" --peers trainer \
  --micro-batch 8 --accum-steps 4 --seq-len 1024 --rounds 3 --windows 3 --device cuda --json

# 4. fit against a hand-picked sweep ------------------------------------------------------
# benchmarks/gpu_fit.py: fit's search, then a hand loop timing every micro-batch of the sweep
# and fit's choice, side by side.
part fit 150 "$PY" benchmarks/gpu_fit.py --device cuda --seq-len 1024 --tokens-per-step 512k \
  --sweep 4,8,16,32,64 --steps 3 --out "$WORK/fit"

# 5. packing on CUDA ----------------------------------------------------------------------
part bench_sft 90 "$PY" -m gradaccum bench --task sft --model-config "$WORK/gpt2/config.json" \
  --micro-batch 8 --accum-steps 4 --seq-len 1024 --rounds 3 --windows 3 --device cuda --json
part train_sft 50 "$PY" -m gradaccum train --task sft --packing padding-free --compile \
  --model small --precision bf16 --max-steps 20 --eval-every 0 --save-every 0 --device cuda \
  --out "$WORK/sft-run" --json
part train_docmask 20 "$PY" -m gradaccum train --document-mask --model small --precision bf16 \
  --seq-len 512 --micro-batch 16 --max-steps 10 --eval-every 0 --save-every 0 --device cuda \
  --out "$WORK/docmask-run" --json

# 6. QLoRA, the seeds' first example on one card ------------------------------------------
# (its defaults: --seq-len 2048 --micro-batch 1 --accum-steps 128 --lora-rank 16). On a CPU,
# PARTS=qlora_7b QLORA_FLAGS="--device cpu --tiny" RESULTS=/tmp/r bash benchmarks/gpu_suite.sh
# runs this part and the results' code on a tiny Llama.
# shellcheck disable=SC2086  # QLORA_FLAGS: several words
part qlora_7b 420 "$PY" benchmarks/qlora_gpu.py --device cuda --steps 2 --checkpointing both \
  --json "$WORK/qlora_7b.json" ${QLORA_FLAGS:-}

# 7. the gradient-sync policies on one device ---------------------------------------------
# benchmarks/sync_policies.py: FSDP2 on a 1-rank mesh, window and micro on bf16 parameters
# (fp32 reduction): step time and peak memory; the multi-rank times are the planner's. On a
# CPU, PARTS=sync_policies SYNC_FLAGS="--preset tiny --vocab 512 --seq-len 64" runs it small.
# shellcheck disable=SC2086  # SYNC_FLAGS: several words
part sync_policies 120 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
  benchmarks/sync_policies.py --preset gpt2-124m --vocab 50304 --seq-len 1024 --micro-batch 8 \
  --accum-steps 8 --bf16-params --rounds 5 --out "$WORK/sync_policies.json" ${SYNC_FLAGS:-}

# results ---------------------------------------------------------------------------------
"$PY" - "$WORK" "$RESULTS" "$PEAK_TFLOPS" "$started" <<'PYEOF'
import json, os, sys, time
import torch
from gradaccum.utils.atomic import write_text_atomic

work, results, peak, started = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])

def read(name):
    rc = int(open(os.path.join(work, name + ".rc")).read().strip() or 1)
    text = open(os.path.join(work, name + ".out")).read()
    err = open(os.path.join(work, name + ".err")).read().strip().splitlines()
    status = {0: "ok", 124: "timed out", 125: "skipped"}.get(rc, f"exit {rc}")
    try:
        data = json.loads(text) if text.strip() else None
    except ValueError:
        data = None
    return {"status": status, "json": data, "last_line": err[-1] if err else ""}

def load(path):
    return json.load(open(path)) if os.path.exists(path) else None

out = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device", "torch": torch.__version__,
       "peak_tflops": peak, "wall_s": round(time.time() - started)}
out["precision"] = {**read("precision"), "json": load(os.path.join(work, "precision.json"))}
out["ddp_fsdp2"] = {**read("ddp_fsdp2"), "json": load(os.path.join(work, "ddp_fsdp2.json"))}
train = read("train")
if train["json"]:
    s = train["json"]
    flops_per_token = 6 * s["params"] + 12 * 12 * 768 * 1024  # 6N + 12 L d T
    train["mfu"] = s["tokens_per_s"] * flops_per_token / (peak * 1e12)
out["train"] = train
out["bench"] = read("bench")
out["fit"] = {**read("fit"), "json": load(os.path.join(work, "fit", "gpu_fit.json"))}
for name in ("bench_sft", "train_sft", "train_docmask"):
    out[name] = read(name)
out["qlora_7b"] = {**read("qlora_7b"), "json": load(os.path.join(work, "qlora_7b.json"))}
out["sync_policies"] = {**read("sync_policies"),
                        "json": load(os.path.join(work, "sync_policies.json"))}
write_text_atomic(os.path.join(results, "gpu_suite.json"), json.dumps(out, indent=2))

md = [f"# GPU suite: {out['device']}, torch {out['torch']}, {out['wall_s']} s", ""]
md += ["| part | status | figures |", "| --- | --- | --- |"]
p = out["precision"]["json"] or {}
md.append(f"| engine vs float64 big batch | {out['precision']['status']} | " + ", ".join(
    f"{k} {v['update_rel_err']:.1e}" for k, v in p.items()) + " |")
cases = (out["ddp_fsdp2"]["json"] or {}).get("cases", [])
md.append(f"| DDP / FSDP2 vs one process | {out['ddp_fsdp2']['status']} | "
          + ", ".join(f"{c.get('wrapper')} {c.get('grad_rel_error', float('nan')):.1e}"
                      for c in cases) + " |")
if train["json"]:
    s = train["json"]
    md.append(f"| train gpt2-124m bf16 | ok | {s['tokens_per_s']:,.0f} tokens/s, "
              f"MFU {train['mfu']:.1%} of {peak:g} TFLOP/s |")
else:
    md.append(f"| train gpt2-124m bf16 | {train['status']} | {train['last_line']} |")
b = out["bench"]["json"]
if b:
    md.append(f"| bench GPT-2 124M | ok | " + "; ".join(
        f"{r['name']} {r['tokens_per_s'] or 0:,.0f} tok/s, err {r['update_rel_err'] or 0:.1e}"
        for r in b["results"] if not r["skipped"]) + f"; overhead ratio {b['overhead_ratio']:.3f} |")
else:
    md.append(f"| bench GPT-2 124M | {out['bench']['status']} | {out['bench']['last_line']} |")
fit = out["fit"]
md.append(f"| fit vs hand-picked sweep (gpu_fit.py) | {fit['status']} | "
          + (json.dumps({k: v for k, v in fit["json"].items() if not isinstance(v, (list, dict))})[:300]
             if fit["json"] else fit["last_line"]) + " |")
b = out["bench_sft"]["json"]
if b:
    md.append(f"| bench --task sft GPT-2 124M | ok | " + "; ".join(
        f"{r['name']} {r.get('tokens_per_s') or 0:,.0f} counted tok/s, "
        f"pad {r.get('padding') or 0:.0%}, err {r.get('update_rel_err') or 0:.1e}"
        for r in b["results"] if not r.get("skipped")) + " |")
else:
    md.append(f"| bench --task sft GPT-2 124M | {out['bench_sft']['status']} | "
              f"{out['bench_sft']['last_line']} |")
for name, what in (("train_sft", "train --task sft padding-free --compile bf16"),
                   ("train_docmask", "train --document-mask bf16")):
    s = out[name]["json"]
    figures = (f"{s['tokens_per_s']:,.0f} tokens/s, loss {s.get('final_loss')}" if s
               else out[name]["last_line"])
    md.append(f"| {what} | {out[name]['status']} | {figures} |")
q = out["qlora_7b"]["json"]
if q:
    md.append(f"| QLoRA {q['model']}, NF4, LoRA {q['lora']['rank']}, {q['micro_batch']} x "
              f"{q['seq_len']}, k {q['accum_steps']} (qlora_gpu.py) | ok | " + "; ".join(
        f"checkpointing {'on' if a['checkpointing'] else 'off'}: {a['micro_step_s'] * 1e3:.0f} ms"
        f" per micro-step, {a['tokens_per_s']:,.0f} tokens/s, peak {a['peak_bytes'] / 1e9:.1f} GB"
        f" (plan {a['plan_total_gb']:.1f} GB)" for a in q["arms"]) + " |")
else:
    md.append(f"| QLoRA 7B shape (qlora_gpu.py) | {out['qlora_7b']['status']} | "
              f"{out['qlora_7b']['last_line']} |")
sp = out["sync_policies"]["json"]
if sp:
    md.append(f"| sync policies, FSDP2 1 rank, {sp['preset']} {sp['parameter_dtype']} "
              f"(sync_policies.py) | ok | " + "; ".join(
        f"{name} {p['median_ms_per_step']:.0f} ms/step ({p['median_ratio_to_window']:.2f}x), "
        f"peak {(p['peak_memory_bytes'] or 0) / 1e9:.2f} GB" for name, p in sp["policies"].items())
        + " |")
else:
    md.append(f"| sync policies (sync_policies.py) | {out['sync_policies']['status']} | "
              f"{out['sync_policies']['last_line']} |")
write_text_atomic(os.path.join(results, "gpu_suite.md"), "\n".join(md) + "\n")
print("\n".join(md))
PYEOF
