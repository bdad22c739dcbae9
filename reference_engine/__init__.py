"""The CPU reference engine: a small LLM behind TensorRT-LLM's `tensorrt_llm` contract.

It runs inside Triton's Python backend (see `model_repo/cpu/tensorrt_llm`). `config`,
`blocks`, `request`, `batcher` and `contract` are plain Python; `llama` needs the `engine`
extra (torch, transformers).
"""
