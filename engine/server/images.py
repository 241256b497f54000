"""Images in chat messages, shared by the three APIs (issue #36).

The API converters leave each image where it stood in the conversation: OpenAI chat's own `image_url` parts as
sent, and the Responses and Anthropic ones as `{"type": "image", "source": ImageSource}` parts (`image_part`),
which carry the `param` of the part in the client's request and, for Anthropic, the media type it declared.
`take_images` then, in the worker thread that renders the prompt: refuses images to a model without vision, more
than --max-images, and any image it cannot read (engine.server.image_sources: data URIs, fetched URLs, bounded by
--max-image-mib); decodes each (Pillow) and works out its grid of patches with the model's own resize rule; and
hands the chat template a plain `{"type": "image"}` part in its place (a Qwen3.5 template renders
<|vision_start|><|image_pad|><|vision_end|>). `place_images` repeats each rendered <|image_pad|> as many times as
its image has tokens, so the prompt is what Engine.submit(..., images=...) expects."""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import NInferError
from engine.model.image_processing import ImageProcessorConfig, open_image, preprocess, smart_resize
from engine.model.vision_positions import expand_image_placeholders
from engine.server.errors import APIError
from engine.server.image_sources import image_bytes

# Pillow's format name -> the media type a client declares for it (Anthropic's four).
MEDIA_TYPES = {"PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif", "WEBP": "image/webp"}
IMAGE_ROLES = ("user", "tool")


class ImageSource:
    """One image of a request as a converter hands it on: its URL (data: or http(s)), the `param` naming its part
    in the client's request, and the media type the client declared (None: not declared). A plain object, never
    a dict, so no JSON body can forge one."""
    __slots__ = ("url", "param", "media_type", "kind")

    def __init__(self, url: object, param: str, media_type: str | None = None, kind: str = "image_url part"):
        self.url, self.param, self.media_type, self.kind = url, param, media_type, kind


def image_part(url: object, param: str, media_type: str | None = None, kind: str = "image block") -> dict:
    """The chat content part that stands for one image of a Responses or Anthropic request (`kind`: what the
    client's API calls the part, for messages)."""
    return {"type": "image", "source": ImageSource(url, param, media_type, kind)}


@dataclass
class ReadImage:
    data: bytes  # the encoded file, as Engine.submit takes it
    grid: tuple[int, int, int]  # grid_thw: (frames, patch rows, patch columns)
    param: str


def vision_of(state):
    """The served model's engine.model.vision_input.VisionModel, or None for a text-only model."""
    loaded = state.loaded
    return getattr(getattr(loaded, "engine", None), "vision", None) if loaded is not None else None


def _source_of(part: dict, role: str, where: str) -> ImageSource | None:
    """The image a content part stands for (None: not an image part)."""
    kind = part.get("type")
    if kind == "image_url":
        spec = part.get("image_url")
        url = spec.get("url") if isinstance(spec, dict) else spec
        source = ImageSource(url, where)
    elif kind == "image":
        source = part.get("source")
        if not isinstance(source, ImageSource):
            raise APIError(400, f"{where} has type 'image'; in chat completions an image is sent as {{\"type\": "
                                f"\"image_url\", \"image_url\": {{\"url\": \"data:image/png;base64,...\"}}}}.",
                           param=f"{where}.type")
    else:
        return None
    if role not in IMAGE_ROLES:
        raise APIError(400, f"{source.param}: images may be sent in user messages (and tool results), not in "
                            f"{role} messages.", param=source.param)
    return source


def _sources(messages: list[dict]) -> list[tuple[int, int, ImageSource]]:
    """(message index, part index, source) of every image part, in conversation order."""
    found = []
    for i, message in enumerate(messages):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            source = _source_of(part, message.get("role"), f"messages[{i}].content[{j}]") \
                if isinstance(part, dict) else None
            if source is not None:
                found.append((i, j, source))
    return found


def refuse_without_vision(state, source: ImageSource) -> None:
    """The 400 for an image sent to a model that cannot see (OpenAI's wording first, then why and what to do)."""
    name = state.model_ids[0] if state.model_ids else "this model"
    raise APIError(400, f"Invalid content type. image_url is only supported by certain models: {source.param} is "
                        f"an {source.kind}, but {name} has no vision (it reads text only), so it cannot read it. "
                        f"Send the content as text, or serve a vision-language model (Qwen3.5 / Qwen3.6 with its "
                        f"vision weights).", code="images_not_supported", param=source.param)


def take_images(state, messages: list[dict]) -> tuple[list[dict], list[ReadImage]]:
    """(messages with each image part replaced by {"type": "image"}, the images read, in prompt order).
    CPU-bound and may download: call it in a worker thread."""
    sources = _sources(messages)
    if not sources:
        return messages, []
    vision = vision_of(state)
    if vision is None:
        refuse_without_vision(state, sources[0][2])
    settings = state.settings
    if len(sources) > settings.max_images:
        extra = sources[settings.max_images][2].param
        raise APIError(400, f"This request has {len(sources)} images; the server takes at most "
                            f"{settings.max_images} per request (--max-images), and {extra} is one too many. Send "
                            f"fewer images.", code="too_many_images", param=extra)
    images = [read_image(source, settings, vision.processor) for _, _, source in sources]
    out = [dict(m) for m in messages]
    for i in {i for i, _, _ in sources}:
        out[i]["content"] = list(out[i]["content"])
    for i, j, _ in sources:
        out[i]["content"][j] = {"type": "image"}
    return out, images


def read_image(source: ImageSource, settings, processor: ImageProcessorConfig) -> ReadImage:
    """One image's bytes, checked to decode, to be of the media type declared for it, and to fit the processor's
    size rules; its grid of patches."""
    data = image_bytes(source.url, settings, source.param)
    try:
        image = open_image(data)
        _check_media_type(source, image.format)
        return ReadImage(data, image_grid(image, processor), source.param)
    except NInferError as e:  # engine.model.image_processing.ImageInputError: undecodable, too large, ...
        raise APIError(400, f"{source.param}: {e}", code="invalid_image", param=source.param) from None


def _check_media_type(source: ImageSource, found: str | None) -> None:
    if source.media_type is None:
        return
    declared = source.media_type.strip().lower()
    actual = MEDIA_TYPES.get(found or "")
    if actual != declared:
        what = actual or (f"{found} (not one of the accepted types)" if found else "of an unknown format")
        raise APIError(400, f"{source.param}: media_type says {declared}, but the image data is {what}. Declare "
                            f"the type the bytes are.", code="invalid_image", param=f"{source.param}.source.media_type")


def image_grid(image, processor: ImageProcessorConfig) -> tuple[int, int, int]:
    """grid_thw of one image as engine.model.image_processing.preprocess would give it, without computing the
    pixels where the processor resizes (the sides come from its smart_resize)."""
    if not processor.do_resize:
        return tuple(int(v) for v in preprocess([image], processor)[1][0])
    height, width = smart_resize(image.height, image.width, processor.factor, processor.min_pixels,
                                 processor.max_pixels)
    return 1, height // processor.patch_size, width // processor.patch_size


def place_images(state, ids: list[int], images: list[ReadImage], param: str) -> list[int]:
    """The prompt with each image's <|image_pad|> repeated to its token count. A 400 when the rendered prompt does
    not hold one placeholder per image (the template dropped one, or the text itself spells the token)."""
    vision = vision_of(state)
    if vision is None:
        return ids
    if not images:
        if vision.image_token_id in ids:
            raise APIError(400, "The prompt's text holds the image placeholder token itself, with no image sent for "
                                "it. Send images as image content parts, not as the placeholder's text.", param=param)
        return ids
    try:
        return expand_image_placeholders(ids, [i.grid for i in images], vision.image_token_id, vision.merge)
    except NInferError as e:
        raise APIError(400, f"The images cannot be placed in the prompt: {e}", param=param) from None
