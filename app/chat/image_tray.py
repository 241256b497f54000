"""The images waiting to be sent with the next message: a row of thumbnails above the message box, each with ✕ to
remove it; and what a paste or a drop offers as images (image files by their URLs, or image data)."""
from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QBuffer, QByteArray, QIODevice, QMimeData, Qt, Signal
from PySide6.QtGui import QImage, QPixmap
from PySide6.QtWidgets import QHBoxLayout, QLabel, QToolButton, QVBoxLayout, QWidget

from app.chat.images import IMAGE_SUFFIXES, ChatImage, ImageRefused, image_from_bytes, png_bytes, read_image_file

TRAY_BOX = (72, 56)  # a pending image's thumbnail fits this box
RAW_FORMATS = ("image/png", "image/jpeg", "image/webp", "image/gif")  # clipboard data kept byte for byte


def thumbnail(image: ChatImage, box: tuple[int, int]) -> QImage:
    """A scaled copy of ``image`` that fits ``box`` (never enlarged)."""
    q = QImage.fromData(image.data)
    if q.isNull():  # a format this Qt has no plugin for (WebP without qt-imageformats): Pillow decoded it
        q = QImage.fromData(png_bytes(image.data))
    if q.isNull() or (q.width() <= box[0] and q.height() <= box[1]):
        return q
    return q.scaled(box[0], box[1], Qt.AspectRatioMode.KeepAspectRatio, Qt.TransformationMode.SmoothTransformation)


def image_files(mime: QMimeData) -> list[Path]:
    """The local image files among a paste's or a drop's URLs (by their suffix)."""
    if not mime.hasUrls():
        return []
    return [Path(u.toLocalFile()) for u in mime.urls()
            if u.isLocalFile() and Path(u.toLocalFile()).suffix.lower() in IMAGE_SUFFIXES]


def offers_images(mime: QMimeData) -> bool:
    return bool(image_files(mime)) or mime.hasImage() or any(mime.hasFormat(f) for f in RAW_FORMATS)


def images_from_mime(mime: QMimeData) -> tuple[list[ChatImage], list[str]]:
    """(the images a paste or drop offers, why each of the others cannot be attached)."""
    files = image_files(mime)
    if files:
        found, problems = [], []
        for path in files:
            try:
                found.append(read_image_file(path))
            except ImageRefused as e:
                problems.append(str(e))
        return found, problems
    for fmt in RAW_FORMATS:  # the application that copied it gave the file's own bytes
        if mime.hasFormat(fmt):
            data = bytes(mime.data(fmt).data())
            try:
                return [image_from_bytes(data, f"pasted image.{fmt.split('/')[1]}")], []
            except ImageRefused as e:
                return [], [str(e)]
    q = mime.imageData() if mime.hasImage() else None
    if not isinstance(q, QImage) or q.isNull():
        return [], ["the clipboard holds no image Qt can read; save it as a file and attach that."] if mime.hasImage() \
            else []
    buffer = QByteArray()
    device = QBuffer(buffer)
    device.open(QIODevice.OpenModeFlag.WriteOnly)
    q.save(device, "PNG")  # pixels without a file: PNG keeps them exactly
    try:
        return [image_from_bytes(bytes(buffer.data()), "pasted image.png")], []
    except ImageRefused as e:
        return [], [str(e)]


class ImageTray(QWidget):
    """The pending images, in the order attached; hidden while there are none."""

    changed = Signal()

    def __init__(self, parent=None):
        super().__init__(parent)
        self.images: list[ChatImage] = []
        self.row = QHBoxLayout(self)
        self.row.setContentsMargins(0, 0, 0, 0)
        self.row.addStretch(1)
        self.setVisible(False)

    def add(self, images: list[ChatImage]) -> None:
        self.set_images(self.images + list(images))

    def remove(self, k: int) -> None:
        if 0 <= k < len(self.images):
            self.set_images(self.images[:k] + self.images[k + 1:])

    def clear(self) -> None:
        self.set_images([])

    def set_images(self, images: list[ChatImage]) -> None:
        self.images = list(images)
        while self.row.count() > 1:
            item = self.row.takeAt(0)
            if item.widget() is not None:
                item.widget().deleteLater()
        for k, image in enumerate(self.images):
            self.row.insertWidget(k, self._item(k, image))
        self.setVisible(bool(self.images))
        self.changed.emit()

    def _item(self, k: int, image: ChatImage) -> QWidget:
        item = QWidget()
        item.setObjectName("PendingImage")
        item.setToolTip(f"{image.name}: {image.width} x {image.height}, sent with the next message")
        layout = QVBoxLayout(item)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(0)
        remove = QToolButton()
        remove.setText("✕")
        remove.setToolTip(f"Remove {image.name}")
        remove.setAutoRaise(True)
        remove.clicked.connect(lambda: self.remove(k))
        layout.addWidget(remove, 0, Qt.AlignmentFlag.AlignRight)
        picture = QLabel()
        picture.setPixmap(QPixmap.fromImage(thumbnail(image, TRAY_BOX)))
        picture.setFixedSize(*TRAY_BOX)
        picture.setAlignment(Qt.AlignmentFlag.AlignCenter)
        layout.addWidget(picture)
        return item

    def remove_buttons(self) -> list[QToolButton]:
        return [self.row.itemAt(k).widget().findChild(QToolButton) for k in range(len(self.images))]
