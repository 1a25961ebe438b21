#!/usr/bin/env bash
# GPU check, on a machine with an NVIDIA GPU (this script installs nothing; graphflop runs from
# this checkout, so it need not be installed, but torch, onnx, onnxruntime, networkx, rich,
# numpy, pyyaml and scikit-learn must import). Budget: under 8 minutes on one H200.
#   1. predicted against measured step time (tools/bench_time.py): calibrate the GPU, then time
#      MLP, CNN, ResNet-18 and GPT-2 small in eager PyTorch on CUDA beside graphflop's
#      prediction from the GPU's data sheet (before; matched from its name) and from the
#      calibration (after). Its JSON is written after each model, so a run cut short keeps what
#      it measured.
#   2. seed B's models and ResNet-50 timed by `graphflop bench` on ONNX Runtime's CUDA provider
#      (where onnxruntime has one; else eager only) and in eager PyTorch on CUDA: one table.
# Nothing depends on it: a step that fails prints where its log is and the next one runs.
# Usage: bash tools/gpu_check.sh [OUT_DIR]     (logs, JSON and time.md go to OUT_DIR)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/graphflop-gpu}
mkdir -p "$out"
py=${PYTHON:-python3}
[ -x .venv/bin/python ] && py=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
"$py" -c "import torch, onnxruntime as o; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '', '| onnxruntime', o.__version__, o.get_available_providers())"
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device: nothing to check"
  exit 1
fi

echo "== step time: calibrate, then predicted vs measured (log: $out/time.txt)"
timeout "${GPU_CHECK_TIME_S:-330}" "$py" tools/bench_time.py --device cuda --calibrate \
  --save-profile "$out/cuda_profile.json" --repeat 5 --doc "$out/time.md" \
  --json "$out/time.json" > "$out/time.txt" 2>&1 \
  && echo "predicted vs measured step time: $out/time.md" \
  || echo "bench_time on cuda failed or was cut short: see $out/time.txt"
grep -E "^(calibrating|MLP|CNN|ResNet|GPT)" "$out/time.txt" || true

runtime=both
"$py" -c "from graphflop.runtime.onnxrt import pick_provider; pick_provider('cuda')" 2>/dev/null \
  || { runtime=torch; echo "onnxruntime has no working CUDA provider here: eager PyTorch only"; }
echo "== bench --runtime $runtime --device cuda"
for spec in models/logreg.py models/mlp.py models/cnn.py "models/resnet.py:resnet50 --batch 32"; do
  name=$(echo "$spec" | sed 's#models/##; s#[ :]#_#g; s#--batch_#b#')
  # shellcheck disable=SC2086
  timeout "${GPU_CHECK_BENCH_S:-60}" "$py" -m graphflop.cli bench $spec --runtime $runtime \
    --device cuda --repeat 20 --json "$out/bench_$name.json" > "$out/bench_$name.txt" 2>&1 \
    || echo "bench $spec failed: see $out/bench_$name.txt"
done
"$py" - "$out" <<'PY'
import json, pathlib, sys
rows = []
for f in sorted(pathlib.Path(sys.argv[1]).glob("bench_*.json")):
    d = json.loads(f.read_text())
    for rt, doc in d["runtimes"].items():
        ph, r = doc["phases"], doc["ratios"]
        rows.append((d["model"], f"{rt}:{doc.get('provider', doc.get('device'))}",
                     *(f"{ph[k]['median_s'] * 1e3:.3f}" for k in ("forward", "train_step", "forward_gradient_step")),
                     *(f"{r[k]:.2f}" for k in ("Rf", "Rb", "Rf_over_Rb"))))
head = ("model", "runtime", "fwd ms", "train ms", "fg ms", "Rf", "Rb", "Rf/Rb")
w = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
for row in [head, *rows]:
    print("  ".join(str(x).ljust(n) for x, n in zip(row, w)))
PY
