"""The example request of SPEC section 1, shared by the compiler, engine and server tests."""

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


def without_extraction() -> dict:
    """The example minus its `{*}` query and its pack (neither is built yet)."""
    body = copy.deepcopy(SPEC_REQUEST)
    del body["packs"]
    body["scoring"]["queries"] = [q for q in body["scoring"]["queries"] if not q["template"].endswith("{*}")]
    return body
