"""A layout that places its widgets in a row and wraps onto the next row when the width runs out (like words in a
paragraph), so a row of many checkboxes never makes its window wider. Height for width: the parent layout gives it
the rows it needs."""
from __future__ import annotations

from PySide6.QtCore import QPoint, QRect, QSize, Qt
from PySide6.QtWidgets import QLayout, QLayoutItem, QWidget


class FlowLayout(QLayout):
    def __init__(self, parent: QWidget | None = None, spacing: int = 8):
        super().__init__(parent)
        self._items: list[QLayoutItem] = []
        self._spacing = spacing
        self.setContentsMargins(0, 0, 0, 0)

    # ---- QLayout's item list ---------------------------------------------------------------------------------------
    def addItem(self, item: QLayoutItem) -> None:  # noqa: N802 (Qt's names)
        self._items.append(item)

    def insertWidget(self, index: int, widget: QWidget) -> None:  # noqa: N802
        self.addWidget(widget)  # (Qt makes its item and hands it to addItem, last)
        self._items.insert(max(0, min(index, len(self._items) - 1)), self._items.pop())
        self.invalidate()

    def count(self) -> int:
        return len(self._items)

    def itemAt(self, index: int) -> QLayoutItem | None:  # noqa: N802
        return self._items[index] if 0 <= index < len(self._items) else None

    def takeAt(self, index: int) -> QLayoutItem | None:  # noqa: N802
        return self._items.pop(index) if 0 <= index < len(self._items) else None

    # ---- sizes -------------------------------------------------------------------------------------------------------
    def expandingDirections(self) -> Qt.Orientation:  # noqa: N802
        return Qt.Orientation(0)

    def hasHeightForWidth(self) -> bool:  # noqa: N802
        return True

    def heightForWidth(self, width: int) -> int:  # noqa: N802
        return self._place(QRect(0, 0, width, 0), move=False)

    def sizeHint(self) -> QSize:  # noqa: N802
        return self.minimumSize()

    def minimumSize(self) -> QSize:  # noqa: N802
        """The widest item: narrower than that, an item would be cut."""
        size = QSize()
        for item in self._items:
            size = size.expandedTo(item.minimumSize().expandedTo(item.sizeHint()))
        m = self.contentsMargins()
        return size + QSize(m.left() + m.right(), m.top() + m.bottom())

    def setGeometry(self, rect: QRect) -> None:  # noqa: N802
        super().setGeometry(rect)
        self._place(rect, move=True)

    def _place(self, rect: QRect, move: bool) -> int:
        """Lays the items out in ``rect`` row by row, each centred in its row's height (moving them when ``move``);
        returns the height used."""
        m = self.contentsMargins()
        area = rect.adjusted(m.left(), m.top(), -m.right(), -m.bottom())
        rows: list[list[tuple[QLayoutItem, int, QSize]]] = [[]]
        x = area.x()
        for item in self._items:
            if item.isEmpty():
                continue
            hint = item.sizeHint()
            if rows[-1] and x + hint.width() > area.right() + 1:
                rows.append([])
                x = area.x()
            rows[-1].append((item, x, hint))
            x += hint.width() + self._spacing
        y = area.y()
        for row in filter(None, rows):
            height = max(hint.height() for _, _, hint in row)
            if move:
                for item, left, hint in row:
                    item.setGeometry(QRect(QPoint(left, y + (height - hint.height()) // 2),
                                           QSize(min(hint.width(), area.width()), hint.height())))
            y += height + self._spacing
        return max(y - self._spacing, area.y()) - rect.y() + m.bottom()
