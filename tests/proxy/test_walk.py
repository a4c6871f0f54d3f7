"""The map of a flagged request's path in ``proxy/__init__.py`` is true of the code: a flagged
chat request (JSON, and streamed) and an ordinary one are traced through the app, with the real
http1 transport, to a fake vLLM on a real socket that publishes like the hook into a real
ring; every module the map names for that path runs, its stops in the map's order, and the
rooms of the package the request enters are the ones the map names.

The map's first stop (``server.py``: uvicorn and ``http_protocol.py``) runs per connection in
the real server, which an in-process client does not go through (``test_front_limits.py`` and
``test_http_abuse.py`` take that part through the real server).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import re
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import orjson
import pytest

import vllm_hidden_state_proxy.proxy
from tests.proxy.fakes import completion, create_writer, publish_for, running, settings_for
from vllm_hidden_state_proxy.processes import free_port
from vllm_hidden_state_proxy.proxy import create_app
from vllm_hidden_state_proxy.ring import RingWriter

pytestmark = pytest.mark.anyio

PACKAGE = "vllm_hidden_state_proxy"
#: Run by uvicorn per connection, not by an in-process client (see the module docstring).
NOT_IN_PROCESS = {f"{PACKAGE}.proxy.server", f"{PACKAGE}.proxy.http_protocol"}
API_KEY = "walk-key"
FLAGGED = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "kv_transfer_params": {"return_last_hidden_state": True},
}
#: A module's path in the map: ``name.py``, ``dir/name.py``, or a package ``dir/`` (not the
#: tail of a URL path).
_PATH = re.compile(r"(?<![/\w.])[a-z_0-9]+(?:/[a-z_0-9]+)*(?:\.py|/)")


@dataclass
class Stop:
    """One line of the map: the branch it is on (``None``: the trunk), whether it begins a
    stop, and the modules it names."""

    branch: str | None
    begins: bool
    modules: list[str] = field(default_factory=list)


def _module(path: str) -> str:
    """The module a path of the map names: under ``proxy/`` if it is there, else at the
    package's top (``ring/``, ``transport/http1.py``, ``protocol.py``)."""
    dotted = path.removesuffix(".py").removesuffix("/").replace("/", ".").removesuffix(".__init__")
    for candidate in (f"{PACKAGE}.proxy.{dotted}", f"{PACKAGE}.{dotted}"):
        with contextlib.suppress(ModuleNotFoundError):
            if importlib.util.find_spec(candidate) is not None:
                return candidate
    raise AssertionError(f"the map names {path}, which is no module of the package")


def the_map() -> list[Stop]:
    """The walk drawn in ``proxy/__init__.py``: from the line after ``client`` to the first
    blank line."""
    doc = vllm_hidden_state_proxy.proxy.__doc__ or ""
    lines = doc.split("\nclient\n", 1)[1].split("\n\n", 1)[0].splitlines()
    stops: list[Stop] = []
    branch: str | None = None
    for line in lines:
        text = line.strip()
        if not text or (text.startswith(("│", "▼")) and not _PATH.search(text)):
            continue
        if text.startswith(("├─", "└─")):
            branch = text.split()[1]
            stop = Stop(branch, True)
            text = text.split("▶", 1)[1]
        elif text.startswith("│") or line.startswith(" "):
            stop = Stop(branch, False)
        else:
            branch = None
            stop = Stop(None, True)
        stop.modules = [_module(path) for path in _PATH.findall(text)]
        stops.append(stop)
    return stops


def walk_of(branch: str) -> tuple[list[str], set[str]]:
    """(the stops in order, every module named) of the path through ``branch``: the trunk up
    to the branch's first line, and the branch. An ordinary request leaves the trunk at the
    first stop that tells it apart: what the trunk says of flagged requests (the flag's
    fields checked) it skips, so only its stops count."""
    stops = the_map()
    first = next(i for i, stop in enumerate(stops) if stop.branch == branch)
    trunk = [s for s in stops[:first] if s.branch is None]
    own = [s for s in stops[first:] if s.branch == branch]
    order = [s.modules[0] for s in trunk + own if s.begins]
    named = {m for s in own for m in s.modules} | set(order)
    if branch != "Ordinary":
        named |= {m for s in trunk for m in s.modules}
    return [m for m in order if m not in NOT_IN_PROCESS], named - NOT_IN_PROCESS


def rooms_named() -> set[str]:
    doc = vllm_hidden_state_proxy.proxy.__doc__ or ""
    listed = re.search(r"rooms of the package \(([^)]*)\)", doc.replace("\n", " "))
    assert listed is not None, "the map says which rooms the walk enters"
    return {_module(path).split(".")[1] for path in _PATH.findall(listed.group(1))}


class Trace:
    """The package's modules whose code runs, in the order they are first entered."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.paused = False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or self.paused:
            return
        name = frame.f_globals.get("__name__", "")
        if name.startswith(PACKAGE) and name not in self.order:
            self.order.append(name)

    @contextlib.contextmanager
    def running(self) -> Any:
        sys.setprofile(self)
        try:
            yield self
        finally:
            sys.setprofile(None)

    def entered(self, module: str) -> int | None:
        """Where ``module`` (or, for a package, its first module) was first entered."""
        return next(
            (
                i
                for i, name in enumerate(self.order)
                if name == module or name.startswith(module + ".")
            ),
            None,
        )

    @property
    def rooms(self) -> set[str]:
        return {name.split(".")[1] for name in self.order}


@contextlib.asynccontextmanager
async def fake_vllm(writer: RingWriter, trace: Trace) -> AsyncIterator[str]:
    """vLLM on a loopback port: publishes a keyed request's record (like the hook, before it
    replies) and replies with a completion, or a short event stream. Not traced: it is not the
    proxy."""

    async def handle(reader: asyncio.StreamReader, out: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            body = await reader.readexactly(length)
            trace.paused = True
            document = orjson.loads(body)
            request = _Request(body)
            if "vllm_xargs" in document:
                publish_for(writer, request)  # type: ignore[arg-type]
            if document.get("stream"):
                chunk = {"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"}}]}
                content = b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n"
                kind = b"text/event-stream"
            else:
                content, kind = orjson.dumps(completion()), b"application/json"
            out.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                % (kind, len(content), content)
            )
            trace.paused = False
            await out.drain()
        out.close()

    port = free_port()
    server = await asyncio.start_server(handle, "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


@dataclass
class _Request:
    """What ``publish_for`` reads of a request: its body."""

    content: bytes


async def traced(ring_dir: str, body: dict[str, Any]) -> Trace:
    trace = Trace()
    with create_writer(ring_dir) as writer:
        async with fake_vllm(writer, trace) as url:
            settings = settings_for(ring_dir, upstream_url=url, api_key=API_KEY)
            app = create_app(settings)  # the real transport
            async with running(app) as client:
                headers = {"authorization": f"Bearer {API_KEY}"}
                with trace.running():
                    response = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return trace


@pytest.mark.parametrize(
    ("branch", "body"),
    [("JSON", FLAGGED), ("stream", {**FLAGGED, "stream": True}), ("Ordinary", {"model": "m"})],
)
async def test_the_map_is_the_path_a_request_takes(
    ring_dir: str, branch: str, body: dict[str, Any]
) -> None:
    trace = await traced(ring_dir, body)
    order, named = walk_of(branch)
    missing = sorted(module for module in named if trace.entered(module) is None)
    assert not missing, f"the map names modules this request never ran: {missing}"
    firsts = [trace.entered(module) or 0 for module in order]
    assert firsts == sorted(firsts), f"stops out of order: {order} ran as {trace.order}"


async def test_a_flagged_request_enters_the_rooms_the_map_names(ring_dir: str) -> None:
    trace = await traced(ring_dir, FLAGGED)
    assert trace.rooms == rooms_named()
    # With the worker hook's room inside vLLM, no more than before the transport moved out.
    assert len(trace.rooms | {"worker_hook"}) <= 7
