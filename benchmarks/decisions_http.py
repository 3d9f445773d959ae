"""The decision routes end to end over HTTP, at Kev's shape: a new short state (about 100 tokens, a
customer-support message made up from a seed, never the same twice) asked 6 closed questions: 3 `noul`, 2
`choice` of 4 named options, 1 `score` of 3 levels. What a decision client gets from the server, asked
four ways (the parts):

- systemone: one `POST /v1/systemone` with the 6 questions (the state read once, each question a branch);
- decide-shared: one `POST /decide/shared` with the same 6 as lettered decisions (noul: yes/no; choice: its
  options; score: its levels);
- systemone-batch: one `POST /v1/systemone/batch` with 16 states and the 6 questions (a bulk client's way:
  the states packed into shared passes), its latency the whole request's;
- one-per-question: 6 single-question `POST /v1/systemone` sent at once, the state done when all 6 are
  answered: how clients of engines that run one row per question use a server.

Each part is driven for --seconds by closed-loop clients at each of --clients (a client posts its next state
when its last is answered); a part's rate counts the states answered from its start to its last answer.
Reported per part and client count: states/s, decisions/s (6 a state), p50/p99 latency of a state (a batch's
in systemone-batch; from sending its request(s) to having every answer), states answered, errors (any non-200
or incomplete answer: counted and shown, never retried), the tokens the server read per state, and the
client's own CPU share (a client near 100% of a core would be what limits the rate); with --shape on a GPU,
MFU: 2 × the shape's linear parameters × the tokens read a second over the fp8 GEMM peak measured in the same
run, before the server starts (common.gemm_peaks, in a process of its own; --no-peaks skips it). Before
timing, one state's `systemone` answers must equal its `one-per-question` answers bit for bit (the server
answers a question the same whatever else is asked): `same_bits`.

The server is `spinf-jax serve` in a child process, ready with every bucket compiled before the parts. On
the CPU, the default model:

    .venv/bin/python benchmarks/decisions_http.py --clients 1,4 --seconds 20 --out /tmp/dh

On a GPU, made-up weights at a real shape (`serve --random-weights`, fp8) with Gemma 3's tokenizer (a folder
holding its tokenizer.json; benchmarks/README.md says how the GPU machine gets one). A shape whose
vocabulary is smaller than the tokenizer's gets the tokenizer's (the JSON says so: vocab_size_raised):

    cd benchmarks && JAX_PLATFORMS=cuda python3 decisions_http.py --shape qwen3.5-4b --tokenizer /tmp/tok \
      --clients 1,64 --out $OUT/dh

Prints a table and ends with one JSON line; --out writes decisions_http.json and decisions_http.md there.
"""

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import httpx
import numpy as np
from common import SHAPES
from server_process import start_server, stop_server, wait_compiled, wait_ready

PARTS = ("systemone", "systemone-batch", "decide-shared", "one-per-question")
# States a systemone-batch request carries.
BATCH = 16

# Kev's shape: 3 noul, 2 choice of 4 named options (some described), 1 score of 3 levels.
QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Is the customer asking for money back?"},
    "urgent": {
        "type": "noul",
        "instructions": "Does this ticket need an answer today?",
        "criteria": {"true": "a deadline, a trip or a blocked account", "false": "it can wait"},
    },
    "repeat": {"type": "noul", "instructions": "Has the customer already contacted support about this?"},
    "team": {
        "type": "choice",
        "instructions": "Which team should handle this ticket?",
        "criteria": {
            "Billing": "Payments, invoices, refunds",
            "Technical": "Bugs, crashes and outages",
            "Shipping": "Deliveries and tracking",
            "Account": None,
        },
    },
    "action": {
        "type": "choice",
        "instructions": "What should the agent do next?",
        "criteria": {
            "Refund": None,
            "Replace": "Send a new item",
            "Escalate": "Hand over to a supervisor",
            "Reply": None,
        },
    },
    "anger": {
        "type": "score",
        "instructions": "How frustrated is the customer?",
        "criteria": ["Calm", "Frustrated", "Very angry"],
    },
}

# The states' parts.
NAMES = [
    "Maria Lopez", "James Chen", "Aisha Khan", "Tom Becker", "Yuki Tanaka", "Olga Petrova", "Sam Reed",
    "Priya Nair", "Lucas Silva", "Emma Dubois", "Kwame Mensah", "Sofia Rossi", "Noah Fischer", "Lea Novak",
]  # fmt: skip
PRODUCTS = [
    "Aurora X2 headphones", "Nimbus 14 laptop", "Pulse fitness watch", "Breeze air purifier",
    "Atlas standing desk", "Echo mini speaker", "Vista 4K monitor", "Glide electric scooter",
    "Terra coffee grinder", "Orbit robot vacuum", "Nova phone case", "Summit hiking backpack",
]  # fmt: skip
ISSUES = [
    "stopped charging after {days} days", "arrived with a cracked case", "never arrived",
    "was delivered to the wrong address", "makes a loud buzzing noise",
    "keeps disconnecting every few minutes", "is missing the power adapter",
    "shows error code E{code} on start", "was the wrong colour", "stopped working after the last update",
]  # fmt: skip
ASKS = [
    "Can you refund the extra charge and send a replacement?", "I want my money back, all of it.",
    "Please tell me when the new one will ship.", "Could someone call me about this today?",
    "Is there a fix, or should I return it?", "I need this sorted before my trip on {date}.",
    "Please cancel the order and close my account.", "Can you at least tell me what is going on?",
]  # fmt: skip
MOODS = [
    "Thanks for your help.", "This is the third time I write to you about it.", "Honestly I am fed up.",
    "No rush, whenever you can.", "I am really disappointed with your service.", "Have a nice day!",
]  # fmt: skip
MONTHS = ["March", "April", "May", "June", "July", "August"]
TRIED = ["resetting it", "the steps on your website", "a different cable"]
CARDS = ["Visa", "Mastercard", "PayPal"]


def state(seed: int, index: int) -> str:
    """The index-th state of the seed: a support message of about 100 tokens. Its ticket number is the index,
    so no two states of a run are the same text."""
    rng = random.Random(seed * 1_000_003 + index)
    name, product = rng.choice(NAMES), rng.choice(PRODUCTS)
    issue = rng.choice(ISSUES).format(days=rng.randint(2, 40), code=rng.randint(100, 999))
    ask = rng.choice(ASKS).format(date=f"{rng.choice(MONTHS[2:])} {rng.randint(1, 28)}")
    price = f"${rng.randint(19, 899)}.{rng.randint(0, 99):02d}"
    bought = f"{rng.choice(MONTHS[:3])} {rng.randint(1, 28)}"
    return (
        f"Ticket #{100000 + index}. Hi, this is {name} (order {rng.randint(10000, 99999)}). I bought the "
        f"{product} on {bought} for {price} and it {issue}. I already tried {rng.choice(TRIED)} "
        f"{rng.randint(2, 5)} times. I was also charged {price} twice on my "
        f"{rng.choice(CARDS)}. {ask} {rng.choice(MOODS)}"
    )


def decisions(questions: dict) -> list[dict]:
    """The questions as /decide/shared decisions: a noul's options yes/no (described by its criteria), a
    choice's its options, a score's its levels (each option's description is its name where none is given)."""
    out = []
    for qid, q in questions.items():
        if q["type"] == "noul":
            criteria = q.get("criteria") or {}
            options = [{"id": "yes", "description": criteria.get("true", "Yes")},
                       {"id": "no", "description": criteria.get("false", "No")}]  # fmt: skip
        elif q["type"] == "choice":
            options = [{"id": name, "description": text or name} for name, text in q["criteria"].items()]
        else:
            options = [{"id": level, "description": level} for level in q["criteria"]]
        out.append({"id": qid, "question": q["instructions"], "options": options})
    return out


class Failed(Exception):
    """Requests (`count` of them) answered with anything but a 200 carrying every answer."""

    def __init__(self, message: str, count: int = 1):
        super().__init__(message)
        self.count = count


async def post(http: httpx.AsyncClient, path: str, body: dict) -> dict:
    try:
        reply = await http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    except httpx.HTTPError as e:
        raise Failed(f"{path}: {type(e).__name__} {e}") from e
    if reply.status_code != 200:
        raise Failed(f"{path}: {reply.status_code} {reply.text[:300]}")
    return reply.json()


async def systemone(http, text: str) -> tuple[dict, int]:
    """All 6 questions in one request: the answers by id and the tokens the server read."""
    body = await post(http, "/v1/systemone", {"model": "jev-latest", "state": text, "questions": QUESTIONS})
    if set(body.get("answers", ())) != set(QUESTIONS):
        raise Failed(f"/v1/systemone: answers for {sorted(body.get('answers', ()))}")
    return body["answers"], body["usage"]["input_tokens"]


async def decide_shared(http, text: str) -> tuple[dict, int]:
    body = await post(http, "/decide/shared", {"state": text, "decisions": decisions(QUESTIONS)})
    if [r.get("id") for r in body.get("results", ())] != list(QUESTIONS):
        raise Failed(f"/decide/shared: results for {[r.get('id') for r in body.get('results', ())]}")
    return {r["id"]: r for r in body["results"]}, body["processed_tokens"]


async def one_per_question(http, text: str) -> tuple[dict, int]:
    """A request per question, all in flight at once."""

    async def one(qid: str) -> dict:
        body = {"model": "jev-latest", "state": text, "questions": {qid: QUESTIONS[qid]}}
        reply = await post(http, "/v1/systemone", body)
        if set(reply.get("answers", ())) != {qid}:
            raise Failed(f"/v1/systemone ({qid} alone): answers for {sorted(reply.get('answers', ()))}")
        return reply

    replies = await asyncio.gather(*(one(qid) for qid in QUESTIONS), return_exceptions=True)
    failed = [r for r in replies if isinstance(r, BaseException)]
    if failed:
        raise Failed("; ".join(map(str, failed)), len(failed))
    answers = {qid: r["answers"][qid] for qid, r in zip(QUESTIONS, replies, strict=True)}
    return answers, sum(r["usage"]["input_tokens"] for r in replies)


async def systemone_batch(http, texts: list[str]) -> tuple[list[dict], int]:
    """BATCH states in one `/v1/systemone/batch` request, packed into shared passes by the server."""
    body = {"model": "jev-latest", "states": texts, "questions": QUESTIONS}
    reply = await post(http, "/v1/systemone/batch", body)
    results = reply.get("results", ())
    if len(results) != len(texts) or any(set(r.get("answers", ())) != set(QUESTIONS) for r in results):
        raise Failed(f"/v1/systemone/batch: {len(results)} results for {len(texts)} states", len(texts))
    return [r["answers"] for r in results], reply["total_usage"]["input_tokens"]


ASK = {
    "systemone": systemone,
    "systemone-batch": systemone_batch,
    "decide-shared": decide_shared,
    "one-per-question": one_per_question,
}
# States each request (or set of requests, in one-per-question) of a part answers.
STATES_PER_ASK = {"systemone-batch": BATCH}


def http_client(url: str) -> httpx.AsyncClient:
    """One client's connections: one for each of its requests in flight (6 in one-per-question). A pool per
    client, not one for all: httpx's pool costs CPU with the connections it holds, and one pool of 384 held
    the client to 14 one-per-question states/s against a server that answers at once (64 pools: 90 states/s,
    2 cores)."""
    return httpx.AsyncClient(base_url=url, timeout=900, limits=httpx.Limits(max_connections=6))


async def drive(url: str, part: str, clients: int, seconds: float, seed: int, first: int) -> dict:
    """Closed-loop clients asking states first, first + 1, ... (each state once) for `seconds`."""
    ask = ASK[part]
    per_ask = STATES_PER_ASK.get(part, 1)
    answered = [0]  # states
    latencies: list[float] = []
    tokens: list[int] = []
    errors: list[str] = []
    error_count = 0
    next_index = first
    last_answer = 0.0
    https = [http_client(url) for _ in range(clients)]  # made before the clock starts (each its SSL context)
    start = time.perf_counter()
    cpu = time.process_time()
    stop = start + seconds

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal next_index, error_count, last_answer
        async with http:
            while time.perf_counter() < stop:
                texts = [state(seed, next_index + i) for i in range(per_ask)]
                next_index += per_ask
                begin = time.perf_counter()
                try:
                    _, read = await ask(http, texts if part in STATES_PER_ASK else texts[0])
                except Failed as e:
                    error_count += e.count
                    if len(errors) < 5:
                        errors.append(str(e))
                    continue
                last_answer = time.perf_counter()
                latencies.append(last_answer - begin)
                tokens.append(read / per_ask)
                answered[0] += per_ask

    await asyncio.gather(*(client(http) for http in https))
    cpu = time.process_time() - cpu
    wall = (last_answer or time.perf_counter()) - start
    done = answered[0]
    ms = np.array(latencies) * 1e3 if latencies else np.array([np.nan])
    return {
        "part": part,
        "clients": clients,
        "states": done,
        "seconds": wall,
        "states_per_second": done / wall,
        "decisions_per_second": done * len(QUESTIONS) / wall,
        "requests_per_state": len(QUESTIONS) if part == "one-per-question" else 1 / per_ask,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "errors": error_count,
        "first_errors": errors,
        "tokens_read_per_state": float(np.mean(tokens)) if tokens else float("nan"),
        "client_cpu_share": cpu / wall,  # of one core
        "states_asked": next_index - first,
    }


async def same_bits(url: str, text: str) -> tuple[bool, dict]:
    """Whether one state's 6 answers from one request equal, bit for bit, its answers asked one a request
    (those 6 sent at once, as the part sends them); also the first decide-shared request (a warm-up)."""
    async with http_client(url) as http:
        together, _ = await systemone(http, text)
        alone, _ = await one_per_question(http, text)
        await decide_shared(http, text)
    differ = sorted(qid for qid in QUESTIONS if together[qid] != alone[qid])
    return not differ, {"state": text, "differing_questions": differ}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]  # fmt: skip
        cpu = names[0] if names else cpu
    gpus = "no GPU"
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"]
        found = subprocess.run(query, capture_output=True, text=True).stdout.strip().splitlines()
        gpus = f"{len(found)} GPU(s): {'; '.join(found)}" if found else gpus
    return f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs: {cpu}; {gpus})"


def shape_config(name: str, tokenizer: str, out: Path) -> tuple[Path, dict]:
    """The shape's config written into `out`, with its vocabulary raised to the tokenizer's where smaller:
    `serve --random-weights` refuses a tokenizer with more tokens than the config's vocabulary, and Gemma 3's
    (262,144) is the one the GPU machine has. Only the embedding table and the output rows grow; the layers
    keep the shape's, and a decision reads logits at its answer positions alone."""
    import tokenizers

    config = dict(SHAPES[name])
    words = tokenizers.Tokenizer.from_file(str(Path(tokenizer) / "tokenizer.json")).get_vocab_size(True)
    raised = {}
    if words > config["vocab_size"]:
        raised = {"vocab_size_raised": {"from": config["vocab_size"], "to": words}}
        config["vocab_size"] = words
    path = out / f"{name}.json"
    path.write_text(json.dumps(config))
    return path, raised


def table(rows: list[dict]) -> str:
    columns = ["part", "clients", "states", "states/s", "decisions/s", "p50 ms", "p99 ms", "errors",
               "tokens read/state", "MFU (fp8 peak)", "client CPU"]  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if "mfu" in r else ""
        cells = [r["part"], r["clients"], r["states"], f"{r['states_per_second']:.2f}",
                 f"{r['decisions_per_second']:.2f}", f"{r['p50_ms']:.0f}", f"{r['p99_ms']:.0f}", r["errors"],
                 f"{r['tokens_read_per_state']:.0f}", mfu, f"{r['client_cpu_share']:.1%}"]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


# Run in a process of its own before the server starts (its GPU memory is given back when it ends).
PEAKS = """
import json, sys
from common import SHAPES, gemm_peaks, linear_params
from spinf_jax.loader import default_row_tile
from spinf_jax.models import abstract_decoder
from spinf_jax.quant import Precision
decoder = abstract_decoder(SHAPES[sys.argv[1]], Precision(sys.argv[2]))
print(json.dumps(gemm_peaks(decoder, int(sys.argv[3]) if len(sys.argv) > 3 else default_row_tile())
                 | {"linear_params": linear_params(decoder)}))
"""


def peaks(shape: str, precision: str, row_tile: str | None) -> dict:
    """The fp8 and bf16 GEMM peaks measured now on this machine's GPU (common.gemm_peaks: 8192³ and the
    shape's own GEMMs at a row tile's rows), and the shape's linear parameters a token goes through."""
    command = [sys.executable, "-c", PEAKS, shape, precision, *([row_tile] if row_tile else [])]
    done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).parent, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def mfu(row: dict, measured: dict) -> float:
    """2 × linear parameters × the tokens read a second (the states' and their questions') over the fp8
    peak measured in the same run."""
    tokens = row["states_per_second"] * row["tokens_read_per_state"]
    return 2 * measured["linear_params"] * tokens / (measured["fp8_gemm_tflops"] * 1e12)


def markdown(d: dict, text: str) -> str:
    errors = [e for r in d["results"] for e in r["first_errors"]]
    return "\n\n".join(
        [
            "# decisions_http: the decision routes over HTTP at Kev's shape (a new state of about 100 "
            "tokens, 6 questions)",
            "\n".join(
                [
                    f"- date: {d['date']}",
                    f"- machine: {d['machine']}",
                    f"- command: `{d['command']}`",
                    f"- model: {d['model']}; precision {d['precision']}; buckets {d['buckets']}; "
                    f"device {d['device']}",
                    f"- serve: `{d['serve_command']}`",
                    f"- {d['seconds_per_part']:g} s a part; same_bits (systemone == one-per-question, one "
                    f"state): {d['same_bits']}",
                ]
            ),
            text,
            *(["First errors:\n\n" + "\n".join(f"- `{e}`" for e in errors)] if errors else []),
        ]
    )


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", default="1,64", help="client counts, comma-separated")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long each part is driven")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument(
        "--shape", choices=sorted(SHAPES), help="made-up weights at this shape (needs --tokenizer)"
    )
    parser.add_argument("--tokenizer", help="with --shape: a folder holding Gemma 3's tokenizer.json")
    parser.add_argument("--precision", help="serve's --precision (default: fp32, or fp8 with --shape)")
    parser.add_argument("--buckets", help="serve's --buckets (default: the server's on this backend)")
    parser.add_argument("--seed", type=int, default=0, help="the states' seed")
    parser.add_argument("--serve-args", default="", help="more `spinf-jax serve` flags")
    parser.add_argument(
        "--no-peaks", action="store_true", help="skip the GEMM peaks (no MFU; never measured on the CPU)"
    )
    parser.add_argument("--out", help="a folder for decisions_http.json and decisions_http.md")
    args = parser.parse_args()
    if args.shape and not args.tokenizer:
        parser.error("--shape needs --tokenizer")
    args.precision = args.precision or ("fp8" if args.shape else "fp32")
    return args


def main() -> None:
    args = arguments()
    clients = [int(c) for c in args.clients.split(",")]
    parts = [p for p in PARTS if p in args.parts.split(",")]
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="decisions_http-"))
    out.mkdir(parents=True, exist_ok=True)
    document = {
        "benchmark": "decisions_http",
        "date": date.today().isoformat(),
        "machine": machine(),
        "command": "python benchmarks/decisions_http.py " + shlex.join(sys.argv[1:]),
        "precision": args.precision,
        "seconds_per_part": args.seconds,
        "seed": args.seed,
        "questions": QUESTIONS,
    }
    serve = [args.tokenizer] if args.shape else []  # the model: the default one, or the tokenizer's folder
    if args.shape:
        config, raised = shape_config(args.shape, args.tokenizer, out)
        serve += ["--random-weights", str(config)]
        weights = f"made-up (loader.random_model) at {args.shape}"
        document |= {"shape": args.shape, "weights": weights, **raised}
    # Every request a part can have in flight may wait (the default queue, 64, would turn 6 × 64 into 429s).
    queue = max(64, 6 * max(clients))
    serve += ["--precision", args.precision, "--max-queue", str(queue), "--log-level", "warning"]
    serve += (["--buckets", args.buckets] if args.buckets else []) + shlex.split(args.serve_args)
    document["serve_command"] = "spinf-jax serve " + shlex.join(serve)
    measured = None
    if args.shape and not args.no_peaks and shutil.which("nvidia-smi"):
        tile = next((w for f, w in zip(serve, serve[1:], strict=False) if f == "--row-tile"), None)
        measured = peaks(args.shape, args.precision, tile)
        document["peaks"] = measured
        print("peaks", {k: v for k, v in measured.items() if k != "gemm_rates"}, flush=True)
    start = time.perf_counter()
    process, url = start_server(serve, out / "server.log")
    try:
        wait_ready(url, process, timeout=1800)
        health = wait_compiled(url, timeout=1800)
        document |= {
            "server_ready_seconds": time.perf_counter() - start,
            # With --shape, the served model is named by its tokenizer's folder: name the shape instead.
            "model": f"{args.shape}, made-up weights" if args.shape else health["model"],
            "served_model": health["model"],
            "device": health.get("device"),
            "versions": health["versions"],
            "system_fingerprint": health.get("system_fingerprint"),
            "buckets": health["buckets"],
            "pass_seconds": dict(zip(health["buckets"], health["pass_seconds"] or [], strict=False)),
        }
        ready = f"ready in {document['server_ready_seconds']:.0f} s: {document['model']}"
        print(ready, f"on {health.get('device')}, buckets {health['buckets']}", flush=True)
        document["same_bits"], document["same_bits_check"] = asyncio.run(same_bits(url, state(args.seed, 0)))
        print("same_bits:", document["same_bits"], flush=True)
        rows, first = [], 1  # state 0 was the check's; every part asks states never asked before
        for part in parts:
            for n in clients:
                row = asyncio.run(drive(url, part, n, args.seconds, args.seed, first))
                first += row["states_asked"]
                if measured:
                    row["mfu"] = mfu(row, measured)
                rows.append(row)
                print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        document["results"] = rows
    finally:
        stop_server(process)
    text = table(document["results"])
    print(text)
    print(f"same_bits: {document['same_bits']}")
    if args.out:
        (out / "decisions_http.json").write_text(json.dumps(document, indent=1) + "\n")
        (out / "decisions_http.md").write_text(markdown(document, text) + "\n")
    print(json.dumps(document))
    if any(r["errors"] for r in document["results"]) or not document["same_bits"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
