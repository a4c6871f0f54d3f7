"""An in-process fake of the proxy for ``extract``'s unit tests (an ``httpx.MockTransport``):
its capture description, and answers whose vectors are a function of the prompt, so a test can
tell each input's row apart. A prompt (or a chat's last message) may ask for trouble:

- ``"bad ..."``: a 400 with an OpenAI-style error;
- ``"busy N ..."``: 503 for the first N tries, then the answer;
- ``"drop N ..."``: a connection error for the first N tries.
"""

from __future__ import annotations

import base64
import json
import zlib
from collections import Counter
from typing import Any

import httpx
import numpy as np

HIDDEN_SIZE = 8
NUM_LAYERS = 2
LAYERS = [0, 1, 2]


def capture_document(slots: int = 1024) -> dict[str, Any]:
    engine = {
        "instance": "00", "engine": 0, "runner": "fake", "hidden_size": HIDDEN_SIZE,
        "num_hidden_layers": NUM_LAYERS, "layers": LAYERS, "slots": slots,
        "arena_bytes": 1 << 20, "max_record_bytes": 1 << 16,
    }  # fmt: skip
    return {
        "object": "hidden_state_capture", "model": "fake", "models": ["fake"],
        "hidden_size": HIDDEN_SIZE, "num_hidden_layers": NUM_LAYERS, "layers": LAYERS,
        "poolings": ["last", "mean", "last_answer", "all_prompt", "all_answer"],
        "formats": ["float", "base64"], "dtypes": ["float32", "float16", "bfloat16"],
        "limits": {"max_prompts": 2048, "max_spans": 1024, "max_layers": 1024,
                   "max_record_bytes": 1 << 16, "arena_bytes": 1 << 20,
                   "max_embedding_inputs": 2048, "max_body_bytes": 1 << 25},
        "engines": [engine],
    }  # fmt: skip


def expected_vector(text: str, layer: int) -> np.ndarray:
    """The fake's vector for a prompt (a chat: its last message) and layer."""
    seed = zlib.crc32(f"{text}|{layer}".encode())
    return np.random.default_rng(seed).standard_normal(HIDDEN_SIZE).astype(np.float32)


def matrix_rows(text: str, kv: dict[str, Any]) -> int | None:
    """A matrix's row count: one per span, or a prompt's word count (``all_prompt``)."""
    if "last_hidden_state_spans" in kv:
        return len(kv["last_hidden_state_spans"])
    if kv["last_hidden_state_pooling"] == "all_prompt":
        return len(text.split())
    return None


def _text(body: dict[str, Any]) -> str:
    if "messages" in body:
        return str(body["messages"][-1]["content"])
    prompt = body["prompt"]
    return prompt if isinstance(prompt, str) else " ".join(map(str, prompt))


class FakeProxy:
    def __init__(self, slots: int = 1024) -> None:
        self.slots = slots
        self.tries: Counter[str] = Counter()
        self.in_flight = 0
        self.most_in_flight = 0
        self.sent: list[dict[str, Any]] = []

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        import asyncio

        if request.method == "GET":
            return httpx.Response(200, json=capture_document(self.slots))
        body = json.loads(request.content)
        text = _text(body)
        self.tries[text] += 1
        words = text.split()
        if words[0] == "bad":
            return httpx.Response(400, json={"error": {"message": "too long", "code": 400}})
        if words[0] in ("busy", "drop") and self.tries[text] <= int(words[1]):
            if words[0] == "drop":
                raise httpx.ConnectError("refused", request=request)
            return httpx.Response(503, json={"error": {"message": "busy", "code": 503}})
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0)
        finally:
            self.in_flight -= 1
        self.sent.append(body)
        kv = body["kv_transfer_params"]
        dtype = kv.get("last_hidden_state_dtype", "float32")
        numpy_dtype = "<f2" if dtype == "float16" else "<f4"
        rows = matrix_rows(text, kv)
        by_layer: dict[str, Any] = {}
        for k in kv["last_hidden_state_layers"]:
            if rows is None:
                values = expected_vector(text, k)
            else:
                values = np.stack([expected_vector(f"{text}#{r}", k) for r in range(rows)])
            data = base64.b64encode(values.astype(numpy_dtype).tobytes()).decode()
            matrix = {"shape": [rows, HIDDEN_SIZE], "dtype": dtype, "data": data}
            by_layer[str(k)] = data if rows is None else matrix
        info = {"position": 3, "num_prompt_tokens": 4, "hidden_size": HIDDEN_SIZE,
                "dtype": dtype, "pooling": kv["last_hidden_state_pooling"]}  # fmt: skip
        answer = {"kv_transfer_params": {"last_hidden_states_by_layer": by_layer,
                                         "last_hidden_state_info": info}}  # fmt: skip
        if dtype != "float32":  # as the proxy: the dtype beside 16-bit values
            answer["kv_transfer_params"]["last_hidden_state_dtype"] = dtype
        return httpx.Response(200, json=answer)
