#!/usr/bin/env bash
# Build the TensorRT-LLM engines the production repository serves: ModelOpt int4 AWQ
# quantization (or an unquantized FP16 checkpoint), then trtllm-build with a paged KV cache of
# 16 tokens a block. PRECISION (third argument) is awq (the default), fp16, or both: both
# writes ENGINE_DIR/awq and ENGINE_DIR/fp16, the pair the sidecar's precision routes serve
# (docs/operations.md).
# Run inside the TensorRT-LLM image named in deploy/versions.env, on the GPU that will serve:
#   docker run --rm --gpus all -v "$PWD:/work" -v /data:/data -w /work "$TRITON_TRTLLM_IMAGE" \
#     deploy/build_engine.sh /data/hf/Meta-Llama-3-8B-Instruct /data/engines/llama-8b both
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=deploy/versions.env
source "${here}/versions.env"

usage() {
  echo "usage: $0 HF_MODEL_DIR ENGINE_DIR [awq|fp16|both]" >&2
  echo "  env: MAX_BATCH_SIZE (64) MAX_NUM_TOKENS (8192) MAX_INPUT_LEN (7168)" >&2
  echo "       MAX_SEQ_LEN (8192) CALIB_SIZE (512) TRTLLM_EXAMPLES (cloned at v${TRTLLM_VERSION})" >&2
  exit 2
}

[[ $# -eq 2 || $# -eq 3 ]] || usage
model_dir="$1"
engine_dir="$2"
precision="${3:-awq}"
case "${precision}" in
  awq | fp16 | both) ;;
  *) echo "unknown precision '${precision}' (awq, fp16 or both)" >&2; exit 2 ;;
esac
[[ -d "${model_dir}" ]] || { echo "no model folder ${model_dir}" >&2; exit 2; }

max_batch_size="${MAX_BATCH_SIZE:-64}"
max_num_tokens="${MAX_NUM_TOKENS:-8192}"
max_input_len="${MAX_INPUT_LEN:-7168}"
max_seq_len="${MAX_SEQ_LEN:-8192}"
calib_size="${CALIB_SIZE:-512}"
work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT

installed="$(python3 -c 'import tensorrt_llm; print(tensorrt_llm.__version__)' 2>/dev/null | tail -n 1)"
if [[ "${installed}" != "${TRTLLM_VERSION}" ]]; then
  echo "this image has TensorRT-LLM '${installed}'; deploy/versions.env pins ${TRTLLM_VERSION}" >&2
  exit 1
fi

examples="${TRTLLM_EXAMPLES:-}"
if [[ -z "${examples}" ]]; then
  git clone --quiet --depth 1 --branch "v${TRTLLM_VERSION}" \
    https://github.com/NVIDIA/TensorRT-LLM.git "${work}/trtllm"
  examples="${work}/trtllm/examples"
fi

# One engine: the checkpoint (int4 AWQ with calibration, or FP16 as it is), then the build.
build() {
  local qformat="$1" out="$2" checkpoint="${work}/checkpoint-$1"
  local calibration=()
  if [[ "${qformat}" == "int4_awq" ]]; then
    calibration=(--awq_block_size 128 --calib_size "${calib_size}")
    echo "1/2 quantizing ${model_dir} to int4 AWQ (ModelOpt) ..."
  else
    echo "1/2 exporting ${model_dir} as an FP16 checkpoint (no quantization) ..."
  fi
  python3 "${examples}/quantization/quantize.py" \
    --model_dir "${model_dir}" \
    --dtype float16 \
    --qformat "${qformat}" \
    "${calibration[@]}" \
    --output_dir "${checkpoint}"

  echo "2/2 building the engine into ${out} ..."
  trtllm-build \
    --checkpoint_dir "${checkpoint}" \
    --output_dir "${out}" \
    --gemm_plugin auto \
    --gpt_attention_plugin auto \
    --kv_cache_type paged \
    --tokens_per_block 16 \
    --use_paged_context_fmha enable \
    --remove_input_padding enable \
    --max_batch_size "${max_batch_size}" \
    --max_num_tokens "${max_num_tokens}" \
    --max_input_len "${max_input_len}" \
    --max_seq_len "${max_seq_len}"
}

case "${precision}" in
  awq) build int4_awq "${engine_dir}" ;;
  fp16) build full_prec "${engine_dir}" ;;
  both)
    build int4_awq "${engine_dir}/awq"
    build full_prec "${engine_dir}/fp16"
    ;;
esac

echo "engines written under ${engine_dir}; render a repository for each with"
echo "  scheduler-svc model-repo render --out build/model_repo_trtllm --set engine_dir=ENGINE"
