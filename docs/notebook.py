# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # spinf-jax from a notebook
#
# A Jupyter notebook in jupytext's percent format: open it in Jupyter with jupytext installed (or in VS Code),
# or run it as a script. CI runs it top to bottom (`tests/test_notebook.py`), so everything shown here works.
#
# It loads the default model, scores a few questions, compares them with their floors, looks inside a layer,
# and captures hidden states.

# %%
import numpy as np

from spinf_jax import Engine, TreeBatch
from spinf_jax.layout import read_tree
from spinf_jax.packer import Buckets

# One small bucket compiles quickly on a CPU; on a GPU leave `buckets` out (the server's defaults).
engine = Engine.load("spinf/gemma-3-270m", precision="bf16", buckets=Buckets((1024,)))
print(engine.fingerprint)

# %% [markdown]
# ## Score questions
#
# `engine.score` takes the API's request body (SPEC section 1) and returns its response, as the server does.

# %%
message = "Customer support message:\nI was charged twice for September and I want my money back."
response = engine.score(
    {
        "messages": [{"role": "user", "content": message}],
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
            ]
        },
    }
)
answers = {q["id"]: q["combinations"][0] for q in response["results"][0]["queries"]}
for query_id, answer in answers.items():
    ps = {o["text"]: round(o["p"], 3) for o in answer["options"]}
    print(query_id, ps, "residual", round(answer["residual"], 3))

# %% [markdown]
# ## Compare with the floors
#
# `floor_p` is the same question asked of empty content: what the model says before reading anything. The
# ratio p / floor_p shows how much the content moved each option.

# %%
for option in answers["topic"]["options"]:
    lift = option["p"] / option["floor_p"]
    print(f"{option['text']:>14}  p {option['p']:.3f}  floor {option['floor_p']:.3f}  lift {lift:5.2f}")

# %% [markdown]
# ## Extract answers from the same read
#
# A `{*}` slot (or `{n}` for a number, `{$}` for an amount) asks for an answer instead of scoring options:
# the most likely answers come back ranked, decoded from the same read of the content (docs/extraction.md).

# %%
extracted = engine.score(
    {
        "messages": [{"role": "user", "content": message}],
        "scoring": {
            "queries": [{"id": "month", "template": '\n\nQ: Which month was charged twice?\nA: "{*}"'}]
        },
    }
)
month = extracted["results"][0]["queries"][0]["combinations"][0]
for answer in month["answers"]:
    print(f"{answer['text']:>12}  p {answer['p']:.3f}  logprob {answer['logprob']:.2f}")
assert month["answers"][0]["text"] == "September"

# %% [markdown]
# ## Typed decisions
#
# `engine.decide` asks one typed question over a state (text or JSON) with lettered options, and reads the
# answer from the letters (docs/decisions.md). Small models lean toward the first-listed option: `orderings`
# asks every rotation of the options as branches of the same read and combines them; `agreement` says how
# many orderings picked the combined answer.

# %%
decision = engine.decide(
    {
        "id": "team",
        "state": {"ticket": 4411, "body": message},
        "question": "Which team should handle this ticket?",
        "options": [
            {"id": "billing", "description": "Billing and payments"},
            {"id": "shipping", "description": "Shipping and delivery"},
            {"id": "tech", "description": "Technical support"},
        ],
        "orderings": "rotations",
    }
)
ids, combined = decision["option_ids"], decision["combined"]
print("listed order:", {i: round(p, 3) for i, p in zip(ids, decision["probabilities"], strict=True)})
print("averaged:", {i: round(p, 3) for i, p in zip(ids, combined["probabilities"], strict=True)})
print("top", combined["top"], "agreement", round(combined["agreement"], 2))

# %% [markdown]
# ## Look inside a layer
#
# The model is a Flax NNX module. Its weights are `nnx.Param`s that name the checkpoint tensors they were read
# from and their kind (which decides how they are stored at each precision). Layers of one kind are stacked
# (their programs scan over them): `decoder.layer(i)` is the module holding layer i's weights and its row.

# %%
decoder = engine.model.decoder
print(type(decoder).__name__, decoder.num_layers, "layers,", decoder.config.hidden_size, "wide")
layer, m = decoder.layer(3)
for name in ("q", "k", "v", "o", "gate", "up", "down", "input_norm"):
    param = getattr(layer, name)
    value = param.get_value()[m]
    print(f"{name:>10}  {param.source[m]:<45} {param.kind:<6} {value.shape} {value.dtype}")

# %% [markdown]
# ## Capture hidden states
#
# `hidden_states` runs the same forward pass and keeps the residual stream at the rows asked for: entering
# each layer, then the final normed output (the entries of transformers' `output_hidden_states`).

# %%
tokenizer = engine.model.tokenizer
ids = tokenizer.prefix() + tokenizer.encode(message)  # [BOS] + the text, as the engine reads a content
batch = TreeBatch.sequence(ids)
last = np.array([len(ids) - 1])
states = np.asarray(engine.model.hidden_states(batch, last), np.float32)  # [layers + 1, 1, hidden]
print(states.shape)
print("norm entering each layer:", np.linalg.norm(states[:, 0], axis=-1).astype(int))
logits = np.asarray(engine.model.logits(states[-1]))[0]
print("most likely next token:", repr(tokenizer.decode([int(logits.argmax())])))

# %% [markdown]
# ## Token level: the engine's own job
#
# Underneath, the engine scores token trees. `read_tree` asks for the log-probabilities of a few tokens after
# chosen rows of a plain sequence; `score_trees` packs trees into the compiled passes.

# %%
yes, no = tokenizer.encode(" yes")[-1], tokenizer.encode(" no")[-1]
question = "\n\nIs the customer asking for a refund?\nAnswer:"
prompt = tokenizer.prefix() + tokenizer.encode(message + question)
[scored] = engine.score_trees([read_tree(prompt, {len(prompt) - 1: [yes, no]})])
print("log P( yes), log P( no):", scored.option_logprobs(0).round(3))
print("the model's own next token:", repr(tokenizer.decode([int(scored.top_tokens[0])])))
