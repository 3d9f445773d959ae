"""The moderation pack over HTTP on a GPU at Gemma 3 12B's shape (random weights): messages per hour through
`spinf-jax serve`'s app, clients posting batches of messages with `"packs": [{"id": "spinf/moderation"}]`.
One script, one run; prints a table, ends with one JSON line.

Messages are the moderation pack's synthetic data (packs/spinf/data/), repeated to --messages. Random
weights give meaningless decisions; the cost per message does not depend on the values. Also checked: a
message's pack result alone equals its result inside a batch (bits, over HTTP).

    python3 benchmarks/gpu_packs.py --tokenizer gemma3-tokenizer.json --out $OUT
"""

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
from common import engine_args, random_engine, serve_in_thread

from spinf_jax.packs.loader import OFFICIAL, load_packs
from spinf_jax.server.app import create_app
from spinf_jax.server.settings import Settings

PACK = "spinf/moderation"
DATA = OFFICIAL / "spinf" / "data"


def messages(n: int) -> list[str]:
    texts = [json.loads(line)["text"] for f in sorted(DATA.glob("moderation-*.jsonl")) for line in f.open()]
    return [texts[i % len(texts)] for i in range(n)]


def options(parser) -> None:
    parser.add_argument("--messages", type=int, default=4000)
    parser.add_argument("--clients", type=int, default=8, help="requests in flight at once")
    parser.add_argument("--batch", type=int, default=32, help="messages per request")


def main() -> None:
    args = engine_args(__doc__, options)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "pack": PACK,
               "weights": "made-up values (a repeated random pattern), Gemma 3 12B text shape"}  # fmt: skip
    engine = random_engine(args)
    start = time.perf_counter()
    server, client, health = serve_in_thread(
        create_app(Settings("gemma-3-12b-shape-random", packs=load_packs()), engine)
    )
    results["ready_seconds"] = time.perf_counter() - start
    pack = next(p for p in health["packs"] if p["id"] == PACK)
    results["pack_questions"], results["pack_categories"] = pack["questions"], len(pack["categories"])

    def post(texts: list[str]) -> dict:
        body = {
            "inputs": [{"messages": [{"role": "user", "content": t}]} for t in texts],
            "packs": [{"id": PACK}],
        }
        r = client.post("/v1/score", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    texts = messages(args.messages)
    post(texts[:8])  # the pack's floors are computed once, then cached
    alone = post(texts[:1])["results"][0]["packs"]
    batches = [texts[i : i + args.batch] for i in range(0, len(texts), args.batch)]
    start = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        responses = list(pool.map(post, batches))
    seconds = time.perf_counter() - start
    usage = [r["usage"]["prompt_tokens_details"] for r in responses]
    results |= {
        "messages": len(texts),
        "clients": args.clients,
        "messages_per_request": args.batch,
        "seconds": seconds,
        "messages_per_hour": len(texts) / seconds * 3600,
        "content_tokens": sum(u["content_tokens"] for u in usage),
        "query_tokens": sum(u["query_tokens"] for u in usage),
        "tokens_per_second": sum(u["content_tokens"] + u["query_tokens"] for u in usage) / seconds,
        "alone_equals_batched": responses[0]["results"][0]["packs"] == alone,
        "decisions": {},
    }
    for r in responses:
        for result in r["results"]:
            label = result["packs"][0]["decision"]["label"]
            results["decisions"][label] = results["decisions"].get(label, 0) + 1
    server.should_exit = True
    (out / "gpu_packs.json").write_text(json.dumps(results, indent=2))
    print("\n| messages | clients × batch | seconds | messages/hour | tokens/s | alone = batched |")
    print("|---|---|---|---|---|---|")
    print(f"| {results['messages']} | {args.clients} × {args.batch} | {seconds:.1f} "
          f"| {results['messages_per_hour']:,.0f} | {results['tokens_per_second']:,.0f} "
          f"| {results['alone_equals_batched']} |")  # fmt: skip
    print(json.dumps(results))


if __name__ == "__main__":
    main()
