"""The images of the transcript: the transcript's browser draws each message's thumbnails from the images' bytes
(an <img> names its image by content hash, ninfer-image:KEY), and a click on one opens it bigger in a dialog."""
from __future__ import annotations

from PySide6.QtCore import Qt, QUrl
from PySide6.QtGui import QGuiApplication, QPixmap, QTextDocument
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QLabel, QScrollArea, QTextBrowser, QVBoxLayout

from app.chat.image_tray import thumbnail
from app.chat.images import THUMB_BOX, ChatImage

SCHEME = "ninfer-image"
SCREEN_SHARE = 0.85  # the dialog's picture fits this share of the screen


class TranscriptBrowser(QTextBrowser):
    """A QTextBrowser that draws ``ninfer-image:KEY`` from ``images`` (set before each setHtml), as thumbnails."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.images: dict[str, ChatImage] = {}
        self._thumbs: dict[str, object] = {}  # key -> QImage, kept across repaints while the answer streams

    def set_images(self, images: dict[str, ChatImage]) -> None:
        self.images = images
        self._thumbs = {k: v for k, v in self._thumbs.items() if k in images}

    def loadResource(self, kind: int, url: QUrl):
        if url.scheme() == SCHEME and kind == int(QTextDocument.ResourceType.ImageResource.value):
            key = url.path()
            if key not in self._thumbs and key in self.images:
                self._thumbs[key] = thumbnail(self.images[key], THUMB_BOX)
            return self._thumbs.get(key)
        return super().loadResource(kind, url)


class ImageDialog(QDialog):
    """One image, as big as fits the screen (never enlarged), with its name and size."""

    def __init__(self, image: ChatImage, parent=None):
        super().__init__(parent)
        self.setWindowTitle(f"{image.name} ({image.width} x {image.height})")
        layout = QVBoxLayout(self)
        self.picture = QLabel()
        self.picture.setAlignment(Qt.AlignmentFlag.AlignCenter)
        pixmap = QPixmap.fromImage(thumbnail(image, (image.width, image.height)))  # (decoded, not scaled)
        screen = (parent.screen() if parent is not None else QGuiApplication.primaryScreen()).availableGeometry()
        w, h = int(screen.width() * SCREEN_SHARE), int(screen.height() * SCREEN_SHARE) - 60
        if pixmap.width() > w or pixmap.height() > h:
            pixmap = pixmap.scaled(w, h, Qt.AspectRatioMode.KeepAspectRatio, Qt.TransformationMode.SmoothTransformation)
        self.picture.setPixmap(pixmap)
        scroll = QScrollArea()
        scroll.setWidget(self.picture)
        scroll.setWidgetResizable(True)
        scroll.setMinimumSize(min(pixmap.width() + 4, w), min(pixmap.height() + 4, h))
        layout.addWidget(scroll, 1)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)
