# `helm test` check: one flagged chat request through the Service must return a vector of the
# model's hidden_size finite floats in kv_transfer_params.last_hidden_state; with API_KEY set (the
# proxy's key), the same request without it must get 401 first. Standard library only.
import json
import math
import os
import sys
import urllib.error
import urllib.request

url = os.environ["PROXY_URL"].rstrip("/") + "/v1/chat/completions"
expected = int(os.environ["EXPECTED_LENGTH"])
body = {
    "model": os.environ["MODEL"],
    "messages": [
        {
            "role": "user",
            "content": "Summarize this text in one word: A yellow bicycle beside a stone wall.",
        }
    ],
    "max_completion_tokens": 1,
    "chat_template_kwargs": {"enable_thinking": False},
    "kv_transfer_params": {"return_last_hidden_state": True},
}
timeout = float(os.environ.get("TIMEOUT_SECONDS", "300"))
api_key = os.environ.get("API_KEY", "")


def post(headers):
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **headers}
    )
    return urllib.request.urlopen(request, timeout=timeout)


if api_key:  # the proxy's key is on: without it, the Service must refuse
    try:
        with post({}) as r:
            sys.exit(f"FAIL: a request without the API key got {r.status}, expected 401")
    except urllib.error.HTTPError as exc:
        if exc.code != 401:
            sys.exit(f"FAIL: a request without the API key got {exc.code}, expected 401")
    except Exception as exc:  # URLError, timeouts
        sys.exit(f"FAIL: request to {url} failed: {exc}")
try:
    with post({"Authorization": f"Bearer {api_key}"} if api_key else {}) as r:
        reply = json.load(r)
except Exception as exc:  # HTTPError, URLError, timeouts, bad JSON
    detail = exc.read().decode(errors="replace")[:500] if hasattr(exc, "read") else ""
    sys.exit(f"FAIL: request to {url} failed: {exc} {detail}")
params = reply.get("kv_transfer_params") if isinstance(reply, dict) else None
vector = params.get("last_hidden_state") if isinstance(params, dict) else None
if not isinstance(vector, list):
    sys.exit(f"FAIL: no kv_transfer_params.last_hidden_state list in the reply: {str(reply)[:500]}")
if len(vector) != expected:
    sys.exit(f"FAIL: vector length {len(vector)}, expected {expected} (tests.hiddenSize)")
if not all(type(x) in (int, float) and math.isfinite(x) for x in vector):
    sys.exit("FAIL: the vector holds values that are not finite numbers")
guarded = ", 401 without the key" if api_key else ""
print(f"OK: {len(vector)} floats{guarded}, first {vector[:4]}")
