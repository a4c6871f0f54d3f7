"""An in-process fake of the proxy for ``extract``'s unit tests (an ``httpx.MockTransport``):
its capture description, and answers whose vectors are a function of the prompt, so a test can
tell each input's row apart. A prompt (or a chat's last message) may ask for trouble:

- ``"bad ..."``: a 400 with an OpenAI-style error;
- ``"busy N ..."``: 503 for the first N tries, then the answer;
- ``"refuse CODE N [after SECONDS] ..."``: status CODE for the first N tries (with
  ``Retry-After: SECONDS``), then the answer;
- ``"drop N ..."``: a connection error for the first N tries;
- ``"lack K ..."``: a 200 answer without layer K;
- ``"garble ..."``: a 200 answer whose base64 is not base64;
- ``"odd ..."``: a 200 answer whose info's ``position`` is not an integer;
- ``"far ..."``: a 200 answer whose info's ``position`` is an integer no int32 column holds;
- ``"crash ..."``: the transport raises ``RuntimeError`` (what no input explains: a bug).

``on_request`` (awaited with the POST's 1-based number before it is answered) lets a test act
mid-run: send a signal, hold requests (:meth:`FakeProxy.stall`) until the run cancels them.
``override`` (called with the prompt's text and the request body) answers a request its own
way when it returns a response (a hostile answer). ``limits`` are laid over the capture
description's.

A batch (a completions list of prompts, or ``/v1/chat/completions/batch``, which the fake serves
unless ``chat_batches`` is false: then 404) is answered as the proxy does: each prompt as
above, the first that is not a 200 (or that ``override`` answers) the whole answer, else one
choice and one entry per prompt. ``batches`` records each request's count of inputs.
"""

from __future__ import annotations

import asyncio
import base64
import json
import zlib
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import httpx
import numpy as np

HIDDEN_SIZE = 8
NUM_LAYERS = 2
LAYERS = [0, 1, 2]


def capture_document(
    slots: int = 1024,
    model: str = "fake",
    instance: str = "00",
    limits: Mapping[str, int | None] | None = None,
) -> dict[str, Any]:
    engine = {
        "instance": instance, "engine": 0, "runner": "fake", "hidden_size": HIDDEN_SIZE,
        "num_hidden_layers": NUM_LAYERS, "layers": LAYERS, "slots": slots,
        "arena_bytes": 1 << 20, "max_record_bytes": 1 << 16,
    }  # fmt: skip
    document: dict[str, Any] = {
        "object": "hidden_state_capture", "model": model, "models": [model],
        "hidden_size": HIDDEN_SIZE, "num_hidden_layers": NUM_LAYERS, "layers": LAYERS,
        "poolings": ["last", "mean", "last_answer", "all_prompt", "all_answer"],
        "formats": ["float", "base64"], "dtypes": ["float32", "float16", "bfloat16"],
        "limits": {"max_prompts": 2048, "max_spans": 1024, "max_layers": 1024,
                   "max_record_bytes": 1 << 16, "arena_bytes": 1 << 20,
                   "max_embedding_inputs": 2048, "max_body_bytes": 1 << 25,
                   "max_client_connections": 1024},
        "engines": [engine],
    }  # fmt: skip
    for name, value in (limits or {}).items():  # None: a limit an earlier release did not say
        if value is None:
            del document["limits"][name]
        else:
            document["limits"][name] = value
    return document


def expected_vector(text: str, layer: int) -> np.ndarray:
    """The fake's vector for a prompt (a chat: its last message) and layer."""
    seed = zlib.crc32(f"{text}|{layer}".encode())
    return np.random.default_rng(seed).standard_normal(HIDDEN_SIZE).astype(np.float32)


def matrix_rows(text: str, kv: Mapping[str, Any]) -> int | None:
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


def _inputs(body: dict[str, Any]) -> int:
    """A request's count of inputs: a list's prompts, a chat batch's chats, else one."""
    batch = body.get("prompt", body.get("messages"))
    if isinstance(batch, list) and batch and isinstance(batch[0], (str, list)):
        return len(batch)
    return 1


#: How long :meth:`FakeProxy.stall` waits for the run to cancel it before it fails the test.
STALL_LIMIT = 30.0


class FakeProxy:
    def __init__(
        self,
        slots: int = 1024,
        model: str = "fake",
        on_request: Callable[[int], Awaitable[None]] | None = None,
        instance: str = "00",
        override: Callable[[str, dict[str, Any]], httpx.Response | None] | None = None,
        limits: Mapping[str, int | None] | None = None,
        chat_batches: bool = True,
    ) -> None:
        self.chat_batches = chat_batches
        self.batches: list[int] = []
        self.override = override
        self.limits = limits
        self.slots = slots
        self.model = model
        self.instance = instance
        self.on_request = on_request
        self.requests = 0
        self.tries: Counter[str] = Counter()
        self.in_flight = 0
        self.most_in_flight = 0
        self.sent: list[dict[str, Any]] = []
        self.stalled = 0
        self.released = 0

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def stall(self) -> None:
        """Hold a request until the run cancels it (in flight when the run stops); counted in
        ``stalled``, and in ``released`` once cancelled."""
        self.stalled += 1
        try:
            await asyncio.sleep(STALL_LIMIT)
        except asyncio.CancelledError:
            self.released += 1
            raise
        raise AssertionError(f"the run did not stop its requests within {STALL_LIMIT} s")

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            document = capture_document(self.slots, self.model, self.instance, self.limits)
            return httpx.Response(200, json=document)
        self.requests += 1
        inputs = _inputs(json.loads(request.content))  # each a ring slot
        self.in_flight += inputs
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.on_request is not None:
                await self.on_request(self.requests)
            await asyncio.sleep(0)
            return unread(self._answer(request))
        finally:
            self.in_flight -= inputs

    def _answer(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/v1/chat/completions/batch":
            if not self.chat_batches:
                return httpx.Response(404, json={"detail": "Not Found"})
            bodies = [{**body, "messages": chat} for chat in body["messages"]]
            return self._batch(request, bodies)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return self._batch(request, [{**body, "prompt": one} for one in prompt])
        self.batches.append(1)
        return self._one(request, body)

    def _batch(self, request: httpx.Request, bodies: list[dict[str, Any]]) -> httpx.Response:
        self.batches.append(len(bodies))
        documents = []
        for body in bodies:
            response = self._one(request, body)
            if response.status_code != 200:
                return response
            try:
                document = json.loads(response.content)
            except (httpx.ResponseNotRead, ValueError):  # an override's answer
                return response
            if "choices" not in document:  # an override's answer
                return response
            documents.append(document)
        kv: dict[str, Any] = {"last_hidden_states_by_layer": [], "last_hidden_state_infos": []}
        choices: list[dict[str, Any]] = []
        for document in documents:
            one = document["kv_transfer_params"]
            kv["last_hidden_states_by_layer"].append(one["last_hidden_states_by_layer"])
            kv["last_hidden_state_infos"].append(one["last_hidden_state_info"])
            choices += [{**c, "index": len(choices) + i} for i, c in enumerate(document["choices"])]
        if "last_hidden_state_dtype" in documents[0]["kv_transfer_params"]:
            kv["last_hidden_state_dtype"] = documents[0]["kv_transfer_params"][
                "last_hidden_state_dtype"
            ]
        return httpx.Response(200, json={"choices": choices, "kv_transfer_params": kv})

    def _one(self, request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        text = _text(body)
        self.tries[text] += 1
        words = text.split()
        if self.override is not None:
            answer = self.override(text, body)
            if answer is not None:
                return answer
        if words[0] == "bad":
            return httpx.Response(400, json={"error": {"message": "too long", "code": 400}})
        if words[0] == "crash":
            raise RuntimeError("a bug in the run")
        if words[0] in ("busy", "drop") and self.tries[text] <= int(words[1]):
            if words[0] == "drop":
                raise httpx.ConnectError("refused", request=request)
            return httpx.Response(503, json={"error": {"message": "busy", "code": 503}})
        if words[0] == "refuse" and self.tries[text] <= int(words[2]):
            code = int(words[1])
            headers = {"retry-after": words[4]} if words[3:4] == ["after"] else {}
            error = {"error": {"message": f"refused {code}", "code": code}}
            return httpx.Response(code, json=error, headers=headers)
        self.sent.append(body)
        document = _answer(text, words, body["kv_transfer_params"])
        if isinstance(body.get("prompt"), list):  # token ids: their count, as vLLM's
            document["kv_transfer_params"]["last_hidden_state_info"]["num_prompt_tokens"] = len(
                body["prompt"]
            )
        document["choices"] = [{"index": c, "text": "x"} for c in range(body.get("n", 1))]
        return httpx.Response(200, json=document)


def _answer(text: str, words: list[str], kv: Mapping[str, Any]) -> dict[str, Any]:
    dtype = kv.get("last_hidden_state_dtype", "float32")
    numpy_dtype = "<f2" if dtype == "float16" else "<f4"
    rows = matrix_rows(text, kv)
    by_layer: dict[str, Any] = {}
    for k in kv["last_hidden_state_layers"]:
        if words[:2] == ["lack", str(k)]:
            continue
        if rows is None:
            values = expected_vector(text, k)
        else:
            values = np.stack([expected_vector(f"{text}#{r}", k) for r in range(rows)])
        data = base64.b64encode(values.astype(numpy_dtype).tobytes()).decode()
        if words[0] == "garble":
            data = "*" + data[1:]
        matrix = {"shape": [rows, HIDDEN_SIZE], "dtype": dtype, "data": data}
        by_layer[str(k)] = data if rows is None else matrix
    position = {"odd": "three", "far": 1 << 40}.get(words[0], 3)
    info = {"position": position, "num_prompt_tokens": 4,
            "hidden_size": HIDDEN_SIZE,
            "dtype": dtype, "pooling": kv["last_hidden_state_pooling"]}  # fmt: skip
    answer = {"kv_transfer_params": {"last_hidden_states_by_layer": by_layer,
                                     "last_hidden_state_info": info}}  # fmt: skip
    if dtype != "float32":  # as the proxy: the dtype beside 16-bit values
        answer["kv_transfer_params"]["last_hidden_state_dtype"] = dtype
    return answer


def unread(response: httpx.Response) -> httpx.Response:
    """``response`` as a network transport gives it: its body not yet read (httpx reads an
    in-memory body when the response is made, and decodes it)."""
    if not response.is_stream_consumed:
        return response
    headers = [(k, v) for k, v in response.headers.raw if k.lower() != b"content-encoding"]
    return httpx.Response(
        response.status_code, headers=headers, stream=httpx.ByteStream(response.content)
    )


def routed(proxies: Mapping[str, FakeProxy]) -> httpx.MockTransport:
    """One transport for several fakes, each answering for its URL's host."""

    async def handle(request: httpx.Request) -> httpx.Response:
        return await proxies[request.url.host].handle(request)

    return httpx.MockTransport(handle)
