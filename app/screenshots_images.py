"""An image in the chat window, on a real X screen (run by scripts/screen_check.sh under Xvfb with openbox):

    python -m app.screenshots_images OUT_DIR

The chat talks to a stand-in server (no model is loaded: its /v1/models card says the model reads images, and it
answers with a fixed text, as the picture is of the window, not of a model's reading). A chart drawn with Pillow is
dropped on the chat through its drop handler and a second image pasted from the clipboard; the pending thumbnails
above the message box are saved (chat-image-pending-WxH.png); then a question is typed and sent, and the
conversation with the user message's thumbnails in the history is saved (chat-image-WxH.png), and the first one
opened bigger, as a click on it does (chat-image-open-WxH.png). NINFER_HOME and HOME should point at empty folders.
"""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from app.client import ChatEvent, Endpoint, MetricsReading
from app.screenshots import _until, run_session, screen_saver

MODEL = "stand-in-vision-model"
QUESTION = "Which bar is the tallest, and what do the two pictures have in common?"
ANSWER = ("The tallest bar is **GPU** at about 92 tokens/s, roughly three times the CPU bar.\n\n"
          "Both pictures use the same palette: indigo, teal and amber.")


class StandInServer:
    """What the chat needs of an ApiClient: a mode, a model card with vision, and a streamed answer."""

    def __init__(self):
        self.endpoint = Endpoint.parse("http://127.0.0.1:8080/v1")
        self.data = {"mode": "chat", "sampling": {"temperature": 0.7, "top_p": 0.95, "top_k": 40}}
        self.requests: list[dict] = []

    async def settings(self):
        return self.data

    async def put_settings(self, changes: dict):
        self.data = {**self.data, **changes}
        return self.data

    async def models(self):
        return [{"id": MODEL, "object": "model", "capabilities": {"chat": True, "vision": True},
                 "input_modalities": ["text", "image"]}]

    async def metrics(self):
        return MetricsReading(False, "a stand-in server has no /metrics")

    async def health(self):
        return 200, {"status": "ok"}

    async def aclose(self):
        pass

    async def stream_chat(self, model, messages, **params):
        self.requests.append({"model": model, "messages": messages, **params})
        for word in ANSWER.split(" "):
            await asyncio.sleep(0.02)
            yield ChatEvent("content", word + " ")
        yield ChatEvent("finish", "stop")
        yield ChatEvent("usage", data={"prompt_tokens": 412, "completion_tokens": 31})


def _chart(path: Path) -> Path:
    """A bar chart, like a screenshot a user would ask about."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (960, 600), "#f8fafc")
    d = ImageDraw.Draw(im)
    d.text((40, 28), "Decode speed (tokens/s)", fill="#1f2328", font_size=36)
    for k, (label, value, colour) in enumerate((("CPU", 31, "#4f46e5"), ("iGPU", 54, "#0d9488"),
                                                ("GPU", 92, "#d97706"))):
        x = 120 + k * 270
        top = 540 - value * 4.6
        d.rectangle((x, top, x + 180, 540), fill=colour)
        d.text((x + 60, 552), label, fill="#1f2328", font_size=28)
        d.text((x + 62, top - 40), str(value), fill="#1f2328", font_size=28)
    d.line((90, 540, 900, 540), fill="#656d76", width=3)
    im.save(path)
    return path


def _swatches():
    """The second image, as pixels on the clipboard (no file behind them)."""
    from PySide6.QtGui import QColor, QImage, QPainter

    q = QImage(480, 320, QImage.Format.Format_RGB32)
    q.fill(QColor("#ffffff"))
    p = QPainter(q)
    for k, colour in enumerate(("#4f46e5", "#0d9488", "#d97706")):
        p.fillRect(30 + k * 150, 60, 120, 200, QColor(colour))
    p.end()
    return q


async def drive(app, controller, out: Path, work: Path) -> None:
    from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
    from PySide6.QtGui import QDropEvent, QGuiApplication
    from PySide6.QtTest import QTest

    save = screen_saver(app, out)
    server = StandInServer()
    controller.endpoint, controller.client, controller.remote, controller.model_id = \
        server.endpoint, server, True, MODEL
    await controller.refresh_mode()
    controller.show_main()
    window = controller.window
    window.resize(1200, 740)
    chat = window.chat
    await asyncio.sleep(0.5)

    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(_chart(work / "decode-speed.png")))])
    chat.dropEvent(QDropEvent(QPointF(300, 200), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                              Qt.KeyboardModifier.NoModifier))
    pasted = QMimeData()
    pasted.setImageData(_swatches())
    QGuiApplication.clipboard().setMimeData(pasted)
    chat.input.setFocus()
    chat.input.paste()
    QTest.keyClicks(chat.input, QUESTION)
    if len(chat.image_tray.images) != 2:
        raise RuntimeError(f"expected two pending images, got {len(chat.image_tray.images)}: {chat.notice.text()}")
    await save("chat-image-pending")

    QTest.mouseClick(chat.send_button, Qt.MouseButton.LeftButton)
    await _until(lambda: not chat.busy, 60, "the answer")
    sent = server.requests[-1]["messages"][-1]["content"]
    if [p["type"] for p in sent] != ["image_url", "image_url", "text"]:
        raise RuntimeError(f"the request did not carry the images: {[p.get('type') for p in sent]}")
    chat.render()
    await save("chat-image")
    chat._link(QUrl("ninfer:image/0/0"))  # as a click on the first thumbnail
    await _until(lambda: chat.image_dialog is not None and chat.image_dialog.isVisible(), 10, "the image dialog")
    await save("chat-image-open")
    chat.image_dialog.reject()


def main(argv: list[str] | None = None) -> int:
    return run_session(drive, argv, work=True)


if __name__ == "__main__":
    sys.exit(main())
