#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU, build a small TensorRT-LLM engine, serve it
# from the rendered production repository, and run the sidecar's integration tests against it.
# Run it inside the TensorRT-LLM image named in deploy/versions.env:
#   source deploy/versions.env
#   docker run --rm --gpus all --shm-size 2g -v "$PWD:/work" -w /work "$TRITON_TRTLLM_IMAGE" \
#     deploy/gpu_check.sh
# The engine is a 2-layer Llama with random weights and DeepSeek-V4's vocabulary (fp16: AWQ
# calibration needs a dataset download), so the packaged tokenizer fits it.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "${here}")"
# shellcheck source=deploy/versions.env
source "${here}/versions.env"
work="$(mktemp -d)"
triton_pid=""
cleanup() {
  if [[ -n "${triton_pid}" ]]; then kill "${triton_pid}" 2>/dev/null || true; fi
  rm -rf "${work}"
}
trap cleanup EXIT

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
installed="$(python3 -c 'import tensorrt_llm; print(tensorrt_llm.__version__)' 2>/dev/null | tail -n 1)"
[[ "${installed}" == "${TRTLLM_VERSION}" ]] || {
  echo "TensorRT-LLM '${installed}' here; deploy/versions.env pins ${TRTLLM_VERSION}" >&2
  exit 1
}

echo "1/5 installing scheduler-svc and its test tools ..."
pip install --quiet --break-system-packages -e "${root}[dev]"
(cd "${root}" && python3 -m scheduler_svc.tools.protogen)

echo "2/5 a small random-weight Llama checkpoint ..."
python3 - "${work}/hf" <<'PY'
import sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
config = LlamaConfig(vocab_size=129280, hidden_size=256, intermediate_size=1024,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                     max_position_embeddings=4096, bos_token_id=0, eos_token_id=1,
                     pad_token_id=2, torch_dtype="float16")
LlamaForCausalLM(config).half().save_pretrained(sys.argv[1])
PY

echo "3/5 building the engine (paged KV, 16 tokens a block) ..."
git clone --quiet --depth 1 --branch "v${TRTLLM_VERSION}" \
  https://github.com/NVIDIA/TensorRT-LLM.git "${work}/trtllm"
python3 "${work}/trtllm/examples/llama/convert_checkpoint.py" \
  --model_dir "${work}/hf" --output_dir "${work}/ckpt" --dtype float16
trtllm-build --checkpoint_dir "${work}/ckpt" --output_dir "${work}/engine" \
  --gemm_plugin auto --gpt_attention_plugin auto --kv_cache_type paged \
  --tokens_per_block 16 --use_paged_context_fmha enable --remove_input_padding enable \
  --max_batch_size 16 --max_num_tokens 4096 --max_input_len 2048 --max_seq_len 3072

echo "4/5 rendering the production repository and starting Triton ..."
(cd "${root}" && scheduler-svc model-repo render --out "${work}/repo" \
  --set engine_dir="${work}/engine" --set tokenizer_dir=deepseek-v4 \
  --set end_id=1 --set pad_id=2 --set max_batch_size=16)
tritonserver --model-repository="${work}/repo" --grpc-port=8001 --http-port=8000 \
  --metrics-port=8002 --log-info=false &
triton_pid=$!
for _ in $(seq 1 120); do
  if curl -fs http://127.0.0.1:8000/v2/health/ready >/dev/null; then break; fi
  sleep 2
done
curl -fs http://127.0.0.1:8000/v2/health/ready >/dev/null

echo "5/5 the sidecar's integration tests against TensorRT-LLM ..."
cd "${root}"
# Two tests read the CPU engine's own token counter, which TensorRT-LLM does not export.
SCHEDULER_SVC_TRITON="127.0.0.1:8001,http://127.0.0.1:8002/metrics" \
  python3 -m pytest -q tests/integration/test_sidecar.py \
  -k "not cancellation_mid_stream and not deadline_is_propagated"
