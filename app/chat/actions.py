"""What the chat transcript's links do, as a part of ChatPanel: copy a message or one of its code blocks (saying
"Copied ✓" in place for a moment), edit a message to send it again (what followed stays as a branch), flip through an
answer's versions or an edited message's branches, show or hide its reasoning, regenerate, open an image bigger."""
from __future__ import annotations

from PySide6.QtCore import QUrl
from PySide6.QtGui import QDesktopServices, QGuiApplication

from app.chat import render, versions


class TranscriptActions:
    """Expects ChatPanel's messages, busy, store, input, edit_bar, expanded, copied, _copied_timer, render(),
    update_context() and regenerate()."""

    def show_version(self, index: int, k: int) -> None:
        """Shows version ``k`` of the turn whose answer begins at ``index``: all of its messages."""
        if self.busy or not 0 <= index < len(self.messages):
            return
        end = versions.turn_end(self.messages, index)
        shown = versions.show(self.messages[index:end], k)
        if shown is None:
            return
        self.messages[index:end] = self.store.replace(self.conversation.id, index, end, shown)
        self.render()
        self.update_context()  # the version shown is what the next message builds on

    def show_branch(self, index: int, k: int) -> None:
        """Shows branch ``k`` from the edited message ``index`` on (what followed each version of it)."""
        if self.busy or not 0 <= index < len(self.messages):
            return
        messages = versions.switch(self.messages[index:], k)
        if messages is None:
            return
        conv = self.conversation
        self.store.truncate(conv.id, index)
        self.messages = self.messages[:index] + [self.store.append(conv.id, m) for m in messages]
        self.render()
        self.update_context()
        self._update_buttons()

    def edit(self, index: int) -> None:
        if self.busy or not (0 <= index < len(self.messages)) or self.messages[index].role != "user":
            return
        self.editing = index
        self.input.setPlainText(self.messages[index].content)
        self.image_tray.set_images(self.messages[index].images)  # resent with the edited text unless removed
        self.input.setFocus()
        self.edit_bar.setVisible(True)

    def cancel_edit(self) -> None:
        self.editing = None
        self.edit_bar.setVisible(False)

    def copy(self, index: int, block: int | None = None) -> None:
        """Copies a message (or its code block ``block``) and says so in its place for a moment."""
        if not 0 <= index < len(self.messages):
            return
        text = self.messages[index].content
        if block is not None:
            blocks = render.code_blocks(text)
            if not 0 <= block < len(blocks):
                return
            text = blocks[block]
        QGuiApplication.clipboard().setText(text)
        self.copied = (index, block)
        self._copied_timer.start()
        self.render()

    def _copied_done(self) -> None:
        self.copied = None
        self.render()

    def _link(self, url: QUrl) -> None:
        if url.scheme() != "ninfer":
            QDesktopServices.openUrl(url)
            return
        action, *numbers = url.path().split("/")
        try:
            i, *more = [int(n) for n in numbers]
        except ValueError:
            return
        if action == "copy":
            self.copy(i)
        elif action == "copycode" and more:
            self.copy(i, more[0])
        elif action == "version" and more:
            self.show_version(i, more[0])
        elif action == "branch" and more:
            self.show_branch(i, more[0])
        elif action == "edit":
            self.edit(i)
        elif action == "regen":
            self.regenerate()
        elif action == "image" and more:
            self.show_image(i, more[0])
        elif action in ("reasoning", "result") and 0 <= i < len(self.messages):  # shown or hidden
            self.expanded ^= {self.messages[i].id}
            self.render()
