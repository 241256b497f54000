"""Images through the three APIs (issue #36), served in-process over the tiny seeded Qwen3.5 VL checkpoint: OpenAI
chat `image_url` parts, Responses `input_image` parts and Anthropic `image` blocks give the greedy answer of
transformers' Qwen3_5ForConditionalGeneration (the oracle) on the same prompt ids, built here by hand from the
fixture's chat template, and the pixel values of transformers' own image processor; the answer's logprobs are the
oracle's. Bad images, too many or too large, images by URL while fetching is off, file ids and images sent to a
text-only model get 400s that say why; /v1/models tells the two models apart; with --image-url-fetch on an http
URL served on 127.0.0.1 is read, bounded by --max-image-mib."""
from __future__ import annotations

import base64
import contextlib
import dataclasses
import io
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import torch
from PIL import Image

from tests.api.vl_server import (IM_END, IM_START, VISION_END, VISION_START, add_vl_tokenizer, png, served,
                                  text_ids, user_prompt)
from tests.engine.qwen35_models import tiny_checkpoint
from tests.engine.vision_models import IMAGE_TOKEN, image_processor, synthetic_image, tiny_vl_checkpoint

MAX_TOKENS = 16
TEXT = "Describe this picture: "
IMAGES = [synthetic_image(100, 70, seed=7), synthetic_image(40, 90, seed=8)]  # 96x64 and 64x96 once resized


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_uri(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{b64(data)}"


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """(transformers model, RunningServer) of the tiny VL checkpoint with the fixture's chat tokenizer."""
    hf, folder = tiny_vl_checkpoint(tmp_path_factory.mktemp("vl-api") / "tiny-vl")
    add_vl_tokenizer(folder)
    with served(folder, "tiny-vl") as server:
        yield hf, server


@pytest.fixture(scope="module")
def text_only(tmp_path_factory):
    """A RunningServer over a tiny text-only Qwen3.5 checkpoint with the same tokenizer and template."""
    _, folder = tiny_checkpoint(tmp_path_factory.mktemp("text-api") / "tiny-text")
    add_vl_tokenizer(folder)
    with served(folder, "tiny-text") as server:
        yield server


@contextlib.contextmanager
def settings(server, **changes):
    """The server's settings changed for the block (state.apply_settings, as a live settings change does)."""
    state = server.state
    before = state.settings
    state.apply_settings(dataclasses.replace(before, **changes))
    try:
        yield
    finally:
        state.apply_settings(before)


def post(server, path: str, body: dict) -> httpx.Response:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        return client.post(path, json=body)


def oracle(hf, tokenizer, prompt: list[int], images) -> tuple[str, list[float], int]:
    """transformers' greedy answer on `prompt` with `images` (its own image processor), cut where <|im_end|> ends
    it: (the text, each answer token's logprob, the tokens generated)."""
    pixels = image_processor()(images=images, return_tensors="pt")
    t = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(input_ids=t, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                          mm_token_type_ids=(t == IMAGE_TOKEN).int(), max_new_tokens=MAX_TOKENS, do_sample=False,
                          output_scores=True, return_dict_in_generate=True)
    ids = out.sequences[0, len(prompt):].tolist()
    logprobs = [float(torch.log_softmax(s[0].float(), -1)[i]) for s, i in zip(out.scores, ids)]
    end = ids.index(IM_END) + 1 if IM_END in ids else len(ids)
    return tokenizer.decode(ids[:end]), logprobs[:end], end


def token_counts(images) -> list[int]:
    """The <|image_pad|> tokens each image takes, from transformers' image processor's grids (2x2 patches each)."""
    grids = image_processor()(images=images, return_tensors="pt")["image_grid_thw"]
    return [int(g.prod()) // 4 for g in grids]


def chat_body(content: list[dict], **extra) -> dict:
    return {"model": "tiny-vl", "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "temperature": 0, **extra}


def image_url(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": "high"}}


def test_three_apis_give_transformers_greedy_answer(vl):
    """Text, a PNG, text, a JPEG, text through chat, Responses and Messages: the prompt they count is the
    hand-built one (each image's single placeholder repeated to its token count, as transformers' processor counts
    them), and the answer is transformers' greedy answer, with its logprobs (chat) to 1e-4. The images swapped give
    transformers another answer, so a request that read them out of order (or not at all) would fail here."""
    hf, server = vl
    tokenizer = server.state.loaded.tokenizer
    first, second = png(IMAGES[0]), png(IMAGES[1], "JPEG")
    decoded = [IMAGES[0], Image.open(io.BytesIO(second)).convert("RGB")]  # the oracle reads the JPEG's pixels
    texts = ["Compare ", " with ", " now."]
    counts = token_counts(decoded)
    prompt = user_prompt(texts[0], counts[0], texts[1], counts[1], texts[2])
    text, logprobs, generated = oracle(hf, tokenizer, prompt, decoded)
    swapped = user_prompt(texts[0], counts[1], texts[1], counts[0], texts[2])
    assert generated >= 8 and oracle(hf, tokenizer, swapped, decoded[::-1])[0] != text

    chat = post(server, "/v1/chat/completions", chat_body([
        {"type": "text", "text": texts[0]}, image_url(data_uri(first)), {"type": "text", "text": texts[1]},
        image_url(data_uri(second, "image/jpeg")), {"type": "text", "text": texts[2]}], logprobs=True))
    assert chat.status_code == 200, chat.text
    body = chat.json()
    assert body["choices"][0]["message"]["content"] == text
    assert body["usage"]["prompt_tokens"] == len(prompt)
    ours = [e["logprob"] for e in body["choices"][0]["logprobs"]["content"]]
    assert len(ours) >= generated - 1 and ours == pytest.approx(logprobs[:len(ours)], abs=1e-4)

    responses = post(server, "/v1/responses", {
        "model": "tiny-vl", "max_output_tokens": MAX_TOKENS, "temperature": 0,
        "input": [{"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": texts[0]}, {"type": "input_image", "image_url": data_uri(first),
                                                       "detail": "auto"},
            {"type": "input_text", "text": texts[1]}, {"type": "input_image", "detail": "low",
                                                       "image_url": data_uri(second, "image/jpeg")},
            {"type": "input_text", "text": texts[2]}]}]})
    assert responses.status_code == 200, responses.text
    message = next(i for i in responses.json()["output"] if i["type"] == "message")
    assert message["content"][0]["text"] == text
    assert responses.json()["usage"]["input_tokens"] == len(prompt)

    messages = post(server, "/v1/messages", {
        "model": "tiny-vl", "max_tokens": MAX_TOKENS, "temperature": 0,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": texts[0]},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(first)}},
            {"type": "text", "text": texts[1]},
            {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": b64(second)}},
            {"type": "text", "text": texts[2]}]}]})
    assert messages.status_code == 200, messages.text
    reply = messages.json()
    assert "".join(b["text"] for b in reply["content"] if b["type"] == "text") == text
    assert reply["usage"]["input_tokens"] + reply["usage"]["cache_read_input_tokens"] == len(prompt)


def test_token_counts_include_the_images(vl):
    """The counting routes render as the generation routes do: the hand-built prompt's length, image tokens and
    all, for the same image in each API's shape."""
    _, server = vl
    data = png(IMAGES[0])
    prompt = user_prompt(TEXT, *token_counts(IMAGES[:1]))
    text = {"type": "text", "text": TEXT}
    chat = post(server, "/v1/chat/completions/input_tokens", chat_body([text, image_url(data_uri(data))]))
    responses = post(server, "/v1/responses/input_tokens", {"model": "tiny-vl", "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": TEXT},
                                                        {"type": "input_image", "image_url": data_uri(data)}]}]})
    messages = post(server, "/v1/messages/count_tokens", {"model": "tiny-vl", "max_tokens": 1, "messages": [
        {"role": "user", "content": [text, {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                        "data": b64(data)}}]}]})
    assert [chat.json()["input_tokens"], responses.json()["input_tokens"],
            messages.json()["input_tokens"]] == [len(prompt)] * 3


def test_n_choices_with_an_image(vl):
    """n=2 at temperature 0 with one image: both choices are transformers' greedy answer, logprobs and all."""
    hf, server = vl
    prompt = user_prompt(TEXT, *token_counts(IMAGES[:1]))
    text, logprobs, generated = oracle(hf, server.state.loaded.tokenizer, prompt, IMAGES[:1])
    assert generated >= 8
    r = post(server, "/v1/chat/completions", chat_body([{"type": "text", "text": TEXT},
                                                        image_url(data_uri(png(IMAGES[0])))], n=2, logprobs=True))
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        ours = [e["logprob"] for e in choice["logprobs"]["content"]]
        assert choice["message"]["content"] == text
        assert len(ours) >= generated - 1 and ours == pytest.approx(logprobs[:len(ours)], abs=1e-4)
    assert r.json()["usage"]["prompt_tokens"] == len(prompt)


def test_anthropic_tool_result_image(vl):
    """An image inside an Anthropic tool_result: the template's tool turn holds it, and the answer is
    transformers' on that prompt."""
    hf, server = vl
    data = png(IMAGES[0])
    image = [VISION_START, *[IMAGE_TOKEN] * token_counts(IMAGES[:1])[0], VISION_END]
    prompt = [IM_START, *text_ids("user\nLook.\n\nShot:"), IM_END, *text_ids("\n"),
              IM_START, *text_ids("assistant\n"), IM_END, *text_ids("\n"),
              IM_START, *text_ids("user\n<tool_response>\nScreen: "), *image,
              *text_ids("\n</tool_response>"), IM_END, *text_ids("\n"), IM_START, *text_ids("assistant\n")]
    text, _, generated = oracle(hf, server.state.loaded.tokenizer, prompt, IMAGES[:1])
    assert generated >= 8
    r = post(server, "/v1/messages", {"model": "tiny-vl", "max_tokens": MAX_TOKENS, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Look."}, {"type": "text", "text": "Shot:"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "Screen: "},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": b64(data)}}]}]}]})
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["usage"]["input_tokens"] + reply["usage"]["cache_read_input_tokens"] == len(prompt)
    assert "".join(b["text"] for b in reply["content"] if b["type"] == "text") == text


def error_of(response: httpx.Response) -> tuple[str, str | None]:
    """(message, param) of an error body in the OpenAI or the Anthropic shape."""
    error = response.json()["error"]
    return error["message"], error.get("param")


BAD_URLS = {
    "undecodable bytes": (data_uri(b"these bytes are no image at all"), "cannot be decoded"),
    "not an image media type": (data_uri(png(IMAGES[0]), "text/plain"), "not an image type"),
    "not base64": ("data:image/png,rawbytes", "not base64-encoded"),
    "broken base64": ("data:image/png;base64,@@@@", "not valid base64"),
    "bare base64": (b64(png(IMAGES[0])), "looks like bare base64"),
    "file url": ("file:///etc/hostname", "file:// URLs are not read"),
    "http while fetching is off": ("http://127.0.0.1:9/cat.png", "--image-url-fetch"),
    "aspect ratio over 200": (data_uri(png(synthetic_image(1005, 5))), "aspect ratio is over 200:1"),
}


@pytest.mark.parametrize("case", list(BAD_URLS))
def test_bad_image_urls_are_refused_with_the_reason(vl, case):
    _, server = vl
    url, reason = BAD_URLS[case]
    r = post(server, "/v1/chat/completions", chat_body([{"type": "text", "text": "Hi"}, image_url(url)]))
    assert r.status_code == 400, r.text
    message, param = error_of(r)
    assert reason in message and param == "messages[0].content[1]"


def test_the_placeholder_spelled_in_text_is_refused(vl):
    """The image token written as text, with no image for it, would be read as an image slot: a 400, not a prompt
    whose placeholders disagree with its images."""
    _, server = vl
    r = post(server, "/v1/chat/completions", chat_body([{"type": "text", "text": "<|image_pad|> what is it?"}]))
    assert r.status_code == 400 and "placeholder token itself" in error_of(r)[0]


def test_oversize_and_too_many_images_are_refused(vl):
    """An image over --max-image-mib (refused from its base64 length, before decoding) and a request with more
    images than --max-images."""
    _, server = vl
    big = os.urandom(1024 * 1024 + 1)  # one byte over 1 MiB: never decoded, so it need not be an image
    with settings(server, max_image_mib=1, max_images=2):
        r = post(server, "/v1/chat/completions", chat_body([image_url(data_uri(big))]))
        assert r.status_code == 400
        message, param = error_of(r)
        assert "over this server's limit of 1 MiB per image (--max-image-mib)" in message
        assert param == "messages[0].content[0]"
        three = [image_url(data_uri(png(IMAGES[0])))] * 3
        r = post(server, "/v1/chat/completions", chat_body([{"type": "text", "text": "Hi"}, *three]))
        assert r.status_code == 400
        message, param = error_of(r)
        assert "has 3 images; the server takes at most 2 per request (--max-images)" in message
        assert param == "messages[0].content[3]"
    # the same request is read under the default limit: it was the setting that refused it
    assert post(server, "/v1/chat/completions", chat_body(three, max_tokens=1)).status_code == 200


def test_anthropic_media_type_must_match_the_bytes(vl):
    _, server = vl
    data = b64(png(IMAGES[0]))

    def send(media: str) -> httpx.Response:
        return post(server, "/v1/messages", {"model": "tiny-vl", "max_tokens": 1, "messages": [
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": media,
                                                                      "data": data}}]}]})

    r = send("image/jpeg")
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "media_type says image/jpeg, but the image data is image/png" in r.json()["error"]["message"]
    r = send("image/bmp")
    assert r.status_code == 400 and "media_type 'image/bmp' is not accepted" in r.json()["error"]["message"]
    assert send("image/png").status_code == 200


def test_responses_file_id_is_refused(vl):
    _, server = vl
    r = post(server, "/v1/responses", {"model": "tiny-vl", "input": [{"type": "message", "role": "user", "content": [
        {"type": "input_image", "file_id": "file-abc", "detail": "auto"}]}]})
    assert r.status_code == 400
    message, param = error_of(r)
    assert "stores no files" in message and param == "input[0].content[0].file_id"


def test_images_to_a_text_only_model_are_refused_on_every_api(text_only):
    """OpenAI's wording and the reason, with the part named; never a silent drop of the image."""
    data = png(IMAGES[0])
    chat = post(text_only, "/v1/chat/completions", {**chat_body([{"type": "text", "text": "Hi"},
                                                                 image_url(data_uri(data))]), "model": "tiny-text"})
    assert chat.status_code == 400
    message, param = error_of(chat)
    assert message.startswith("Invalid content type. image_url is only supported by certain models")
    assert "messages[0].content[1] is an image_url part" in message and "has no vision" in message
    assert param == "messages[0].content[1]"
    responses = post(text_only, "/v1/responses", {"model": "tiny-text", "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": data_uri(data)}]}]})
    assert responses.status_code == 400 and error_of(responses)[1] == "input[0].content[0]"
    messages = post(text_only, "/v1/messages", {"model": "tiny-text", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                  "data": b64(data)}}]}]})
    assert messages.status_code == 400
    reason = messages.json()["error"]["message"]
    assert "messages[0].content[0] is an image block, but tiny-text has no vision" in reason
    text = post(text_only, "/v1/chat/completions", {**chat_body([{"type": "text", "text": "Hi"}]), "model": "tiny-text",
                                                    "max_tokens": 2})
    assert text.status_code == 200  # the same server answers text


def test_models_report_vision_and_input_modalities(vl, text_only):
    _, server = vl
    for running, vision, modalities in ((server, True, ["text", "image"]), (text_only, False, ["text"])):
        with httpx.Client(base_url=running.base_url) as client:
            card = client.get("/v1/models").json()["data"][0]
        assert card["capabilities"]["vision"] is vision
        assert card["input_modalities"] == modalities == card["architecture"]["input_modalities"]


class _Images(BaseHTTPRequestHandler):
    files: dict[str, bytes] = {}

    def do_GET(self):
        if self.path == "/to-file":
            self.send_response(302)
            self.send_header("Location", "file:///etc/hostname")
            self.end_headers()
            return
        data = self.files.get(self.path)
        self.send_response(200 if data is not None else 404)
        self.send_header("Content-Length", str(len(data or b"")))
        self.end_headers()
        self.wfile.write(data or b"")

    def log_message(self, *args):
        pass


@pytest.fixture
def image_host():
    """An http server on 127.0.0.1 serving /cat.png (the test image), /big.png (over 1 MiB), /to-file (a
    redirect to a file:// URL)."""
    _Images.files = {"/cat.png": png(IMAGES[0]), "/big.png": os.urandom(1024 * 1024 + 10)}
    host = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=host.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{host.server_address[1]}"
    finally:
        host.shutdown()
        host.server_close()


def test_fetched_image_url_reads_like_the_inline_image(vl, image_host):
    """With --image-url-fetch on, an http URL gives the answer the same image gives inline (transformers'); an
    image over --max-image-mib, a missing one and a redirect to file:// are refused."""
    hf, server = vl
    prompt = user_prompt(TEXT, *token_counts(IMAGES[:1]))
    text, _, _ = oracle(hf, server.state.loaded.tokenizer, prompt, IMAGES[:1])
    with settings(server, image_url_fetch=True, max_image_mib=1):
        r = post(server, "/v1/chat/completions", chat_body([{"type": "text", "text": TEXT},
                                                            image_url(image_host + "/cat.png")]))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == text
        refusals = {"/big.png": "over this server's limit of 1 MiB", "/none.png": "gave HTTP 404",
                    "/to-file": "only http(s) redirects are followed"}
        for path, reason in refusals.items():
            r = post(server, "/v1/chat/completions", chat_body([image_url(image_host + path)]))
            assert r.status_code == 400 and reason in error_of(r)[0], (path, r.text)


def test_a_resent_image_reports_cached_tokens_and_another_image_does_not_hit(vl):
    """The same conversation with the same image sent again: usage reports the prefix read from the cache (whole
    pages, through the image) and the answer and its logprobs are the first request's and transformers'; the same
    text with another image of the same size reuses no more than the text before the image (on this hybrid: none,
    no recurrent snapshot lies there), and its answer is transformers' for that image."""
    hf, server = vl
    tokenizer = server.state.loaded.tokenizer
    before, after = "Look closely at the next picture, then say what you see. " * 4, " What is in it? " * 6
    other = synthetic_image(100, 70, seed=9)  # the same size as IMAGES[0]: the same placeholder tokens

    def ask(image):
        return post(server, "/v1/chat/completions", chat_body([
            {"type": "text", "text": before}, image_url(data_uri(png(image))), {"type": "text", "text": after}],
            logprobs=True)).json()

    def cached(body) -> int:
        return body["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)

    count = token_counts([IMAGES[0]])[0]
    prompt = user_prompt(before, count, after)
    image_at = len([IM_START, *text_ids("user\n" + before)])  # where <|vision_start|> goes
    first, again = ask(IMAGES[0]), ask(IMAGES[0])
    text, logprobs, _ = oracle(hf, tokenizer, prompt, [IMAGES[0]])
    assert first["choices"][0]["message"]["content"] == again["choices"][0]["message"]["content"] == text
    assert cached(again) > image_at + count, (cached(again), image_at, len(prompt))  # past the image
    ours = [[e["logprob"] for e in b["choices"][0]["logprobs"]["content"]] for b in (first, again)]
    assert ours[1] == pytest.approx(ours[0], abs=1e-5) and ours[1] == pytest.approx(logprobs[:len(ours[1])], abs=1e-4)
    changed = ask(other)
    assert cached(changed) <= image_at, (cached(changed), image_at)
    text_other, logprobs_other, _ = oracle(hf, tokenizer, prompt, [other])
    assert changed["choices"][0]["message"]["content"] == text_other
    mine = [e["logprob"] for e in changed["choices"][0]["logprobs"]["content"]]
    assert mine == pytest.approx(logprobs_other[:len(mine)], abs=1e-4)
