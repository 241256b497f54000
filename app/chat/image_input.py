"""Images into the chat, as a part of ChatPanel: Attach image… (a file dialog of images), a paste into the message
box, a drop anywhere on the chat; each image checked as it comes (app/chat/images.py), a refusal said in the chat's
notice with nothing else lost; the send refused at once when the loaded model's card says it has no vision; a
thumbnail in the transcript opened bigger."""
from __future__ import annotations

from pathlib import Path

from PySide6.QtWidgets import QFileDialog

from app.chat.context_bar import CANNOT_ATTACH
from app.chat.image_tray import images_from_mime, offers_images
from app.chat.image_view import ImageDialog
from app.chat.images import FILE_FILTER, ChatImage, ImageRefused, check_count, read_image_file
from app.widgets import last_folder, remember_folder

NOT_SENT = "⚠ Not sent: "


class ImageInput:
    """Expects ChatPanel's controller, image_tray, notice, messages and update_context()."""

    image_dialog = None

    def ask_image_files(self) -> list[str]:
        config = getattr(self.controller, "config", None)
        return QFileDialog.getOpenFileNames(self, "Attach images", str(last_folder(config, "attach")), FILE_FILTER)[0]

    def attach_image_files(self, paths: list[str] | None = None) -> bool:
        """Attaches image files (None: asks for them); False when none was attached (the notice says why)."""
        paths = self.ask_image_files() if paths is None else paths
        found, problems = [], []
        for path in paths:
            try:
                found.append(read_image_file(Path(path)))
            except ImageRefused as e:
                problems.append(str(e))
        if paths:
            remember_folder(getattr(self.controller, "config", None), "attach", paths[-1])
        return self.attach_images(found, problems)

    def attach_images_from(self, mime) -> bool:
        """A paste's or a drop's images (image files, or image data)."""
        return self.attach_images(*images_from_mime(mime))

    def attach_images(self, found: list[ChatImage], problems: list[str] = ()) -> bool:
        problems = list(problems)
        try:
            check_count(len(self.image_tray.images), len(found))
        except ImageRefused as e:  # the whole batch: a message never carries some of a drop silently
            found, problems = [], [str(e)] + problems
        if found:
            self.image_tray.add(found)
        if problems:
            self.notice.setText(CANNOT_ATTACH + " ".join(problems))
            self.notice.setVisible(True)
        elif found and self.notice.text().startswith((CANNOT_ATTACH, NOT_SENT)):  # no longer the news
            self.notice.setVisible(False)
        return bool(found)

    # ---- drag and drop onto the chat ---------------------------------------------------------------------------
    def dragEnterEvent(self, event) -> None:
        if offers_images(event.mimeData()):
            event.acceptProposedAction()
        else:
            event.ignore()

    def dragMoveEvent(self, event) -> None:
        self.dragEnterEvent(event)

    def dropEvent(self, event) -> None:
        if offers_images(event.mimeData()):
            self.attach_images_from(event.mimeData())
            event.acceptProposedAction()
        else:
            event.ignore()

    # ---- sending ---------------------------------------------------------------------------------------------------
    def vision_refusal(self, images: list[ChatImage]) -> str | None:
        """Why a message with ``images`` is not sent (the model's card says it has no vision), or None: a card
        that says nothing about vision lets the send through, and the server decides."""
        reads = getattr(self.controller, "model_reads_images", None)
        if not images or reads is None or reads() is not False:
            return None
        model = self.controller.model_id or "The model"
        n = f"{len(images)} image{'s' if len(images) > 1 else ''}"
        fix = ("pick a model that reads images on that server" if getattr(self.controller, "remote", False) else
               "load one that does (a Qwen3.5 or Qwen3.6 with its vision part, the mmproj file beside the GGUF) with "
               "File › Change model or settings…")
        return (f"{NOT_SENT}{model} cannot read images (its /v1/models card says it has no vision), and this "
                f"message has {n}. Remove them (✕ on each) to send the text alone, or {fix}.")

    # ---- the transcript's thumbnails ---------------------------------------------------------------------------
    def show_image(self, index: int, k: int) -> None:
        """Opens image ``k`` of message ``index`` bigger (not modal: the chat goes on meanwhile)."""
        if not 0 <= index < len(self.messages) or not 0 <= k < len(self.messages[index].images):
            return
        if self.image_dialog is not None:
            self.image_dialog.deleteLater()
        self.image_dialog = ImageDialog(self.messages[index].images[k], self)
        self.image_dialog.open()
