"""A bounded loopback load test of `deepinfer-node serve` on the demo model (configs/local.toml).

Starts the server on a free loopback port, then sends N requests (default 2,000) with C in
flight (default 64): chat and completions, short/medium/long prompts, 1-16 new tokens, half of
them streamed, some streams cancelled after their first chunks, a few deliberately invalid
(`max_tokens` beyond the context: 400 expected). It reports lost requests (no answer), unintended
errors, p50/p99 time to first token and inter-token latency of the streams, the server's RSS
before and after, the engine's abort counter against the cancellations, checks that the server
still answers afterwards, and ends it with SIGTERM (exit status 0 expected).

    python3 bench/serve_load.py [--requests 2000] [--concurrency 64] [--binary PATH]

Needs `httpx` (installed with the `openai` package: see .ci/run). Everything stays on 127.0.0.1;
each request has a --request-timeout bound (default 1200 s) and the whole run --max-seconds.
"""

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the sea wind over a quiet harbour carries salt and the sound of distant bells".split()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def percentile(values, p):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def plan(n, seed, prompt_words, max_new_tokens, cancel_after):
    """The request mix: (kind, path, body, stream, cancel_after_chunks)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = rng.choice(prompt_words)
        prompt = " ".join(rng.choice(WORDS) for _ in range(words))
        max_tokens = rng.randint(1, max_new_tokens)
        stream = rng.random() < 0.5
        cancel = cancel_after if stream and rng.random() < 0.2 else None
        invalid = rng.random() < 0.02
        if rng.random() < 0.5:
            path = "/v1/chat/completions"
            body = {"model": "demo", "messages": [{"role": "user", "content": prompt}],
                    "thinking": {"type": "disabled"}}
        else:
            path = "/v1/completions"
            body = {"model": "demo", "prompt": prompt}
        body.update({"max_tokens": 100_000_000 if invalid else max_tokens, "seed": i, "temperature": 0.8})
        if stream:
            body["stream"] = True
        kind = "invalid" if invalid else ("cancel" if cancel else ("stream" if stream else "json"))
        out.append((kind, path, body, stream and not invalid, cancel))
    return out


async def one(client, base, item, stats):
    kind, path, body, stream, cancel = item
    start = time.monotonic()
    try:
        if not stream:
            r = await client.post(base + path, json=body)
            if kind == "invalid":
                stats["intended_errors" if r.status_code == 400 else "unintended"] += 1
            elif r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1:
                stats["ok"] += 1
            else:
                stats["unintended"] += 1
                stats["samples"].append(f"{r.status_code} {r.text[:200]}")
            return
        async with client.stream("POST", base + path, json=body) as r:
            if r.status_code != 200:
                stats["unintended"] += 1
                stats["samples"].append(f"{r.status_code} {(await r.aread())[:200]!r}")
                return
            last, chunks, done = None, 0, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    stats["unintended"] += 1
                    stats["samples"].append(data[:200])
                    return
                choice = event["choices"][0] if event["choices"] else {}
                text = choice.get("text") or (choice.get("delta") or {}).get("content")
                if not text:
                    continue
                now = time.monotonic()
                if last is None:
                    stats["ttft"].append(now - start)
                else:
                    stats["itl"].append(now - last)
                last, chunks = now, chunks + 1
                if cancel and chunks >= cancel:
                    stats["cancelled"] += 1
                    return  # leaving the block closes the connection mid-stream
            if done:
                stats["ok"] += 1
            elif cancel:
                stats["ok"] += 1  # ended before the cancellation point
            else:
                stats["unintended"] += 1
                stats["samples"].append("stream ended without [DONE]")
    except Exception as error:  # noqa: BLE001 - every failure is counted and shown
        stats["unintended"] += 1
        stats["samples"].append(repr(error)[:200])


def aborted_total(base):
    text = httpx.get(base + "/metrics").text
    match = re.search(r"^deepinfer_frontend_aborted_requests_total (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


async def drive(base, items, concurrency, timeout):
    stats = {"ok": 0, "intended_errors": 0, "unintended": 0, "cancelled": 0, "ttft": [], "itl": [], "samples": []}
    queue = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        async def worker():
            while not queue.empty():
                await one(client, base, queue.get_nowait(), stats)
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return stats


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--binary", default=str(ROOT / "target" / "debug" / "deepinfer-node"))
    parser.add_argument("--topology", default="configs/local.toml")
    parser.add_argument("--max-seconds", type=float, default=3600)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--request-timeout", type=float, default=1200, help="seconds per request")
    parser.add_argument("--prompt-words", default="3,40,200", help="prompt lengths to mix (words)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="max_tokens is drawn from 1..this")
    parser.add_argument("--cancel-after", type=int, default=2, help="chunks a cancelled stream reads")
    args = parser.parse_args()
    prompt_words = [int(w) for w in args.prompt_words.split(",")]
    if min(args.requests, args.concurrency, args.max_new_tokens, args.cancel_after, *prompt_words) < 1:
        sys.exit("--requests, --concurrency, --max-new-tokens, --cancel-after, --prompt-words must be >= 1")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([args.binary, "serve", "--topology", args.topology, "--listen", f"127.0.0.1:{port}"],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=sys.stderr)
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                sys.exit("the server did not become ready")
            try:
                if httpx.get(base + "/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        httpx.post(base + "/v1/completions", json={"prompt": "warm up", "max_tokens": 2}, timeout=300)
        rss_before = rss_mib(server.pid)
        aborted_before = aborted_total(base)
        items = plan(args.requests, args.seed, prompt_words, args.max_new_tokens, args.cancel_after)
        began = time.monotonic()
        stats = asyncio.run(asyncio.wait_for(drive(base, items, args.concurrency, args.request_timeout), args.max_seconds))
        elapsed = time.monotonic() - began
        time.sleep(1.0)  # let the last aborts reach the engine
        aborted = aborted_total(base) - aborted_before
        rss_after = rss_mib(server.pid)
        after = httpx.post(base + "/v1/completions", json={"prompt": "still there?", "max_tokens": 4}, timeout=300)
        still_serving = after.status_code == 200
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=120)
    answered = stats["ok"] + stats["intended_errors"] + stats["unintended"] + stats["cancelled"]
    lost = len(items) - answered
    ms = lambda s: f"{s * 1000:.0f} ms"  # noqa: E731
    print(f"prompts of {args.prompt_words} words, 1..{args.max_new_tokens} new tokens, "
          f"cancelled streams read {args.cancel_after} chunk(s)")
    print(f"requests {len(items)} at {args.concurrency} concurrent in {elapsed:.1f} s "
          f"({len(items) / elapsed:.1f} req/s)")
    print(f"ok {stats['ok']}, cancelled mid-stream {stats['cancelled']} (engine aborts counted {aborted:.0f}), "
          f"intended 400s {stats['intended_errors']}, unintended errors {stats['unintended']}, lost {lost}")
    print(f"TTFT p50 {ms(percentile(stats['ttft'], 50))} p99 {ms(percentile(stats['ttft'], 99))}; "
          f"inter-token p50 {ms(percentile(stats['itl'], 50))} p99 {ms(percentile(stats['itl'], 99))}")
    print(f"RSS before {rss_before:.0f} MiB, after {rss_after:.0f} MiB; still serving: {still_serving}; "
          f"exit status after SIGTERM: {code}")
    for sample in stats["samples"][:5]:
        print("  error:", sample)
    ok = lost == 0 and stats["unintended"] == 0 and still_serving and code == 0
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
