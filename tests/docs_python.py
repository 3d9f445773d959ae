"""A reader's Python for the docs' tests: one process per doc, its examples executed in order in one namespace
(as one program saved to a file and run with `uv run python` would), each block sent as a JSON line on stdin
and answered by a JSON line on the original stdout; what the examples print goes to stderr."""

import json
import os
import sys
import traceback

replies = os.fdopen(os.dup(1), "w")
sys.stdout = sys.stderr
namespace: dict = {"__name__": "__main__"}
for line in sys.stdin:
    block = json.loads(line)
    try:
        exec(compile(block["code"], block["path"], "exec"), namespace)
        error = None
    except BaseException:  # the test reports whatever the example raised, SystemExit included
        error = traceback.format_exc()
    replies.write(json.dumps({"error": error}) + "\n")
    replies.flush()
