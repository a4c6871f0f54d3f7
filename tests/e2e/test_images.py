"""Images (issue #8): chat ``image_url`` items through the proxy, every vector checked against
Transformers on the same processor output.

The model is the tiny random-weight Idefics3-style VLM of ``tests/e2e/tiny_vlm.py``
(see there why not Qwen2-VL). An image expands to tiles of ``<image>`` tokens plus tile markers;
all of them are prompt tokens, so the vector is taken at ``num_prompt_tokens - 1`` of the
expanded prompt, exactly as for text.

Runs in its own pytest session (``-m own_server``): it starts its own server on the VLM.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
from collections.abc import Iterator, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.reference import assert_matches
from tests.e2e.server import MAX_NUM_BATCHED_TOKENS, SERVED_MODEL_NAME, RunningStack, run_serve
from tests.e2e.tiny_vlm import FAKE_IMAGE_TOKEN, IMAGE_TOKEN, build_tiny_vlm

pytestmark = [pytest.mark.e2e, pytest.mark.own_server]

FLAG = {"kv_transfer_params": {"return_last_hidden_state": True, "last_hidden_state_info": True}}

#: Measured (cosine, relative L2) per case, printed at the end of the module (``-s``).
RESULTS: dict[str, tuple[float, float]] = {}


# --- images -------------------------------------------------------------------------------------


def solid_png(rgb: tuple[int, int, int], size: tuple[int, int] = (64, 64)) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, rgb).save(buffer, "PNG")
    return buffer.getvalue()


def gradient_png(size: tuple[int, int]) -> bytes:
    from PIL import Image

    width, height = size
    image = Image.new("RGB", size)
    image.putdata(
        [
            (255 * x // max(width - 1, 1), 255 * y // max(height - 1, 1), 128)
            for y in range(height)
            for x in range(width)
        ]
    )
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def image_item(png: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(png)}}


def text_item(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


RED = solid_png((220, 30, 30))
BLUE = solid_png((30, 60, 220), (56, 56))
GRADIENT = gradient_png((64, 64))
WIDE = gradient_png((112, 40))  # 1 x 2 tiles + global: another token count

LONG_TEXT = " ".join(
    f"Sentence number {i} talks about rivers, mountains and the colour {c}."
    for i, c in enumerate(["red", "green", "blue", "yellow", "violet", "orange"] * 3)
)


# --- the Transformers reference -----------------------------------------------------------------


def _images_in(messages: Sequence[dict[str, Any]]) -> list[bytes]:
    """The PNG bytes of every image item, in prompt order (what vLLM decodes from the URLs)."""
    found = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            continue
        for part in content:
            if part["type"] == "image_url":
                url = part["image_url"]["url"]
                found.append(base64.b64decode(url.split(",", 1)[1]))
    return found


class VlmReference:
    """The tiny VLM in Transformers: its processor (PIL backend) and ``model.model``."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir

    @cached_property
    def processor(self) -> Any:
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(self.model_dir, backend="pil")

    @cached_property
    def model(self) -> Any:
        import torch
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(self.model_dir, dtype=torch.float32)
        return model.eval()

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.text_config.hidden_size)

    def inputs(self, messages: list[dict[str, Any]], **template: Any) -> Any:
        """The processor's output for the templated prompt and its images (PNG-decoded)."""
        from PIL import Image

        template.setdefault("add_generation_prompt", True)
        text = self.processor.tokenizer.apply_chat_template(messages, tokenize=False, **template)
        images = [Image.open(io.BytesIO(png)).convert("RGB") for png in _images_in(messages)]
        if not images:
            return self.processor.tokenizer([text], add_special_tokens=False, return_tensors="pt")
        return self.processor(text=[text], images=[images], return_tensors="pt")

    def last_hidden_state(self, inputs: Any) -> list[float]:
        """``model.model(**inputs).last_hidden_state[0, -1]``: final norm, last prompt position."""
        import torch

        with torch.no_grad():
            out = self.model.model(**inputs).last_hidden_state[0, -1]
        return [float(x) for x in out.to(torch.float32)]


# --- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-vlm")


@pytest.fixture(scope="module")
def vlm(vlm_dir: Path) -> VlmReference:
    return VlmReference(vlm_dir)


@pytest.fixture(scope="module")
def vlm_stack(vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    with run_serve(vlm_dir, tmp_path_factory.mktemp("serve-vlm")) as running:
        yield running


@pytest.fixture(scope="module")
def vlm_client(vlm_stack: RunningStack) -> Any:
    from openai import OpenAI

    return OpenAI(
        base_url=vlm_stack.proxy_url + "/v1", api_key="unused", max_retries=0, timeout=120
    )


@pytest.fixture(scope="module", autouse=True)
def _print_results() -> Iterator[None]:
    yield
    for case, (cosine, rel_l2) in RESULTS.items():
        print(f"[images] {case}: cosine={cosine:.9f} rel_l2={rel_l2:.2e}")


# --- helpers ------------------------------------------------------------------------------------


def flagged(client: Any, messages: list[dict[str, Any]], **extra: Any) -> Any:
    return client.chat.completions.create(
        model=SERVED_MODEL_NAME,
        messages=messages,
        max_completion_tokens=1,
        temperature=0,
        extra_body={**FLAG, "return_token_ids": True, **extra},
    )


def check(
    case: str,
    response: Any,
    vlm: VlmReference,
    messages: list[dict[str, Any]],
    **template: Any,
) -> list[float]:
    """vLLM's prompt is the processor's, and the vector is Transformers' at its last position."""
    inputs = vlm.inputs(messages, **template)
    expected_ids = [int(t) for t in inputs["input_ids"][0]]
    body = response.model_dump()
    assert body["prompt_token_ids"] == expected_ids
    assert response.usage.prompt_tokens == len(expected_ids)
    params = body["kv_transfer_params"]
    assert isinstance(params, dict), f"no kv_transfer_params in {body}"
    info = params["last_hidden_state_info"]
    assert info["num_prompt_tokens"] == len(expected_ids)
    assert info["position"] == len(expected_ids) - 1
    vector = params["last_hidden_state"]
    assert isinstance(vector, list) and len(vector) == vlm.hidden_size
    RESULTS[case] = assert_matches(vector, vlm.last_hidden_state(inputs))
    return vector


def image_token_count(vlm: VlmReference, messages: list[dict[str, Any]]) -> int:
    image_id = vlm.processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    return int((vlm.inputs(messages)["input_ids"][0] == image_id).sum())


# --- tests --------------------------------------------------------------------------------------


def test_image_with_short_text(vlm_client: Any, vlm: VlmReference) -> None:
    messages = [{"role": "user", "content": [image_item(RED), text_item("What colour is this?")]}]
    response = flagged(vlm_client, messages)
    check("image + short text", response, vlm, messages)
    assert image_token_count(vlm, messages) > 0


def test_image_with_assistant_prefill(vlm_client: Any, vlm: VlmReference) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [text_item("Describe the picture."), image_item(GRADIENT)]},
        {"role": "assistant", "content": "The picture shows"},
    ]
    prefill = {"continue_final_message": True, "add_generation_prompt": False}
    response = flagged(vlm_client, messages, **prefill)
    vector = check("image + assistant prefill", response, vlm, messages, **prefill)
    plain = flagged(vlm_client, messages[:1])
    assert plain.model_dump()["kv_transfer_params"]["last_hidden_state"] != vector


def test_prompt_ending_in_an_image(vlm_client: Any, vlm: VlmReference) -> None:
    """The last prompt token belongs to the image's expansion (its closing marker).

    Continuing a message cuts the prompt after its last text item (Transformers' rule, which
    vLLM applies too), so an empty text item after the image keeps the image last.
    """
    messages = [{"role": "user", "content": [text_item("Look:"), image_item(BLUE), text_item("")]}]
    prefill = {"continue_final_message": True, "add_generation_prompt": False}
    response = flagged(vlm_client, messages, **prefill)
    check("prompt ending in an image", response, vlm, messages, **prefill)
    last = response.model_dump()["prompt_token_ids"][-1]
    assert last == vlm.processor.tokenizer.convert_tokens_to_ids(FAKE_IMAGE_TOKEN)


def test_two_images_in_one_message(vlm_client: Any, vlm: VlmReference) -> None:
    messages = [
        {
            "role": "user",
            "content": [
                text_item("First:"),
                image_item(RED),
                text_item("Second:"),
                image_item(WIDE),
                text_item("Which is wider?"),
            ],
        }
    ]
    response = flagged(vlm_client, messages)
    check("two images", response, vlm, messages)


def test_long_text_and_image_across_prefill_chunks(vlm_client: Any, vlm: VlmReference) -> None:
    """The image's tokens straddle the first chunk boundary; the prompt spans several chunks."""
    sentences = LONG_TEXT.split(". ")
    head = ""
    for count in range(1, len(sentences)):
        head = ". ".join(sentences[:count]) + ". "
        before = vlm.inputs([{"role": "user", "content": [text_item(head)]}])["input_ids"]
        if before.shape[1] >= MAX_NUM_BATCHED_TOKENS - 20:
            break
    messages = [
        {"role": "user", "content": [text_item(head), image_item(GRADIENT), text_item(LONG_TEXT)]}
    ]
    ids = vlm.inputs(messages)["input_ids"][0].tolist()
    image_id = vlm.processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    image_rows = [i for i, t in enumerate(ids) if t == image_id]
    assert image_rows[0] < MAX_NUM_BATCHED_TOKENS <= image_rows[-1], "image must straddle a chunk"
    assert len(ids) > 2 * MAX_NUM_BATCHED_TOKENS, "prompt must span several prefill chunks"
    response = flagged(vlm_client, messages)
    check("long text + image, chunked prefill", response, vlm, messages)


def _counter(stack: RunningStack, name: str) -> float:
    """A vLLM counter's total over its label sets, read through the proxy's /metrics."""
    text = httpx.get(stack.proxy_url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "_total")
    )


def test_same_image_twice_hits_the_caches(
    vlm_stack: RunningStack, vlm_client: Any, vlm: VlmReference
) -> None:
    """The same image twice in one message, then the same long prompt again (prefix cache),
    then the same image after different text (encoder/processor cache, no prefix hit)."""
    messages = [
        {
            "role": "user",
            "content": [
                text_item("Twice: " + LONG_TEXT),
                image_item(GRADIENT),
                text_item("and again"),
                image_item(GRADIENT),
            ],
        }
    ]
    first = flagged(vlm_client, messages)
    check("same image twice in one message", first, vlm, messages)
    hits_before = _counter(vlm_stack, "vllm:prefix_cache_hits")
    second = flagged(vlm_client, messages)
    assert _counter(vlm_stack, "vllm:prefix_cache_hits") > hits_before, "prefix cache hit"
    check("repeated prompt (prefix cache hit)", second, vlm, messages)
    other = [{"role": "user", "content": [text_item("Other text."), image_item(GRADIENT)]}]
    mm_hits_before = _counter(vlm_stack, "vllm:mm_cache_hits")
    response = flagged(vlm_client, other)
    assert _counter(vlm_stack, "vllm:mm_cache_hits") > mm_hits_before, "multimodal cache hit"
    check("same image, other text", response, vlm, other)


def test_concurrent_flagged_and_ordinary_image_requests(
    vlm_stack: RunningStack, vlm: VlmReference
) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=vlm_stack.proxy_url + "/v1", api_key="unused", max_retries=0)
    pictures = [RED, BLUE, GRADIENT, WIDE]
    jobs = [
        (
            i % 2 == 0,
            [
                {
                    "role": "user",
                    "content": [text_item(f"Picture {i}:"), image_item(pictures[i % 4])]
                    + ([image_item(pictures[(i + 1) % 4])] if i % 3 == 0 else [])
                    + [text_item(f"Describe it in {i + 2} words.")],
                }
            ],
        )
        for i in range(8)
    ]

    def run(job: tuple[bool, Any]) -> Any:
        is_flagged, messages = job
        if is_flagged:
            return flagged(client, messages)
        return client.chat.completions.create(
            model=SERVED_MODEL_NAME, messages=messages, max_completion_tokens=4
        )

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        responses = list(pool.map(run, jobs))
    for i, ((is_flagged, messages), response) in enumerate(zip(jobs, responses, strict=True)):
        if is_flagged:
            check(f"concurrent #{i}", response, vlm, messages)
        else:
            assert response.model_dump().get("kv_transfer_params") is None
            assert response.usage.prompt_tokens == vlm.inputs(messages)["input_ids"].shape[1]


def test_embeddings_with_messages_holding_images(
    vlm_stack: RunningStack, vlm: VlmReference
) -> None:
    """/v1/embeddings' chat form with an image: the unit-norm vector of that conversation."""
    import math

    messages = [
        {
            "role": "user",
            "content": [image_item(gradient_png((64, 48))), text_item("Embed this picture.")],
        }
    ]
    response = httpx.post(
        vlm_stack.proxy_url + "/v1/embeddings",
        json={"model": SERVED_MODEL_NAME, "messages": messages},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    (item,) = body["data"]
    inputs = vlm.inputs(messages, add_generation_prompt=False)  # the embeddings default
    assert body["usage"]["prompt_tokens"] == int(inputs["input_ids"].shape[1])
    expected = vlm.last_hidden_state(inputs)
    norm = math.sqrt(sum(v * v for v in expected))
    RESULTS["embeddings, messages with an image"] = assert_matches(
        item["embedding"], [v / norm for v in expected]
    )
