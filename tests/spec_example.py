"""The examples of SPEC sections 1 and 2, shared by the compiler, engine, server and API tests."""

import copy

SPEC_REQUEST = {
    "model": "spinf/gemma-4-12b-fp8",
    "messages": [
        {"role": "user", "content": "Customer support message:\nI was charged twice for September."}
    ],
    "scoring": {
        "queries": [
            {
                "id": "topic",
                "template": "\n\nTopic (billing, technical, account, shipping, or cancellation):{?}",
                "options": [" billing", " technical", " account", " shipping", " cancellation"],
            },
            {
                "id": "refund",
                "template": "\n\nIs the customer asking for a refund?\nAnswer:{?}",
                "options": [" yes", " no"],
            },
            {
                "id": "sentiment_about",
                "template": "\n\nIs the message {tone} about {subject}?\nAnswer:{?}",
                "options": [" yes", " no"],
                "combinations": "all",
                "values": {"tone": ["positive", "negative"], "subject": ["the product", "the support"]},
            },
            {"id": "month", "template": '\n\nQ: Which month was charged twice?\nA: "{*}'},
        ],
        "empty_floor": True,
    },
    "packs": [{"id": "spinf/moderation"}],
}


# The example response of SPEC section 2.
SPEC_RESPONSE = {
    "id": "score-…",
    "object": "score",
    "created": 1764400000,
    "model": "spinf/gemma-4-12b-fp8",
    "system_fingerprint": "fp_…",
    "results": [
        {
            "input_id": "0",
            "queries": [
                {
                    "id": "refund",
                    "combinations": [
                        {
                            "values": {},
                            "options": [
                                {"text": " yes", "logprob": -0.90, "p": 0.72, "floor_p": 0.60},
                                {"text": " no", "logprob": -1.86, "p": 0.28, "floor_p": 0.40},
                            ],
                            "residual": 0.44,
                            "floor_residual": 0.55,
                        }
                    ],
                },
                {
                    "id": "month",
                    "combinations": [
                        {
                            "values": {},
                            "answers": [{"text": "September", "p": 0.83}, {"text": "Sept", "p": 0.06}],
                        }
                    ],
                },
            ],
            "packs": [
                {
                    "id": "spinf/moderation",
                    "categories": [{"id": "harassment", "score": 0.02}],
                    "decision": {"label": "allow"},
                }
            ],
        }
    ],
    "warnings": [{"code": "low_option_mass", "input_id": "0", "query_id": "topic", "message": "…"}],
    "usage": {
        "prompt_tokens": 131,
        "prompt_tokens_details": {"content_tokens": 14, "query_tokens": 60, "floor_tokens": 57},
    },
}


def without_extraction() -> dict:
    """The example minus its `{*}` query and its pack (neither is built yet)."""
    body = copy.deepcopy(SPEC_REQUEST)
    del body["packs"]
    body["scoring"]["queries"] = [q for q in body["scoring"]["queries"] if not q["template"].endswith("{*}")]
    return body


# Questions of every shape a request can hold, for the companion-invariance tests: options of one and of
# several tokens (sharing prefixes), a placeholder grid, a list of combinations, a question asked twice
# under two ids, and a long template.
QUERY_POOL = [
    *without_extraction()["scoring"]["queries"],
    {
        "id": "city",
        "template": "\n\nWhich city is the customer in?\nCity:{?}",
        "options": [" New York", " New Jersey", " New Orleans", " Boston", " San Francisco"],
    },
    {
        "id": "product",
        "template": "\n\nIs this about {product}?\nAnswer:{?}",
        "options": [" yes", " no", " not sure"],
        "combinations": [
            {"product": "a credit card"},
            {"product": "a subscription"},
            {"product": "a parcel"},
        ],
    },
    {
        "id": "refund_again",
        "template": "\n\nIs the customer asking for a refund?\nAnswer:{?}",
        "options": [" yes", " no"],
    },
    {
        "id": "long",
        "template": "\n\nRead the message again, carefully, and think about what the customer wants most, "
        "what they already tried, whether they sound angry, and whether a human should answer. Urgent?{?}",
        "options": [" yes", " no"],
    },
]


def scores_by_question(response: dict) -> dict:
    """{(input_id, query id, combination values): (option logprobs, p, floor_p, residuals)} of a response."""
    out = {}
    for result in response["results"]:
        for query in result["queries"]:
            for combo in query["combinations"]:
                key = (result["input_id"], query["id"], tuple(sorted(combo["values"].items())))
                out[key] = (
                    [(o["text"], o["logprob"], o["p"], o.get("floor_p")) for o in combo["options"]],
                    combo["residual"],
                    combo.get("floor_residual"),
                )
    return out
