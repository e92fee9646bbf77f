"""A bare MCP server over stdio (JSON-RPC by hand, not the SDK): it lists the tools named in its
``LISTING_TOOLS`` environment variable (a JSON list of names, as given: repeated names, names of any length),
which the SDK's server would refuse to offer, each with the input schema in ``LISTING_SCHEMA`` (JSON; default
``{"type": "object"}``). A call answers with the tool's name, or, for a tool named in
``LISTING_ERRORS`` (a JSON object of name to message), with a JSON-RPC error carrying that message at once.
The tool ``big`` answers with a text of ``size`` characters, its answer's ``id`` written last, after the result
(the order of the TypeScript SDK's servers). With ``LISTING_HELPER`` set it starts a helper process that
inherits its stdio and outlives it (as many servers' helpers do); ``pid`` and ``helper`` answer with the two
process ids. ``block`` never answers, and stops the server answering anything (it sleeps on the only thread, once it
has written ``blocking`` to its stderr).
``chatty`` writes a line of debug output to stdout, where only protocol messages belong, before its answer;
``junk`` writes ``lines`` of them. Three tools answer with a message that carries the call's id but is not
valid JSON-RPC: ``not_an_object`` (its result is a string), ``no_jsonrpc`` (the ``jsonrpc`` member is missing)
and ``truncated`` (the line ends inside the JSON). With ``LISTING_IGNORE_TERM`` set the server ignores
SIGTERM; with ``LISTING_WAIT_FOR`` set to a path it reads nothing until that file exists (a server slow to
start).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

if os.environ.get("LISTING_IGNORE_TERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
while os.environ.get("LISTING_WAIT_FOR") and not os.path.exists(os.environ["LISTING_WAIT_FOR"]):
    time.sleep(0.02)  # a server slow to start, until the test lets it

NAMES = json.loads(os.environ.get("LISTING_TOOLS", "[]"))
ERRORS = json.loads(os.environ.get("LISTING_ERRORS", "{}"))
HELPER = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) if os.environ.get(
    "LISTING_HELPER") else None
SCHEMA = json.loads(os.environ.get("LISTING_SCHEMA", '{"type": "object"}'))
TOOLS = [{"name": name, "description": f"the tool {name}", "inputSchema": SCHEMA} for name in NAMES]


def answer(request_id: object, result: dict[str, object]) -> None:
    sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": request_id, "result": result}) + "\n")
    sys.stdout.flush()


for line in sys.stdin:
    message = json.loads(line)
    request_id, method = message.get("id"), message.get("method")
    if request_id is None:
        continue  # a notification
    if method == "initialize":
        answer(request_id, {"protocolVersion": message["params"]["protocolVersion"], "capabilities": {"tools": {}},
                            "serverInfo": {"name": "listing", "version": "1"}})
    elif method == "tools/list":
        answer(request_id, {"tools": TOOLS})
    elif method == "tools/call" and message["params"]["name"] in ERRORS:
        error = {"code": -32000, "message": ERRORS[message["params"]["name"]]}
        sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": request_id, "error": error}) + "\n")
        sys.stdout.flush()
    elif method == "tools/call" and message["params"]["name"] == "big":
        text = ("0123456789" * (message["params"]["arguments"]["size"] // 10 + 1))
        result = json.dumps({"content": [{"type": "text", "text": text}], "isError": False})
        sys.stdout.write(f'{{"result":{result},"jsonrpc":"2.0","id":{json.dumps(request_id)}}}\n')
        sys.stdout.flush()
    elif method == "tools/call" and message["params"]["name"] == "chatty":
        sys.stdout.write("debug: starting the work\n")
        answer(request_id, {"content": [{"type": "text", "text": "chatty"}]})
    elif method == "tools/call" and message["params"]["name"] == "junk":
        for i in range(message["params"]["arguments"]["lines"]):
            sys.stdout.write(f"debug: step {i}\n")
        answer(request_id, {"content": [{"type": "text", "text": "junk"}]})
    elif method == "tools/call" and message["params"]["name"] == "not_an_object":
        sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": request_id, "result": "plain text"}) + "\n")
        sys.stdout.flush()
    elif method == "tools/call" and message["params"]["name"] == "no_jsonrpc":
        sys.stdout.write(json.dumps({"id": request_id, "result": {"content": []}}) + "\n")
        sys.stdout.flush()
    elif method == "tools/call" and message["params"]["name"] == "truncated":
        sys.stdout.write(f'{{"jsonrpc": "2.0", "id": {json.dumps(request_id)}, "result": {{"content": [\n')
        sys.stdout.flush()
    elif method == "tools/call" and message["params"]["name"] == "block":
        print("blocking", file=sys.stderr, flush=True)
        time.sleep(600)
    elif method == "tools/call" and message["params"]["name"] in ("pid", "helper"):
        pid = os.getpid() if message["params"]["name"] == "pid" else HELPER.pid if HELPER else 0
        answer(request_id, {"content": [{"type": "text", "text": str(pid)}]})
    elif method == "tools/call":
        answer(request_id, {"content": [{"type": "text", "text": message["params"]["name"]}]})
    else:
        answer(request_id, {})
