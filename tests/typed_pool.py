"""A short state and a pool of System One questions of every type, shared by the invariance tests of the
decision APIs on the CPU (test_decision_apis) and on the GPU (test_gpu), which must not import each other's
dependencies."""

SHORT = "Charged twice; refund me today."
POOL = {
    "refund": {"type": "noul", "instructions": "Refund?"},
    "team": {
        "type": "choice",
        "instructions": "Team?",
        "criteria": {"Bill": None, "Tech": "bugs", "Sales": None},
    },
    "anger": {"type": "score", "instructions": "Anger?", "criteria": ["calm", "upset", "angry"]},
    "today": {"type": "noul", "criteria": {"true": "urgent"}},
}
