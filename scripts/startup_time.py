"""How long `LLM()` takes to be ready, and where the time goes.

Starts the engine `--runs` times (each in a fresh process, as a user's script would), the
default model by default, and prints per run: importing tokenmill, `LLM()` in all, the
engine core's own stages (its process start and imports, its workers with torch's import and
the model load, KV cache, scheduler), what those leave of `LLM()` (the spawn, the handshake
and whatever of the tokenizer's load, on a thread of the frontend meanwhile, outlasted the
core), and then how long a first short request takes (8 tokens; the KV cache's pages are
still being committed on a thread of the worker then).

    python scripts/startup_time.py
    python scripts/startup_time.py --runs 5 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_CHILD = r"""
import json, sys, time
start = time.perf_counter()
from tokenmill import LLM, SamplingParams
imported = time.perf_counter()
llm = LLM(**json.loads(sys.argv[1]))
ready = time.perf_counter()
llm.generate("Hello, my name is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
answered = time.perf_counter()
stats = llm.get_stats()
llm.shutdown()
print(json.dumps({"import tokenmill": imported - start, "LLM()": ready - imported,
                  "first request": answered - ready, "core": stats["startup_s"]}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    engine_args = {"model": args.model, "dtype": args.dtype}
    rows = []
    for _ in range(args.runs):
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(engine_args)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode:
            sys.exit(f"the engine failed to start:\n{done.stderr[-3000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    stages = list(rows[0]["core"])
    columns = ["import tokenmill", "LLM()", *stages, "frontend rest", "first request"]
    print("| run | " + " | ".join(columns) + " |")
    print("|" + "---|" * (len(columns) + 1))
    for i, row in enumerate(rows, 1):
        row["frontend rest"] = row["LLM()"] - sum(row["core"].values())
        cells = [row["import tokenmill"], row["LLM()"], *row["core"].values(),
                 row["frontend rest"], row["first request"]]  # fmt: skip
        print(f"| {i} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    totals = [r["import tokenmill"] + r["LLM()"] for r in rows]
    print(
        f"import + LLM(): best {min(totals):.2f} s, median {statistics.median(totals):.2f} s "
        f"over {len(rows)} runs (seconds throughout)"
    )


if __name__ == "__main__":
    main()
