"""How fast the CPU reference engine runs: one prefill, one decode step, on one core.

The engine is sized so that scheduling effects look the way they would for an 8B model on one
A100: a decode step for 16 running sequences should take roughly 10-40 ms and the prefill of
1,024 tokens roughly 50-300 ms. This measures both (and neighbours) through the engine's own
batcher and model runner, prints a Markdown table and writes results/engine_timing.json.

    .venv/bin/python benchmarks/engine_timing.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from reference_engine.batcher import Batcher
from reference_engine.config import EngineConfig
from reference_engine.llama import ModelRunner
from reference_engine.request import RowSpec, Sampling

PROMPT_TOKEN = 1000  # any in-vocabulary id: timing does not depend on the text


def _batcher(cfg: EngineConfig, prompts: list[int], max_new: int) -> Batcher:
    batcher = Batcher(cfg)
    for i, n in enumerate(prompts):
        spec = RowSpec((PROMPT_TOKEN,) * n, max_new, -1, cfg.pad_id)
        batcher.add(f"r{i}", [spec], streaming=True, sampling=Sampling(), handle=None)
    return batcher


def time_prefill(cfg: EngineConfig, runner: ModelRunner, length: int, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        batcher = _batcher(cfg, [length], 1)
        plan = batcher.schedule()
        tables = [batcher.pool.table(w.seq.seq_id) for w in plan.works]
        start = time.perf_counter()
        runner.step(plan.works, tables)
        times.append(time.perf_counter() - start)
    return times


def time_decode(
    cfg: EngineConfig, runner: ModelRunner, batch: int, context: int, repeats: int
) -> list[float]:
    batcher = _batcher(cfg, [context] * batch, repeats + 64)
    while True:  # prefill everyone first
        plan = batcher.schedule()
        tables = [batcher.pool.table(w.seq.seq_id) for w in plan.works]
        batcher.commit(plan, runner.step(plan.works, tables))
        if all(not w.is_context for w in plan.works):
            break
    times = []
    for _ in range(repeats):
        plan = batcher.schedule()
        assert len(plan.works) == batch, (len(plan.works), batch, batcher.num_waiting)
        assert all(not w.is_context for w in plan.works)
        tables = [batcher.pool.table(w.seq.seq_id) for w in plan.works]
        start = time.perf_counter()
        sampled = runner.step(plan.works, tables)
        times.append(time.perf_counter() - start)
        batcher.commit(plan, sampled)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="results/engine_timing.json")
    args = parser.parse_args()

    cfg = EngineConfig(max_tokens_in_paged_kv_cache=65_536, max_num_sequences=64)
    start = time.perf_counter()
    runner = ModelRunner(cfg)
    build_s = time.perf_counter() - start
    params = sum(p.numel() for p in runner.model.parameters())
    rows = []
    for length in (128, 512, 1024, 2048, 4096):
        t = time_prefill(cfg, runner, length, max(3, args.repeats // 3))
        rows.append(("prefill", f"{length} tokens", statistics.median(t), min(t)))
    for batch in (1, 4, 16, 32):
        t = time_decode(cfg, runner, batch, 256, args.repeats)
        rows.append(("decode step", f"{batch} seqs x 256 ctx", statistics.median(t), min(t)))
    t = time_decode(cfg, runner, 16, 1024, args.repeats)
    rows.append(("decode step", "16 seqs x 1024 ctx", statistics.median(t), min(t)))

    print(
        f"model: {params / 1e6:.1f} M parameters ({cfg.model.num_layers} layers, width "
        f"{cfg.model.hidden_size}, vocab {cfg.model.vocab_size}); built in {build_s:.1f} s; "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {platform.machine()}"
    )
    print()
    print("| what | shape | median ms | best ms |")
    print("|---|---|---:|---:|")
    for what, shape, median, best in rows:
        print(f"| {what} | {shape} | {median * 1000:.1f} | {best * 1000:.1f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "model": cfg.model.model_dump(),
                "parameters": params,
                "threads": torch.get_num_threads(),
                "rows": [
                    {"what": w, "shape": s, "median_ms": m * 1000, "best_ms": b * 1000}
                    for w, s, m, b in rows
                ],
            },
            indent=2,
        )
    )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
