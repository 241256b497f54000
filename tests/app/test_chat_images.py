"""Images in the chat window, with a stand-in client whose /v1/models card says whether the model reads images: a
pasted image (clipboard image data) and a dropped image file go out as data: URI content parts whose bytes decode
(Pillow, the oracle) to the pixels put in; thumbnails in the transcript, opened bigger; a model without vision
refuses the send at once, the box kept; saved, reopened, exported and imported conversations keep the images,
regenerate and edit resend them; oversize, undecodable and too many images are refused with the reason; and the
embedded engine's text-only default model refuses them by its own /v1/models card (the ``started`` engine)."""
from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image
from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
from PySide6.QtGui import QDropEvent, QGuiApplication, QImage, QTextDocument
from PySide6.QtTest import QTest

from app.chat import files as chat_io
from app.chat.images import MAX_IMAGE_BYTES, MAX_IMAGES, THUMB_BOX, ImageRefused, image_from_bytes, thumb_size
from app.chat.store import ConversationStore
from tests.app.conftest import make_controller, run, wait_until
from tests.app.fakes import FakeClient

CHAT = {"mode": "chat", "sampling": {"temperature": 0.7, "top_p": 0.95, "top_k": 40}}
VISION = {"id": "fake-model", "object": "model", "capabilities": {"chat": True, "vision": True},
          "input_modalities": ["text", "image"]}


class CardClient(FakeClient):
    """FakeClient with a /v1/models list (the loaded model's card)."""

    def __init__(self, card: dict | None):
        super().__init__(dict(CHAT), words=["A", " picture", "."], delay=0.01)
        self.cards = [card] if card else []

    async def models(self):
        return self.cards


def pixels(seed: int, size=(400, 300)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)


def encoded(array: np.ndarray, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, fmt)
    return out.getvalue()


def decoded(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def uri_bytes(part: dict) -> tuple[str, bytes]:
    head, _, payload = part["image_url"]["url"].partition(",")
    assert head.startswith("data:") and head.endswith(";base64"), head
    return head[5:-7], base64.b64decode(payload)


@pytest.fixture
def chat_with(qapp, qloop, app_home, request):
    """``chat_with(card)``: (controller, chat, client) with the model's /v1/models card ``card``."""
    made = []

    def make(card: dict | None = VISION):
        controller = make_controller(app_home, f"{request.node.name}-{len(made)}")
        client = CardClient(card)
        controller.client, controller.model_id = client, "fake-model"
        run(controller.refresh_mode())
        controller.show_main()
        made.append(controller)
        return controller, controller.window.chat, client

    yield make
    for controller in made:
        controller.quitting = True
        controller.client = None
        controller.window.hide()
        controller.launcher.hide()


def paste_image(chat, array: np.ndarray) -> None:
    mime = QMimeData()
    mime.setImageData(QImage.fromData(encoded(array)))  # pixels on the clipboard, no file behind them
    QGuiApplication.clipboard().setMimeData(mime)
    chat.input.setFocus()
    chat.input.paste()


def drop_files(chat, paths) -> None:
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(p)) for p in paths])
    event = QDropEvent(QPointF(20, 20), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                       Qt.KeyboardModifier.NoModifier)
    chat.dropEvent(event)
    assert event.isAccepted()


def answer(chat) -> None:
    wait_until(lambda: not chat.busy, 10_000)


def shown_images(chat) -> list[str]:
    """The image names the transcript's document draws."""
    names = []
    block = chat.view.document().begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            fmt = it.fragment().charFormat()
            if fmt.isImageFormat():
                names.append(fmt.toImageFormat().name())
            it += 1
        block = block.next()
    return names


def test_pasted_and_dropped_images_go_out_as_data_uris_of_the_same_pixels(chat_with, tmp_path):
    controller, chat, client = chat_with()
    first, second = pixels(1), pixels(2, (90, 200))
    photo = tmp_path / "photo.png"
    photo.write_bytes(encoded(second))
    paste_image(chat, first)
    assert chat.input.toPlainText() == ""  # the image went to the pending images, not into the text
    drop_files(chat, [photo])
    assert [im.name for im in chat.image_tray.images] == ["pasted image.png", "photo.png"]
    assert chat.image_tray.isVisibleTo(chat) and len(chat.image_tray.remove_buttons()) == 2
    QTest.keyClicks(chat.input, "What is in these?")
    QTest.mouseClick(chat.send_button, Qt.MouseButton.LeftButton)
    answer(chat)
    sent = client.requests[-1]["messages"][-1]
    assert sent["role"] == "user" and [p["type"] for p in sent["content"]] == ["image_url", "image_url", "text"]
    assert sent["content"][2]["text"] == "What is in these?"
    (type1, data1), (type2, data2) = uri_bytes(sent["content"][0]), uri_bytes(sent["content"][1])
    assert type1 == type2 == "image/png"
    np.testing.assert_array_equal(decoded(data1), first)
    np.testing.assert_array_equal(decoded(data2), second)
    assert data2 == photo.read_bytes()  # a PNG file goes out byte for byte
    assert chat.image_tray.images == [] and not chat.image_tray.isVisibleTo(chat)
    assert chat.messages[-1].content == "A picture."

    keys = [im.key for im in chat.messages[0].images]
    assert shown_images(chat) == [f"ninfer-image:{k}" for k in keys]
    thumb = chat.view.loadResource(QTextDocument.ResourceType.ImageResource.value, QUrl(f"ninfer-image:{keys[0]}"))
    assert (thumb.width(), thumb.height()) == thumb_size(400, 300) == THUMB_BOX  # a scaled copy
    assert (thumb.width(), thumb.height()) != (400, 300)
    chat._link(QUrl("ninfer:image/0/1"))  # a click on the second thumbnail
    dialog = chat.image_dialog
    assert dialog.isVisible() and "photo.png (90 x 200)" == dialog.windowTitle()
    assert (dialog.picture.pixmap().width(), dialog.picture.pixmap().height()) == (90, 200)
    dialog.reject()


def test_a_model_without_vision_refuses_the_send_and_keeps_the_box(chat_with, tmp_path):
    controller, chat, client = chat_with({**VISION, "capabilities": {"chat": True, "vision": False},
                                          "input_modalities": ["text"]})
    path = tmp_path / "shot.png"
    path.write_bytes(encoded(pixels(3, (32, 32))))
    assert chat.attach_image_files([str(path)])
    QTest.keyClicks(chat.input, "Describe it.")
    QTest.mouseClick(chat.send_button, Qt.MouseButton.LeftButton)
    assert client.requests == [] and chat.messages == []
    text = chat.notice.text()
    assert chat.notice.isVisibleTo(chat) and "fake-model cannot read images" in text and "1 image" in text
    assert "Change model or settings" in text and "Remove them" in text
    assert chat.input.toPlainText() == "Describe it." and [im.name for im in chat.image_tray.images] == ["shot.png"]
    chat.image_tray.remove_buttons()[0].click()  # without the image the text goes
    assert chat.image_tray.images == []
    assert chat.send()
    answer(chat)
    assert client.requests[-1]["messages"][-1] == {"role": "user", "content": "Describe it."}


def test_a_card_that_says_nothing_about_vision_lets_the_server_decide(chat_with, tmp_path):
    controller, chat, client = chat_with({"id": "fake-model", "object": "model"})
    assert controller.model_reads_images() is None
    path = tmp_path / "a.png"
    path.write_bytes(encoded(pixels(4, (20, 20))))
    assert chat.context_bar.attach(str(path)) is None  # Attach file… with an image: attached as an image
    assert [im.name for im in chat.image_tray.images] == ["a.png"] and chat.context_bar.attachments == []
    assert chat.send("Look.")
    answer(chat)
    assert [p["type"] for p in client.requests[-1]["messages"][-1]["content"]] == ["image_url", "text"]


def test_saved_conversations_keep_the_images_and_resend_them(chat_with, tmp_path, app_home):
    controller, chat, client = chat_with()
    jpeg = tmp_path / "photo.jpg"
    jpeg.write_bytes(encoded(pixels(5, (64, 48)), "JPEG"))
    bmp = tmp_path / "scan.bmp"
    bmp.write_bytes(encoded(pixels(6, (30, 40)), "BMP"))
    drop_files(chat, [jpeg, bmp])
    assert chat.send("Compare them.")
    answer(chat)
    request = client.requests[-1]["messages"][-1]["content"]
    (t1, d1), (t2, d2) = uri_bytes(request[0]), uri_bytes(request[1])
    assert (t1, d1) == ("image/jpeg", jpeg.read_bytes())  # kept as the file was, with its media type
    assert t2 == "image/png"
    np.testing.assert_array_equal(decoded(d2), decoded(bmp.read_bytes()))  # BMP re-encoded, the pixels kept
    conv_id = chat.conversation.id

    reopened = ConversationStore(controller.store.path).messages(conv_id)  # from the database file itself
    assert [(im.media_type, im.data) for im in reopened[0].images] == [(t1, d1), (t2, d2)]
    chat.open(None)
    chat.open(conv_id)
    assert len(shown_images(chat)) == 2
    assert chat.regenerate()
    answer(chat)
    assert client.requests[-1]["messages"][-1]["content"] == request  # regenerate resends them

    chat.edit(0)
    assert [im.data for im in chat.image_tray.images] == [d1, d2]
    chat.input.setPlainText("Which is darker?")
    assert chat.send()
    answer(chat)
    assert client.requests[-1]["messages"][-1]["content"][:2] == request[:2]
    assert client.requests[-1]["messages"][-1]["content"][2]["text"] == "Which is darker?"

    exported = chat_io.to_json(chat.conversation, chat.messages)
    assert json.loads(exported)["messages"][0]["images"][0]["data"] == base64.b64encode(d1).decode()
    _, _, _, messages = chat_io.from_json(exported)
    assert [(im.media_type, im.data) for im in messages[0].images] == [(t1, d1), (t2, d2)]
    openai_style = json.dumps([{"role": "user", "content": request}])  # OpenAI content parts import too
    _, _, _, messages = chat_io.from_json(openai_style)
    assert [im.data for im in messages[0].images] == [d1, d2] and messages[0].content == "Compare them."


def test_oversize_undecodable_and_too_many_images_are_refused(chat_with, tmp_path):
    controller, chat, client = chat_with()
    QTest.keyClicks(chat.input, "Keep this text.")
    big = tmp_path / "big.png"
    big.write_bytes(b"\x89PNG" + b"\0" * MAX_IMAGE_BYTES)
    assert not chat.attach_image_files([str(big)])
    assert "big.png is 10.0 MiB" in chat.notice.text() and "at most 10.0 MiB" in chat.notice.text()
    broken = tmp_path / "broken.png"
    broken.write_bytes(encoded(pixels(7, (50, 50)))[:300])  # a truncated file
    assert not chat.attach_image_files([str(broken)])
    assert "broken.png is not an image Pillow can open" in chat.notice.text()
    mime = QMimeData()
    mime.setData("image/png", b"not a png at all")
    QGuiApplication.clipboard().setMimeData(mime)
    chat.input.paste()
    assert "pasted image.png is not an image Pillow can open" in chat.notice.text()
    assert chat.image_tray.images == [] and chat.input.toPlainText() == "Keep this text."

    small = []
    for k in range(MAX_IMAGES + 1):
        small.append(tmp_path / f"s{k}.png")
        small[-1].write_bytes(encoded(pixels(10 + k, (8, 8))))
    drop_files(chat, small)  # 17 at once: none of them
    assert chat.image_tray.images == [] and f"at most {MAX_IMAGES} images" in chat.notice.text()
    drop_files(chat, small[:MAX_IMAGES])
    assert len(chat.image_tray.images) == MAX_IMAGES and not chat.notice.isVisibleTo(chat)
    assert not chat.attach_image_files([str(small[-1])])
    assert len(chat.image_tray.images) == MAX_IMAGES and "it holds 16 already" in chat.notice.text()
    assert chat.input.toPlainText() == "Keep this text."
    bad_file = json.dumps([{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(b"garbage").decode()}}]}])
    with pytest.raises(chat_io.ConversationFileError, match="Message 1: image 1 is not an image Pillow can open"):
        chat_io.from_json(bad_file)
    with pytest.raises(ImageRefused, match="not an image Pillow can open"):
        image_from_bytes(b"GIF89a" + b"\0" * 20, "x.gif")


def test_a_webp_image_keeps_its_bytes_and_gets_a_thumbnail():
    from app.chat.image_tray import thumbnail
    array = pixels(30, (300, 100))
    data = encoded(array, "WEBP")
    image = image_from_bytes(data, "x.webp")
    assert (image.media_type, image.data, image.width, image.height) == ("image/webp", data, 300, 100)
    thumb = thumbnail(image, THUMB_BOX)
    assert (thumb.width(), thumb.height()) == thumb_size(300, 100) == (160, 53)


def test_the_embedded_text_model_refuses_images_by_its_own_card(started, tmp_path):
    """The real server's /v1/models card for the default (text-only) model, read over HTTP when the chat connects."""
    controller, window = started
    chat = window.chat
    assert controller.model_card is not None and controller.model_card["id"] == controller.model_id
    assert controller.model_reads_images() is False
    window.new_chat()
    path = tmp_path / "shot.png"
    path.write_bytes(encoded(pixels(40, (64, 64))))
    assert chat.attach_image_files([str(path)])
    chat.input.setPlainText("What is this?")
    n = len(chat.messages)
    assert not chat.send()
    assert f"{controller.model_id} cannot read images" in chat.notice.text() and len(chat.messages) == n
    assert chat.input.toPlainText() == "What is this?" and len(chat.image_tray.images) == 1
    chat.image_tray.clear()
    chat.input.clear()
