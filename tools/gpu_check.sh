#!/usr/bin/env bash
# GPU check: on a machine with an NVIDIA GPU and graphflop already installed (this script
# installs nothing), time seed B's models and ResNet-50 on ONNX Runtime's CUDA provider and in
# eager PyTorch on CUDA, and print one table. Budget: under 5 minutes.
# Usage: bash tools/gpu_check.sh [OUT_DIR]     (JSON per model goes to OUT_DIR, default /tmp)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/graphflop-gpu}
mkdir -p "$out"
py=${PYTHON:-python3}
[ -x .venv/bin/python ] && py=.venv/bin/python
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$py" -c "import torch, onnxruntime as o; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), '| onnxruntime', o.__version__, o.get_available_providers())"
for spec in models/logreg.py models/mlp.py models/cnn.py "models/resnet.py:resnet50 --batch 32"; do
  name=$(echo "$spec" | sed 's#models/##; s#[ :]#_#g; s#--batch_#b#')
  # shellcheck disable=SC2086
  timeout 120 "$py" -m graphflop.cli bench $spec --runtime both --device cuda --repeat 20 \
    --json "$out/$name.json" > "$out/$name.txt" 2>&1 || echo "bench $spec failed: see $out/$name.txt"
done
"$py" - "$out" <<'PY'
import json, pathlib, sys
rows = []
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
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
# Predicted against measured step time on the GPU (tools/bench_time.py): calibrate the GPU,
# then time MLP, CNN, ResNet-18 and GPT-2 small in eager PyTorch on CUDA beside graphflop's
# prediction from the H100 SXM data sheet (before) and from the calibration (after). Nothing
# depends on it: a failure prints where its log is.
if "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  timeout 900 "$py" tools/bench_time.py --device cuda --calibrate --gpu-spec h100-sxm \
    --save-profile "$out/cuda_profile.json" --repeat 5 --doc "$out/time.md" \
    --json "$out/time.json" > "$out/time.txt" 2>&1 \
    && echo "predicted vs measured step time: $out/time.md" \
    || echo "bench_time on cuda failed: see $out/time.txt"
fi
