"""Throughput of tokenmill at several source trees (commits), alternating, in one run.

Each round runs `bench_throughput.py --rounds 1` (this checkout's: the same workload for
all) once per tree, in a process whose `tokenmill` package is that tree (a PYTHONPATH entry
linking to it), so a change is measured against the commit before it under the same
conditions; the first run of the first round also runs HF (`--compare hf`) as the baseline.
Other arguments go to bench_throughput.py.

    git worktree add /tmp/before <commit>
    python scripts/bench_commits.py --trees /tmp/before . --rounds 3
    python scripts/bench_commits.py --trees /tmp/before . --rounds 3 --no-hf -- --mode inproc
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def commit_of(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "log", "-1", "--format=%h %s"],
                         capture_output=True, text=True)  # fmt: skip
    return out.stdout.strip()[:60] or str(tree)


def rate_of(output: str, engine: str) -> float:
    """The output tok/s column of the engine's row in bench_throughput's table."""
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0].startswith(engine):
            return float(cells[3])
    raise RuntimeError(f"no {engine!r} row in bench_throughput's output:\n{output[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trees", nargs="+", required=True, help="source trees (checkouts)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-hf", action="store_true", help="leave the HF baseline out")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run at most")
    args, rest = parser.parse_known_args()
    rest = [a for a in rest if a != "--"]
    trees = [Path(t).resolve() for t in args.trees]
    links = tempfile.mkdtemp(prefix="tokenmill-trees-")
    envs = []
    for i, tree in enumerate(trees):
        root = Path(links) / str(i)
        root.mkdir()
        (root / "tokenmill").symlink_to(tree)
        env = dict(os.environ)
        # No empty entry (it would put the working directory, the repository's root with
        # its kernels/ folder shadowing the PyPI package, on the path).
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
        envs.append(env)
    rates: list[list[float]] = [[] for _ in trees]
    hf = None
    for r in range(args.rounds):
        for i, tree in enumerate(trees):
            with_hf = r == 0 and i == 0 and not args.no_hf
            cmd = [sys.executable, str(HERE / "bench_throughput.py"), "--rounds", "1", *rest]
            if with_hf:
                cmd += ["--compare", "hf"]
            done = subprocess.run(cmd, env=envs[i], capture_output=True, text=True,
                                  timeout=args.timeout)  # fmt: skip
            if done.returncode:
                sys.exit(f"bench_throughput.py failed for {tree}:\n{done.stderr[-3000:]}")
            rates[i].append(rate_of(done.stdout, "tokenmill"))
            if with_hf:
                hf = rate_of(done.stdout, "hf transformers")
            print(f"round {r + 1}, {commit_of(tree)}: {rates[i][-1]:.1f} tok/s", flush=True)
    print()
    print(f"best of {args.rounds} alternating rounds; HF (first round): "
          f"{'-' if hf is None else f'{hf:.1f} tok/s'}")  # fmt: skip
    print("| tree | commit | rounds (tok/s) | best tok/s | vs first tree | vs HF |")
    print("|---|---|---|---|---|---|")
    first = max(rates[0])
    for tree, rs in zip(trees, rates):
        best = max(rs)
        vs_hf = f"{best / hf:.2f}x" if hf else "-"
        print(f"| {tree.name} | {commit_of(tree)} | {', '.join(f'{x:.1f}' for x in rs)} | "
              f"{best:.1f} | {best / first:.3f} | {vs_hf} |")  # fmt: skip


if __name__ == "__main__":
    main()
