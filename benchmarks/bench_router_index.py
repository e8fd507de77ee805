"""The router's in-memory block index, measured: memory per claim, and the CPU of one routing lookup.

Memory: a fresh child process per (index, replicas, blocks) builds the index the way the
KV events fill it (batches of ``--batch`` 32-byte hashes per replica) and reports its RSS
growth over the claims it holds. ``distinct``: no two replicas hold the same block (the
worst case, one table entry per claim); ``shared``: every replica holds the same blocks
(a fleet that serves one long system prompt). Only what is run is reported; where
``--blocks`` stops short of 500,000 the extrapolation to 32 x 500,000 claims is printed as
such, beside the measurements.

Routing: a whole decision, :meth:`kvpool.router.Router.rank` of a keyed prompt at
``--replicas`` precise replicas (block size 16) over each index, and the keying of the
prompt (its block hashes) beside it, the same for both.

Lookup: both indexes in one process, each holding ``--background`` distinct blocks per
replica plus a prompt of ``--prompt-blocks`` blocks whose leading blocks each replica
holds to a different depth (replica ``r`` of ``R``: ``(r + 1) / R`` of the prompt). Timed:
``match_media(prompt, replicas)`` (what :class:`kvpool.router.ranking.Ranker` asks the index
per request, precise mode) and ``store(replica, prompt)`` (what approximate mode's memory
notes per request routed), medians of ``--repeats`` calls with ``time.perf_counter``, and
the process CPU (``time.process_time``) over all of them, per call.

``--before PATH`` is the ``index.py`` of the code before (a ``git worktree`` of the older
commit); without it only the current index is measured.

    git worktree add /tmp/kvpool-before <commit>
    python benchmarks/bench_router_index.py --before /tmp/kvpool-before/src/kvpool/router/index.py \\
        --blocks 10000 50000 --before-blocks 10000 50000 --after-blocks 500000
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve()
CURRENT = HERE.parent.parent / "src" / "kvpool" / "router" / "index.py"


def load_index(path: Path, name: str) -> ModuleType:
    """The index module at ``path`` under ``name`` (the older one beside the current one)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"no module at {path}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def block(owner: int, j: int) -> bytes:
    """A 32-byte hash, as vLLM's sha256 ones are: distinct per (owner, j)."""
    return (b"kv" + owner.to_bytes(4, "big") + j.to_bytes(8, "big")).ljust(32, b"\x5a")


def replica(r: int) -> str:
    return f"http://10.0.0.{r}:8000"


def child_memory(path: str, replicas: int, blocks: int, layout: str, batch: int) -> dict[str, Any]:
    module = load_index(Path(path), "bench_index")
    rss0 = rss_bytes()
    index = module.MemoryIndex(max_blocks=replicas * blocks + 1, max_blocks_per_replica=blocks + 1)
    start = time.process_time()
    for r in range(replicas):
        owner = r if layout == "distinct" else 0
        for first in range(0, blocks, batch):
            index.store(replica(r), [block(owner, j) for j in range(first, min(blocks, first + batch))])
        print(f"  ... replica {r + 1}/{replicas} stored", file=sys.stderr, flush=True) if r % 8 == 7 else None
    seconds = time.process_time() - start
    claims = index.figures()["claims"]
    assert claims == replicas * blocks, f"{claims} claims held, {replicas * blocks} stored"
    grown = rss_bytes() - rss0
    return {"claims": claims, "rss_growth": grown, "per_claim": grown / claims, "store_cpu_s": seconds}


def memory(path: Path, label: str, replicas: int, blocks: int, layout: str, batch: int) -> dict[str, Any]:
    print(f"memory: {label} {layout} {replicas} x {blocks:,} ...", file=sys.stderr, flush=True)
    command = [sys.executable, str(HERE), "--child", str(path), str(replicas), str(blocks), layout, str(batch)]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    result: dict[str, Any] = json.loads(done.stdout)
    return {"index": label, "layout": layout, "replicas": replicas, "blocks": blocks, **result}


def filled(
    module: ModuleType, replicas: int, prompt_blocks: int, background: int
) -> tuple[Any, list[str], list[bytes]]:
    """An index of ``module`` as the lookups find it (see the module), its replicas' names, and the prompt."""
    index = module.MemoryIndex()
    names = [replica(r) for r in range(replicas)]
    for r, name in enumerate(names):
        for first in range(0, background, 1000):
            index.store(name, [block(1000 + r, j) for j in range(first, min(background, first + 1000))])
    prompt = [block(999, j) for j in range(prompt_blocks)]
    expected = [max(1, (r + 1) * prompt_blocks // replicas) for r in range(replicas)]
    for name, depth in zip(names, expected):
        index.store(name, prompt[:depth])
    depths = [sum(n for _, n in runs) for runs in index.match_media(prompt, names)]
    assert depths == expected, f"match found {depths[:4]}..., stored {expected[:4]}..."
    return index, names, prompt


def lookups(
    modules: dict[str, ModuleType], replicas: int, prompt_blocks: int, background: int, repeats: int
) -> dict[str, dict[str, float]]:
    """Per index, the median wall time and the mean CPU of its calls, in microseconds.

    The indexes' calls alternate, so that a machine busy with something else slows each alike.
    """
    built = {label: filled(module, replicas, prompt_blocks, background) for label, module in modules.items()}
    figures: dict[str, dict[str, float]] = {label: {} for label in modules}
    for what in ("match_media", "store"):
        walls: dict[str, list[float]] = {label: [] for label in modules}
        cpu: dict[str, float] = dict.fromkeys(modules, 0.0)
        for _ in range(repeats):
            for label, (index, names, prompt) in built.items():
                c0, t0 = time.process_time(), time.perf_counter()
                if what == "match_media":
                    index.match_media(prompt, names)
                else:
                    index.store(names[0], prompt)
                walls[label].append(time.perf_counter() - t0)
                cpu[label] += time.process_time() - c0
        for label in modules:
            figures[label][f"{what}_median_us"] = statistics.median(walls[label]) * 1e6
            figures[label][f"{what}_cpu_us"] = cpu[label] / repeats * 1e6
    return figures


class _Bytes:
    """A tokenizer of the prompt's UTF-8 bytes: instant, so the ranking is what is timed."""

    loaded = True

    def load(self) -> None:
        pass

    def chat_tokens(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return list("".join(m["content"] for m in messages).encode())

    def text_tokens(self, prompt: str) -> list[int]:
        return list(prompt.encode())


def ranking(
    modules: dict[str, ModuleType], replicas: int, prompt_blocks: int, background: int, repeats: int
) -> dict[str, dict[str, float]]:
    """Per index, a whole routing decision (:meth:`Router.rank` of a keyed prompt) at ``replicas`` precise replicas.

    Also the keying of the prompt (block hashes, sha256 at block size 16), the same for
    both. Medians of wall time and mean CPU, in microseconds; the indexes' calls alternate.
    """
    from kvpool.openai_http.protocol import GenerationEndpoint, parse_generation
    from kvpool.router import RouteOptions, Router
    from kvpool.router.replica_config import parse_replica
    from kvpool.tenancy import DEFAULT_TENANT, SaltPolicy

    specs = tuple(
        parse_replica(
            f"http://127.0.0.1:{9000 + 2 * r},events=tcp://127.0.0.1:{9001 + 2 * r},block-size=16,hash=sha256"
        )
        for r in range(replicas)
    )
    options = RouteOptions(replicas=specs, tokenizer=_Bytes(), keys=None, salts=SaltPolicy.shared())
    text = "".join(chr(97 + (j * 7) % 26) for j in range(16 * prompt_blocks + 1))
    request = parse_generation(GenerationEndpoint.CHAT, {"model": "m", "messages": [{"role": "user", "content": text}]})
    routers = {}
    for label, module in modules.items():
        router = Router(options, module.MemoryIndex())
        for replica in router.replicas:
            replica.up, replica.events = True, replica.described
        keys = router.prompt_keys(request, DEFAULT_TENANT)
        prompt = next(iter(keys.hashes.values()))
        assert len(prompt) == prompt_blocks, f"{len(prompt)} blocks keyed"
        for r, replica in enumerate(router.replicas):
            for first in range(0, background, 1000):
                router.index.store(
                    replica.url, [block(1000 + r, j) for j in range(first, min(background, first + 1000))]
                )
            router.index.store(replica.url, prompt[: max(1, (r + 1) * prompt_blocks // replicas)])
        routers[label] = (router, keys)
    figures: dict[str, dict[str, float]] = {label: {} for label in modules}
    for what in ("keys", "rank"):
        walls: dict[str, list[float]] = {label: [] for label in modules}
        cpu: dict[str, float] = dict.fromkeys(modules, 0.0)
        for _ in range(repeats):
            for label, (router, keys) in routers.items():
                c0, t0 = time.process_time(), time.perf_counter()
                if what == "keys":
                    router.prompt_keys(request, DEFAULT_TENANT)
                else:
                    router.rank(keys)
                walls[label].append(time.perf_counter() - t0)
                cpu[label] += time.process_time() - c0
        for label in modules:
            figures[label][f"{what}_median_us"] = statistics.median(walls[label]) * 1e6
            figures[label][f"{what}_cpu_us"] = cpu[label] / repeats * 1e6
    return figures


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        path, replicas, blocks, layout, batch = sys.argv[2:7]
        print(json.dumps(child_memory(path, int(replicas), int(blocks), layout, int(batch))))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="the older index.py, measured beside the current one")
    parser.add_argument("--replicas", type=int, default=32)
    parser.add_argument("--blocks", type=int, nargs="+", default=[10_000, 50_000], help="blocks per replica, both")
    parser.add_argument(
        "--before-blocks", type=int, nargs="*", default=None, help="the older index only (default --blocks)"
    )
    parser.add_argument("--after-blocks", type=int, nargs="*", default=[], help="the current index only, in addition")
    parser.add_argument("--layouts", nargs="+", default=["distinct", "shared"], choices=["distinct", "shared"])
    parser.add_argument("--batch", type=int, default=1000, help="hashes per store (an event batch)")
    parser.add_argument("--prompt-blocks", type=int, nargs="+", default=[64, 1000])
    parser.add_argument("--background", type=int, default=10_000, help="distinct blocks per replica in the lookups")
    parser.add_argument("--repeats", type=int, default=1000)
    parser.add_argument("--no-memory", action="store_true", help="the lookups only")
    parser.add_argument("--no-lookups", action="store_true", help="the memory only")
    args = parser.parse_args()

    indexes = [("after", CURRENT)] + ([("before", args.before)] if args.before else [])
    rows: list[dict[str, Any]] = []
    for layout in [] if args.no_memory else args.layouts:
        for blocks in sorted(set(args.blocks) | set(args.after_blocks)):
            rows.append(memory(CURRENT, "after", args.replicas, blocks, layout, args.batch))
        if args.before:
            for blocks in args.blocks if args.before_blocks is None else args.before_blocks:
                rows.append(memory(args.before, "before", args.replicas, blocks, layout, args.batch))
    print(f"\nRSS growth per claim, {args.replicas} replicas (measured):")
    print(
        f"{'index':<7} {'layout':<9} {'blocks/replica':>14} {'claims':>11} {'RSS growth':>11} {'B/claim':>8} {'store CPU':>10}"
    )
    for row in rows:
        print(
            f"{row['index']:<7} {row['layout']:<9} {row['blocks']:>14,} {row['claims']:>11,} "
            f"{row['rss_growth'] / 2**20:>8.0f} MiB {row['per_claim']:>8.1f} {row['store_cpu_s']:>8.1f} s"
        )
    goal = args.replicas * 500_000
    print(f"\nAt {args.replicas} x 500,000 = {goal:,} claims:")
    for label, _ in indexes:
        for layout in args.layouts:
            mine = [r for r in rows if r["index"] == label and r["layout"] == layout]
            if not mine:
                continue
            largest = max(mine, key=lambda r: r["claims"])
            how = "measured" if largest["claims"] >= goal else f"extrapolated from {largest['claims']:,} claims"
            print(f"  {label:<7} {layout:<9} {largest['per_claim'] * goal / 2**30:6.2f} GiB ({how})")

    if args.no_lookups:
        return
    modules = {label: load_index(path, f"bench_{label}") for label, path in indexes}
    print(f"\nOne lookup, {args.replicas} replicas, {args.background:,} other blocks each, {args.repeats} calls:")
    print(f"{'index':<7} {'prompt':>7} {'match_media':>12} {'(CPU)':>8} {'store':>9} {'(CPU)':>8}  microseconds")
    measured: dict[tuple[str, int], dict[str, float]] = {}
    for prompt_blocks in args.prompt_blocks:
        for label, found in lookups(modules, args.replicas, prompt_blocks, args.background, args.repeats).items():
            measured[(label, prompt_blocks)] = found
            print(
                f"{label:<7} {prompt_blocks:>7} {found['match_media_median_us']:>12.1f} {found['match_media_cpu_us']:>8.1f}"
                f" {found['store_median_us']:>9.1f} {found['store_cpu_us']:>8.1f}"
            )
    print(f"\nOne routing decision (Router.rank), {args.replicas} precise replicas, {args.repeats} calls:")
    print(f"{'index':<7} {'prompt':>7} {'rank':>9} {'(CPU)':>8} {'keying':>9} {'(CPU)':>8}  microseconds")
    for prompt_blocks in args.prompt_blocks:
        for label, found in ranking(modules, args.replicas, prompt_blocks, args.background, args.repeats).items():
            measured[(label, prompt_blocks)].update(found)
            print(
                f"{label:<7} {prompt_blocks:>7} {found['rank_median_us']:>9.1f} {found['rank_cpu_us']:>8.1f}"
                f" {found['keys_median_us']:>9.1f} {found['keys_cpu_us']:>8.1f}"
            )
    if args.before:
        for prompt_blocks in args.prompt_blocks:
            old, new = measured[("before", prompt_blocks)], measured[("after", prompt_blocks)]
            print(
                f"  {prompt_blocks} blocks: rank {old['rank_median_us'] / new['rank_median_us']:.1f}x faster (medians)"
            )
            print(
                f"  {prompt_blocks} blocks: match_media {old['match_media_median_us'] / new['match_media_median_us']:.1f}x"
                f" faster, store {old['store_median_us'] / new['store_median_us']:.1f}x faster (medians, before/after)"
            )


if __name__ == "__main__":
    main()
