#!/usr/bin/env python3
"""Measure what one packed engine step costs on this machine's GPU, and write a cost profile.

PyTorch and the standard library only: a GPU machine may have no project install and no network.
The model is a decoder of a configurable shape (by default Llama-3-8B's, with DeepSeek-V4's
129,280-token vocabulary) with random weights, written in plain PyTorch: cuBLAS GEMMs,
`scaled_dot_product_attention`, RMSNorm, RoPE, SwiGLU. Each measured step is what an in-flight
engine runs in one iteration: B decode rows at C tokens of context each (their new key and value
written into the cache in place) plus one prompt chunk of P tokens, sharing every GEMM ([B + P,
hidden] rows), with logits for the rows that emit a token. On a GPU each step is timed as CUDA
graph replays with CUDA events (the median of --repeats after warm-up); on the CPU (the project's
tests, with a tiny shape) by the wall clock.

The output is a cost profile in the format `scheduler_svc.profiles` reads (the reference engine's
`cost_profile` parameter, `scheduler-svc simulate --engine-profile`, `bench --engine-profile`):
the raw points, the linear step model fitted to them (least squares on relative error: floor,
per decode row, per context token read, per prompt token), the engine's shape, and the KV pool
from the GPU's memory arithmetic.

    python3 benchmarks/gpu_profile.py --out results/gpu/my-gpu.json --name my-gpu-8b-bf16
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812

FORMAT = "scheduler-svc cost profile 1"
STEP_KEYS = ("floor_s", "per_row_s", "per_context_token_s", "per_prompt_token_s")
# (decode rows, context per row) groups, each measured with every prompt chunk size: the grid of
# the H200 measurements in docs/benchmarks/gpu/ (rows 0: a prompt chunk alone).
PACKED_GROUPS = "0:0,16:1024,64:1024,64:4096,128:2048,256:1024"
PROMPT_CHUNKS = "0,64,128,256,512,1024,2048"
# Decode-only steps (no prompt chunk), for the floor and the per-row cost at short contexts.
DECODE_ONLY = "1:512,8:512,16:512,32:512,64:512,128:512,16:2048,64:2048,128:2048,16:4096"


@dataclass(frozen=True)
class Shape:
    layers: int = 32
    hidden: int = 4096
    inter: int = 14336
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 129_280


def _pairs(text: str) -> list[tuple[int, int]]:
    out = []
    for item in filter(None, text.split(",")):
        rows, _, context = item.partition(":")
        out.append((int(rows), int(context)))
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


class Decoder:
    """The decoder's weights as plain tensors, and one packed step over them."""

    def __init__(self, shape: Shape, device: torch.device, dtype: torch.dtype, seed: int) -> None:
        self.shape, self.device, self.dtype = shape, device, dtype
        generator = torch.Generator(device=device).manual_seed(seed)
        s = shape

        def weight(*size: int) -> torch.Tensor:
            w = torch.empty(*size, device=device, dtype=dtype)
            return w.normal_(0.0, 0.02, generator=generator)

        self.embed = weight(s.vocab, s.hidden)
        self.lm_head = weight(s.hidden, s.vocab)
        self.layers = [
            {
                "q": weight(s.hidden, s.heads * s.head_dim),
                "k": weight(s.hidden, s.kv_heads * s.head_dim),
                "v": weight(s.hidden, s.kv_heads * s.head_dim),
                "o": weight(s.heads * s.head_dim, s.hidden),
                "gate": weight(s.hidden, s.inter),
                "up": weight(s.hidden, s.inter),
                "down": weight(s.inter, s.hidden),
            }
            for _ in range(s.layers)
        ]
        self.parameters = (
            2 * s.vocab * s.hidden
            + s.layers
            * (
                2 * s.hidden * s.heads * s.head_dim
                + 2 * s.hidden * s.kv_heads * s.head_dim
                + 3 * s.hidden * s.inter
                + 2 * s.hidden
            )
            + s.hidden
        )
        inv = 1.0 / (10_000 ** (torch.arange(0, s.head_dim, 2, device=device) / s.head_dim))
        angles = torch.outer(torch.arange(16_384, device=device, dtype=torch.float32), inv)
        self.cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
        self.sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)

    def caches(self, rows: int, context: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's keys and values for `rows` rows of `context` tokens, plus the slot the
        step writes."""
        s = self.shape
        size = (rows, s.kv_heads, context + 1, s.head_dim)
        return [
            (
                torch.randn(size, device=self.device, dtype=self.dtype),
                torch.randn(size, device=self.device, dtype=self.dtype),
            )
            for _ in range(s.layers)
        ]

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def step(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        caches: list[tuple[torch.Tensor, torch.Tensor]],
        rows: int,
        context: int,
    ) -> torch.Tensor:
        """One packed step: `rows` decode tokens first, then the prompt chunk; the emitted ids."""
        s = self.shape
        tokens = ids.shape[0]
        prompt = tokens - rows
        x = self.embed[ids]
        for index, layer in enumerate(self.layers):
            h = F.rms_norm(x, (s.hidden,))
            q = self._rope((h @ layer["q"]).view(tokens, s.heads, s.head_dim), positions)
            k = self._rope((h @ layer["k"]).view(tokens, s.kv_heads, s.head_dim), positions)
            v = (h @ layer["v"]).view(tokens, s.kv_heads, s.head_dim)
            parts = []
            if rows:
                k_cache, v_cache = caches[index]
                k_cache[:, :, context] = k[:rows]  # the new key and value, written in place
                v_cache[:, :, context] = v[:rows]
                out = F.scaled_dot_product_attention(
                    q[:rows].unsqueeze(2), k_cache, v_cache, enable_gqa=True
                )
                parts.append(out.reshape(rows, s.heads * s.head_dim))
            if prompt:
                qp = q[rows:].transpose(0, 1).unsqueeze(0)
                kp = k[rows:].transpose(0, 1).unsqueeze(0)
                vp = v[rows:].transpose(0, 1).unsqueeze(0)
                out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
                parts.append(out[0].transpose(0, 1).reshape(prompt, s.heads * s.head_dim))
            x = x + torch.cat(parts) @ layer["o"]
            h = F.rms_norm(x, (s.hidden,))
            x = x + (F.silu(h @ layer["gate"]) * (h @ layer["up"])) @ layer["down"]
        emitting = x[:rows] if not prompt else torch.cat([x[:rows], x[-1:]])
        logits = F.rms_norm(emitting, (s.hidden,)) @ self.lm_head
        return logits.argmax(-1)


def _timer(
    model: Decoder, rows: int, context: int, prompt: int, graphs: bool
) -> Callable[[], float]:
    """A function that runs the step once and returns its seconds."""
    device = model.device
    caches = model.caches(rows, context) if rows else []
    ids = torch.randint(3, model.shape.vocab, (rows + prompt,), device=device)
    positions = torch.cat(
        [
            torch.full((rows,), context, device=device, dtype=torch.long),
            torch.arange(prompt, device=device),
        ]
    )

    def run() -> torch.Tensor:
        return model.step(ids, positions, caches, rows, context)

    if device.type != "cuda":

        def wall() -> float:
            start = time.perf_counter()
            run()
            return time.perf_counter() - start

        return wall
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(side)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if graphs:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        launch: Callable[[], object] = graph.replay
    else:
        launch = run

    def timed() -> float:
        begin.record()
        launch()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1000.0

    return timed


def measure(
    model: Decoder,
    groups: list[tuple[int, int]],
    prompts: list[int],
    decode_only: list[tuple[int, int]],
    repeats: int,
    graphs: bool,
    progress: Callable[[str], None],
) -> list[dict[str, float]]:
    shapes = [(b, c, p) for b, c in groups for p in prompts if b or p]
    shapes += [(b, c, 0) for b, c in decode_only if (b, c, 0) not in shapes]
    points = []
    for rows, context, prompt in shapes:
        timed = _timer(model, rows, context, prompt, graphs)
        for _ in range(2):
            timed()  # warm-up
        seconds = statistics.median(timed() for _ in range(repeats))
        points.append({"rows": rows, "context": context, "prompt": prompt, "s": seconds})
        shape = f"rows {rows:4d} x context {context:5d} + prompt {prompt:5d}"
        progress(f"{shape}: {seconds * 1e3:8.3f} ms")
        del timed
        if model.device.type == "cuda":
            torch.cuda.empty_cache()
    return points


def fit(points: list[dict[str, float]]) -> dict[str, float]:
    """floor + per_row x rows + per_context_token x rows x context + per_prompt_token x prompt,
    least squares on relative error (each row divided by the measured time), no cost negative:
    a term fitted below zero is held at zero and the rest fitted again (as
    scheduler_svc.profiles.fit does)."""
    a = torch.tensor(
        [[1.0, p["rows"], p["rows"] * p["context"], p["prompt"]] for p in points],
        dtype=torch.float64,
    )
    y = torch.tensor([p["s"] for p in points], dtype=torch.float64)
    scale = a.abs().amax(0).clamp_min(1.0)
    scaled = (a / scale) / y[:, None]
    active = [0, 1, 2, 3]
    while True:
        solution = torch.zeros(4, dtype=torch.float64)
        solved = torch.linalg.lstsq(scaled[:, active], torch.ones_like(y)).solution
        solution[active] = solved
        negative = [i for i in active[1:] if solution[i] < 0]
        if not negative:
            break
        active.remove(min(negative, key=lambda i: float(solution[i])))
    solution = solution / scale
    errors = ((a @ solution - y) / y).abs()
    floor_s, per_row, per_context, per_prompt = (float(v) for v in solution)
    return {
        "floor_s": floor_s,
        "per_row_s": per_row,
        "per_context_token_s": per_context,
        "per_prompt_token_s": per_prompt,
        "median_rel_err": float(errors.median()),
        "max_rel_err": float(errors.max()),
    }


def profile(
    args: argparse.Namespace, shape: Shape, model: Decoder, points: list[dict[str, float]]
) -> dict[str, object]:
    fitted = fit(points)
    element = torch.tensor([], dtype=model.dtype).element_size()
    cuda = model.device.type == "cuda"
    gpu = torch.cuda.get_device_name(0) if cuda else f"CPU ({platform.processor() or 'unknown'})"
    gpu_bytes = args.gpu_bytes or (torch.cuda.get_device_properties(0).total_memory if cuda else 0)
    if not gpu_bytes:
        raise SystemExit("--gpu-bytes is needed off a GPU (the memory the KV pool comes from)")
    timing = "CUDA-graph replays" if cuda and not args.no_graphs else "launches"
    timing += f", median of {args.repeats}" + (" (CUDA events)" if cuda else " (wall clock)")
    return {
        "format": FORMAT,
        "name": args.name,
        "kind": "measured",
        "description": f"{gpu}, a decoder of shape {asdict(shape)}, {args.dtype}",
        "provenance": (
            f"Measured by benchmarks/gpu_profile.py on {gpu} with torch {torch.__version__} "
            f"(CUDA {torch.version.cuda}), {time.strftime('%Y-%m-%d')}: packed steps of random "
            f"weights, {timing}; the step constants are the least-squares fit on relative error "
            "over the points below."
        ),
        "step": {k: fitted[k] for k in STEP_KEYS},
        "fit": {
            "method": "least squares on relative error (benchmarks/gpu_profile.py)",
            "points": len(points),
            "median_rel_err": round(fitted["median_rel_err"], 4),
            "max_rel_err": round(fitted["max_rel_err"], 4),
        },
        "engine": {
            "max_num_sequences": args.max_num_sequences,
            "max_num_tokens": args.max_num_tokens,
            "tokens_per_block": 16,
            "context_chunking_policy": "first_come_first_served",
            "max_seq_len": args.max_seq_len,
            "max_queue_size": 512,
        },
        "memory": {
            "gpu_bytes": gpu_bytes,
            "weight_bytes": model.parameters * element,
            "reserved_bytes": args.reserved_bytes,
            "kv_cache_fraction": args.kv_cache_fraction,
            "kv_bytes_per_token": 2 * shape.layers * shape.kv_heads * shape.head_dim * element,
            "how": (
                f"the device's memory; {model.parameters:,} parameters x {element} bytes; "
                f"{args.reserved_bytes:.3g} bytes reserved for activations and workspace (an "
                f"estimate); kv_cache_fraction {args.kv_cache_fraction} of the rest"
            ),
        },
        "measurements": {
            "source": "benchmarks/gpu_profile.py",
            "gpu": gpu,
            "torch": torch.__version__,
            "model": asdict(shape),
            "timing": timing,
            "points": points,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the profile file to write")
    parser.add_argument("--name", default="measured-gpu", help="the profile's name")
    for field, default in asdict(Shape()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=default)
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--groups", default=PACKED_GROUPS, help="ROWS:CONTEXT pairs")
    parser.add_argument("--prompts", default=PROMPT_CHUNKS, help="prompt chunk sizes")
    parser.add_argument("--decode-only", default=DECODE_ONLY, help="ROWS:CONTEXT, no prompt")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-graphs", action="store_true", help="time eager launches on a GPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpu-bytes", type=float, default=0, help="default: the device's")
    parser.add_argument("--reserved-bytes", type=float, default=4e9)
    parser.add_argument("--kv-cache-fraction", type=float, default=0.9)
    parser.add_argument("--max-num-sequences", type=int, default=256)
    parser.add_argument("--max-num-tokens", type=int, default=8192)
    parser.add_argument("--max-seq-len", type=int, default=8192)
    args = parser.parse_args(argv)
    shape = Shape(**{f: getattr(args, f) for f in asdict(Shape())})
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    device = torch.device(args.device)
    started = time.monotonic()
    with torch.inference_mode():
        model = Decoder(shape, device, dtype, args.seed)
        points = measure(
            model,
            _pairs(args.groups),
            _ints(args.prompts),
            _pairs(args.decode_only),
            args.repeats,
            device.type == "cuda" and not args.no_graphs,
            lambda line: print(line, file=sys.stderr, flush=True),
        )
    result = profile(args, shape, model, points)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    step = result["step"]
    print(
        f"{len(points)} steps in {time.monotonic() - started:.0f} s; fit: floor "
        f"{step['floor_s'] * 1e3:.3f} ms, {step['per_row_s'] * 1e6:.2f} us a row, "
        f"{step['per_context_token_s'] * 1e9:.2f} ns a context token, "
        f"{step['per_prompt_token_s'] * 1e6:.2f} us a prompt token; wrote {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
